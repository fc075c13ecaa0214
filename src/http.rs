//! idem over HTTP, for [axum](https://docs.rs/axum) (feature `axum`).
//!
//! * [`IdempotencyKey`]: the `Idempotency-Key` request header of the IETF
//!   httpapi draft, an RFC 8941 sf-string (`"..."`) or a bare token; missing
//!   on an endpoint that takes it → 400. `Option<IdempotencyKey>` makes it
//!   optional.
//! * [`IfMatch`]: the `If-Match` request header as the row version it names;
//!   missing → 428, malformed → 400, a tag that can never match → 412.
//!   `Option<IfMatch>` makes it optional.
//! * [`Problem`]: an RFC 9457 `application/problem+json` response, built from
//!   each of idem's errors with the status a client can act on (see the table
//!   below).
//! * [`StoredResponse`]: the status and body an `#[idempotent]` function
//!   returns, so that both are stored under the key and a replay answers with
//!   the first status as well as the first body.
//! * [`IdempotentResponse`]: a response that carries
//!   `Idempotent-Replayed: true` when it is a replay.
//! * [`WithETag`]: a response with the strong `ETag` of a row version
//!   ([`etag`]).
//!
//! # idem's outcomes as HTTP statuses
//!
//! One table decides them: [`HttpStatus`], which [`Problem`] reads.
//!
//! | outcome | status | `type` |
//! |---|---|---|
//! | replay of a stored response | the first status and body, plus `Idempotent-Replayed: true` | |
//! | `Idempotency-Key` missing where required | 400 | [`problem_type::IDEMPOTENCY_KEY_MISSING`] |
//! | `Idempotency-Key` malformed or invalid | 400 | [`problem_type::IDEMPOTENCY_KEY_INVALID`] |
//! | [`Error::FingerprintMismatch`] | 422 | [`problem_type::FINGERPRINT_MISMATCH`] |
//! | [`Error::InProgress`] | 409, `Retry-After: 1` | [`problem_type::IN_PROGRESS`] |
//! | [`Error::OutcomeUnknown`] (external mode; local mode after a body's own `COMMIT`) | 502 | [`problem_type::OUTCOME_UNKNOWN`] |
//! | [`Error::ClaimLost`] (external mode) | 409 | [`problem_type::IN_PROGRESS`] |
//! | [`Error::Exhausted`] (lost races) | 409 | [`problem_type::RETRIES_EXHAUSTED`] |
//! | [`Error::Exhausted`] (the deadline passed: [`RetryCause::is_timeout`](crate::RetryCause::is_timeout); or rows stayed locked through every attempt: [`RetryCause::LockNotAvailable`](crate::RetryCause::LockNotAvailable)) | 503, `Retry-After: 1` | [`problem_type::UNAVAILABLE`] |
//! | [`Error::CommitUnknown`] (wherever the commit was) | 503, `Retry-After: 1` | [`problem_type::COMMIT_OUTCOME_UNKNOWN`] |
//! | [`Error::Pool`] | 503, `Retry-After: 1` | [`problem_type::UNAVAILABLE`] |
//! | `If-Match` missing where required | 428 | [`problem_type::PRECONDITION_REQUIRED`] |
//! | `If-Match` malformed or ambiguous ([`EtagError`] 400) | 400 | [`problem_type::IF_MATCH_INVALID`] |
//! | `If-Match` can never match ([`EtagError`] 412), [`VersionedError::Stale`] | 412 | [`problem_type::PRECONDITION_FAILED`] |
//! | [`VersionedError::NotFound`] | 404 | [`problem_type::NOT_FOUND`] |
//! | [`VersionedError::StateMismatch`], [`VersionedError::IllegalTransition`] | 409 | [`problem_type::STATE_CONFLICT`] |
//! | [`CreateOnceError::Mismatch`] (a key reused for another request) | 422 | [`problem_type::FINGERPRINT_MISMATCH`] |
//! | [`CreateOnceError::Conflict`] (another row holds a unique value) | 409 | [`problem_type::UNIQUE_CONFLICT`] |
//! | [`CreateOnceError::MissingKey`] | 400 | [`problem_type::IDEMPOTENCY_KEY_MISSING`] |
//! | a database error of [`Error`], [`VersionedError`] or [`CreateOnceError`] that a retry loop would have replayed, reaching the handler unreplayed (as [`Transient`](crate::Transient) reads it): a lost race (40001, 40P01); the transaction that lost was rolled back, what the handler committed before it stays | 409, `attempts: 1` | [`problem_type::RETRIES_EXHAUSTED`] |
//! | the same: rows locked past a `lock_timeout` of the handler's own, or `NOWAIT` (55P03) | 503, `Retry-After: 1` | [`problem_type::UNAVAILABLE`] |
//! | anything else (database, serialization, a connection lost: it may have committed) | 500, details logged, not sent | [`problem_type::INTERNAL`] |
//!
//! # Keeping the first status
//!
//! `#[idempotent]` stores what the function returns (`T`) and, for errors its
//! error type declares final, what [`IdempotentError::to_final`] returns. So the
//! status must be part of those values:
//!
//! * a success returns [`StoredResponse<T>`]: `{ "status": 201, "body": .. }`
//!   is what is stored, and a replay answers with that status and body;
//! * a final error is stored in its typed form and turned into the same
//!   [`Problem`] (same status, same body) by the same code on every replay.
//!   [`IdempotentError::from_final`] is only ever called for a replay, so it
//!   is the place to remember that the error is one (see the example on
//!   [`IdempotentResponse`]).
//!
//! # Example
//!
//! ```
//! use axum::{routing::post, Json, Router};
//! use idem::http::{IdempotencyKey, IdempotentResponse, Problem, StoredResponse};
//! use idem::Idempotent;
//!
//! #[derive(serde::Serialize, serde::Deserialize)]
//! struct Created { id: i64 }
//!
//! // Stands in for an #[idempotent] function, which returns
//! // Result<Idempotent<StoredResponse<Created>>, E>.
//! async fn create(key: &str) -> Result<Idempotent<StoredResponse<Created>>, Problem> {
//!     let _ = key;
//!     Ok(Idempotent { value: StoredResponse::created(Created { id: 7 }), replayed: false })
//! }
//!
//! async fn handler(key: IdempotencyKey) -> Result<IdempotentResponse<StoredResponse<Created>>, Problem> {
//!     Ok(create(key.as_str()).await?.into())
//! }
//!
//! let app: Router = Router::new().route("/things", post(handler));
//! ```

pub mod etag;
mod key;
mod precondition;
mod problem;
mod response;
mod status;

use axum::http::HeaderName;

pub use key::IdempotencyKey;
pub use precondition::{IfMatch, WithETag};
pub use problem::{problem_type, Problem};
pub use response::{IdempotentResponse, StoredResponse};
pub use status::HttpStatus;

#[cfg(doc)]
use crate::{CreateOnceError, Error, IdempotentError, VersionedError};
#[cfg(doc)]
use etag::EtagError;

/// `Idempotency-Key`, the request header that names a request across retries
/// (IETF httpapi draft `draft-ietf-httpapi-idempotency-key-header`).
///
/// ```
/// assert_eq!(idem::http::IDEMPOTENCY_KEY.as_str(), "idempotency-key");
/// ```
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// `Idempotent-Replayed`, set to `true` on a response that is the stored
/// response of an earlier request with the same key (the body did not run).
///
/// ```
/// assert_eq!(idem::http::IDEMPOTENT_REPLAYED.as_str(), "idempotent-replayed");
/// ```
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The media type of a [`Problem`] body (RFC 9457).
///
/// ```
/// assert_eq!(idem::http::PROBLEM_JSON, "application/problem+json");
/// ```
pub const PROBLEM_JSON: &str = "application/problem+json";
