use axum::http::header::{CONTENT_TYPE, RETRY_AFTER};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::etag::{etag_for_version, EtagError};
use super::status::{busy, unreplayed};
use super::HttpStatus;
use crate::idempotency::OUTCOME_UNKNOWN_MESSAGE;
use crate::{CreateOnceError, Error, Transient, VersionedError};

/// The `type` URIs of the problems idem answers with; clients switch on these,
/// not on `title` or `detail`.
///
/// ```
/// use idem::http::{problem_type, Problem};
/// use idem::Error;
///
/// let problem = Problem::from(Error::InProgress);
/// match problem.type_uri() {
///     problem_type::IN_PROGRESS => { /* wait, then retry with the same key */ }
///     other => panic!("unexpected {other}"),
/// }
/// ```
pub mod problem_type {
    /// 400: the endpoint requires an `Idempotency-Key` header and none was sent.
    pub const IDEMPOTENCY_KEY_MISSING: &str = "urn:idem:problem:idempotency-key-missing";
    /// 400: the `Idempotency-Key` header is not an sf-string or token, or the
    /// key is empty, blank (spaces only), longer than 255 bytes or sent twice.
    pub const IDEMPOTENCY_KEY_INVALID: &str = "urn:idem:problem:idempotency-key-invalid";
    /// 422: the key was used before for a different request. Nothing was done.
    pub const FINGERPRINT_MISMATCH: &str = "urn:idem:problem:fingerprint-mismatch";
    /// 409: the first request with this key is still running; retry later
    /// with the same key.
    pub const IN_PROGRESS: &str = "urn:idem:problem:request-in-progress";
    /// 502: the first request with this key may have taken effect (reached
    /// another system, or committed by hand in local mode) and its outcome
    /// is not known here; it is not run again until the key is settled.
    pub const OUTCOME_UNKNOWN: &str = "urn:idem:problem:outcome-unknown";
    /// 409: every attempt lost a race for the same rows; nothing was
    /// committed, and the request may be sent again. Also a race lost by a
    /// handler under no retry loop (`attempts: 1`): then only the
    /// transaction that lost is known to have been rolled back.
    pub const RETRIES_EXHAUSTED: &str = "urn:idem:problem:retries-exhausted";
    /// 503: the connection failed while the commit was in flight; retry with
    /// the same `Idempotency-Key`, whose record tells whether it committed.
    pub const COMMIT_OUTCOME_UNKNOWN: &str = "urn:idem:problem:commit-outcome-unknown";
    /// 503: no database connection was free in time, the request's deadline
    /// passed while it waited on the database, or rows it needed stayed
    /// locked; nothing was done (under no retry loop: the transaction that
    /// waited was rolled back).
    pub const UNAVAILABLE: &str = "urn:idem:problem:unavailable";
    /// 422: the response could not be stored under the key; nothing was done.
    pub const RESPONSE_UNSTORABLE: &str = "urn:idem:problem:response-unstorable";
    /// 428: the endpoint requires an `If-Match` header and none was sent.
    pub const PRECONDITION_REQUIRED: &str = "urn:idem:problem:precondition-required";
    /// 400: the `If-Match` header is malformed or names two versions.
    pub const IF_MATCH_INVALID: &str = "urn:idem:problem:if-match-invalid";
    /// 412: the resource is no longer at the version the client read.
    pub const PRECONDITION_FAILED: &str = "urn:idem:problem:precondition-failed";
    /// 404: no such resource (in this tenant).
    pub const NOT_FOUND: &str = "urn:idem:problem:not-found";
    /// 409: the resource is not in the state the transition requires.
    pub const STATE_CONFLICT: &str = "urn:idem:problem:state-conflict";
    /// 409: another resource already holds one of this one's unique values
    /// (`create_once`); nothing was created.
    pub const UNIQUE_CONFLICT: &str = "urn:idem:problem:unique-conflict";
    /// 500: something failed that the client cannot act on; the details are
    /// logged, not sent.
    pub const INTERNAL: &str = "urn:idem:problem:internal";
}

/// An RFC 9457 problem: `{ "type", "title", "status", "detail", ..extensions }`,
/// answered as `application/problem+json` with its status.
///
/// Every error of idem converts into one (`Problem::from(&err)` or
/// `Problem::from(err)`), with the status of the table in [the module
/// docs](crate::http); your own errors build theirs with [`Problem::new`].
/// It serializes to exactly its body, so it can also be stored as an
/// idempotent function's final error and replayed byte for byte.
///
/// ```
/// use axum::http::StatusCode;
/// use idem::http::Problem;
///
/// let problem = Problem::new(
///     StatusCode::UNPROCESSABLE_ENTITY,
///     "https://example.com/problems/insufficient-funds",
///     "Insufficient funds",
///     "account 1 holds 50, less than the 100 requested",
/// )
/// .with("balance", 50);
/// assert_eq!(problem.status(), StatusCode::UNPROCESSABLE_ENTITY);
/// assert_eq!(
///     serde_json::to_value(&problem).unwrap(),
///     serde_json::json!({
///         "type": "https://example.com/problems/insufficient-funds",
///         "title": "Insufficient funds",
///         "status": 422,
///         "detail": "account 1 holds 50, less than the 100 requested",
///         "balance": 50,
///     })
/// );
/// ```
///
/// ```
/// use idem::http::{problem_type, Problem};
/// use idem::Error;
///
/// let problem = Problem::from(Error::FingerprintMismatch);
/// assert_eq!(problem.status().as_u16(), 422);
/// assert_eq!(problem.type_uri(), problem_type::FINGERPRINT_MISMATCH);
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Problem {
    #[serde(rename = "type")]
    type_uri: String,
    title: String,
    status: u16,
    detail: String,
    #[serde(flatten)]
    extensions: Map<String, Value>,
    /// A header, not part of the body: never stored.
    #[serde(skip)]
    retry_after: Option<u32>,
}

impl Problem {
    /// A problem with the given status, `type` URI, short `title` (the same for
    /// every occurrence of the type) and `detail` (this occurrence, written for
    /// the client).
    ///
    /// ```
    /// use axum::http::StatusCode;
    /// let p = idem::http::Problem::new(StatusCode::NOT_FOUND, "about:blank", "Not Found", "no account 9");
    /// assert_eq!(p.detail(), "no account 9");
    /// ```
    pub fn new(
        status: StatusCode,
        type_uri: impl Into<String>,
        title: impl Into<String>,
        detail: impl Into<String>,
    ) -> Problem {
        Problem {
            type_uri: type_uri.into(),
            title: title.into(),
            status: status.as_u16(),
            detail: detail.into(),
            extensions: Map::new(),
            retry_after: None,
        }
    }

    /// Add an extension member (RFC 9457 §3.2). The standard members cannot be
    /// replaced this way: `type`, `title`, `status` and `detail` are ignored.
    ///
    /// ```
    /// use axum::http::StatusCode;
    /// let p = idem::http::Problem::new(StatusCode::CONFLICT, "about:blank", "Conflict", "busy")
    ///     .with("attempts", 4)
    ///     .with("status", 200);
    /// assert_eq!(p.extensions()["attempts"], 4);
    /// assert_eq!(p.status().as_u16(), 409);
    /// ```
    #[must_use]
    pub fn with(mut self, name: &str, value: impl Into<Value>) -> Problem {
        if !matches!(name, "type" | "title" | "status" | "detail") {
            self.extensions.insert(name.to_owned(), value.into());
        }
        self
    }

    /// Answer with a `Retry-After` header of `seconds` (not part of the body).
    ///
    /// ```
    /// use axum::{http::StatusCode, response::IntoResponse};
    /// let p = idem::http::Problem::new(StatusCode::SERVICE_UNAVAILABLE, "about:blank", "Busy", "later")
    ///     .retry_after(2);
    /// assert_eq!(p.into_response().headers()["retry-after"], "2");
    /// ```
    #[must_use]
    pub fn retry_after(mut self, seconds: u32) -> Problem {
        self.retry_after = Some(seconds);
        self
    }

    /// The status (500 if the stored number is not a valid status).
    ///
    /// ```
    /// let p = idem::http::Problem::from(idem::VersionedError::NotFound);
    /// assert_eq!(p.status(), axum::http::StatusCode::NOT_FOUND);
    /// ```
    pub fn status(&self) -> StatusCode {
        StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    /// The `type` URI: what kind of problem this is (see [`problem_type`]).
    ///
    /// ```
    /// use idem::http::{problem_type, Problem};
    /// let p = Problem::from(idem::VersionedError::NotFound);
    /// assert_eq!(p.type_uri(), problem_type::NOT_FOUND);
    /// ```
    pub fn type_uri(&self) -> &str {
        &self.type_uri
    }

    /// The `title`: a short summary of the type.
    ///
    /// ```
    /// let p = idem::http::Problem::from(idem::Error::FingerprintMismatch);
    /// assert_eq!(p.title(), "Idempotency-Key reused for a different request");
    /// ```
    pub fn title(&self) -> &str {
        &self.title
    }

    /// The `detail`: what happened this time, and what the client can do.
    ///
    /// ```
    /// let p = idem::http::Problem::from(idem::Error::OutcomeUnknown);
    /// assert!(p.detail().contains("may have reached its target"));
    /// ```
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// The extension members.
    ///
    /// ```
    /// let p = idem::http::Problem::from(idem::VersionedError::Stale { expected: 1, actual: 2 });
    /// assert_eq!(p.extensions()["current_etag"], "\"v2\"");
    /// ```
    pub fn extensions(&self) -> &Map<String, Value> {
        &self.extensions
    }

    pub(crate) fn key_missing() -> Problem {
        Problem::new(
            StatusCode::BAD_REQUEST,
            problem_type::IDEMPOTENCY_KEY_MISSING,
            "Idempotency-Key required",
            "this endpoint requires an Idempotency-Key header: send a new unique value for each \
             operation, e.g. Idempotency-Key: \"8e03978e-40d5-43e8-bc93-6894a57f9324\", and the \
             same value when you retry it",
        )
    }

    pub(crate) fn key_invalid(detail: impl std::fmt::Display) -> Problem {
        Problem::new(
            StatusCode::BAD_REQUEST,
            problem_type::IDEMPOTENCY_KEY_INVALID,
            "Invalid Idempotency-Key",
            format!(
                "{detail}; send one Idempotency-Key header holding a quoted string of 1 to 255 \
                 printable ASCII characters, e.g. Idempotency-Key: \"8e03978e-40d5-43e8-bc93-6894a57f9324\""
            ),
        )
    }

    pub(crate) fn precondition_required() -> Problem {
        Problem::new(
            StatusCode::PRECONDITION_REQUIRED,
            problem_type::PRECONDITION_REQUIRED,
            "If-Match required",
            "this endpoint changes the resource only if it is still at the version you read: \
             send the ETag of your last read in an If-Match header (e.g. If-Match: \"v3\"), \
             or If-Match: * to change whatever version it is at",
        )
    }

    /// A race lost or a lock refused that no retry loop replayed (see
    /// [`unreplayed`]), else a 500. Logged as a warning: the handler may
    /// want `#[retryable]`. The text says only that the transaction that
    /// failed was rolled back: a handler outside a loop may have committed
    /// statements before it (autocommit), and the request is then not safe
    /// to send again as it would be after [`Error::Exhausted`].
    fn unreplayed_or_internal(e: &(impl Transient + HttpStatus + std::fmt::Display)) -> Problem {
        let Some(status) = unreplayed(e) else {
            return Problem::internal(e);
        };
        tracing::warn!(error = %e, status, "a transient failure outside a retry loop, not replayed");
        if status == 409 {
            Problem::new(
                status_of(e),
                problem_type::RETRIES_EXHAUSTED,
                "Lost a race",
                "the request lost a race for the same data to another one and was not \
                 replayed: the transaction that lost was rolled back",
            )
            .with("attempts", 1)
        } else {
            Problem::new(
                status_of(e),
                problem_type::UNAVAILABLE,
                "Rows locked",
                "rows the request needed stayed locked by another one: the transaction that \
                 waited was rolled back; retry later",
            )
            .retry_after(1)
        }
    }

    fn internal(what: &dyn std::fmt::Display) -> Problem {
        tracing::error!(error = %what, "internal error, answered with 500");
        Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            problem_type::INTERNAL,
            "Internal error",
            "the server failed to handle the request; the details are in its log",
        )
    }
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.status, self.title, self.detail)
    }
}

impl std::error::Error for Problem {}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let status = self.status();
        let retry_after = self.retry_after;
        let body = match serde_json::to_vec(&self) {
            Ok(body) => body,
            // A map of JSON values always serializes; keep a body anyway.
            Err(_) => br#"{"type":"urn:idem:problem:internal","status":500}"#.to_vec(),
        };
        let mut response = (status, body).into_response();
        let headers = response.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static(super::PROBLEM_JSON));
        if let Some(seconds) = retry_after {
            headers.insert(RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

/// idem's own failures: the one table that decides each status.
/// The status the one table ([`HttpStatus`]) gives `e`.
fn status_of(e: &impl HttpStatus) -> StatusCode {
    StatusCode::from_u16(e.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}

impl From<&Error> for Problem {
    fn from(e: &Error) -> Problem {
        match e {
            Error::MissingKey => Problem::key_missing(),
            Error::InvalidKey { reason } => {
                Problem::key_invalid(format_args!("the Idempotency-Key is invalid: {reason}"))
            }
            Error::FingerprintMismatch => Problem::new(
                status_of(e),
                problem_type::FINGERPRINT_MISMATCH,
                "Idempotency-Key reused for a different request",
                "this Idempotency-Key was already used for a request with a different body or \
                 target; nothing was done. Use a new key for a new request",
            ),
            Error::InProgress => Problem::new(
                status_of(e),
                problem_type::IN_PROGRESS,
                "Request in progress",
                "the first request with this Idempotency-Key has not finished: it is still \
                 running, or it was interrupted and its claim has not expired yet; retry later \
                 with the same key to get its outcome",
            )
            .retry_after(1),
            Error::ClaimLost => Problem::new(
                status_of(e),
                problem_type::IN_PROGRESS,
                "Idempotency claim lost",
                "the claim of this Idempotency-Key was settled or taken over while the request \
                 ran; nothing was committed",
            ),
            Error::OutcomeUnknown => Problem::new(
                status_of(e),
                problem_type::OUTCOME_UNKNOWN,
                "Outcome unknown",
                format!(
                    "{OUTCOME_UNKNOWN_MESSAGE}: the first request with this Idempotency-Key may \
                     have reached its target or committed, and it will not run again under this \
                     key"
                ),
            ),
            Error::Exhausted {
                attempts,
                elapsed,
                last_cause,
            } if last_cause.is_timeout() => Problem::new(
                status_of(e),
                problem_type::UNAVAILABLE,
                "Deadline exceeded",
                format!(
                    "the database could not finish the request within its deadline ({} ms, {attempts} \
                     attempt(s)): rows it needed stayed locked, or a statement ran long; nothing \
                     was committed, retry later",
                    elapsed.as_millis()
                ),
            )
            .with("attempts", *attempts)
            .retry_after(1),
            Error::Exhausted {
                attempts,
                elapsed,
                last_cause,
            } if busy(*last_cause) => Problem::new(
                status_of(e),
                problem_type::UNAVAILABLE,
                "Rows locked",
                format!(
                    "rows the request needed stayed locked by another one through {attempts} \
                     attempt(s) in {} ms; nothing was committed, retry later",
                    elapsed.as_millis()
                ),
            )
            .with("attempts", *attempts)
            .retry_after(1),
            Error::Exhausted {
                attempts, elapsed, ..
            } => Problem::new(
                status_of(e),
                problem_type::RETRIES_EXHAUSTED,
                "Too much contention",
                format!(
                    "the request lost the race for the same data {attempts} time(s) in {} ms and \
                     was given up; nothing was committed, and it is safe to send it again",
                    elapsed.as_millis()
                ),
            )
            .with("attempts", *attempts),
            Error::CommitUnknown { .. } => Problem::new(
                status_of(e),
                problem_type::COMMIT_OUTCOME_UNKNOWN,
                "Commit outcome unknown",
                "the connection to the database failed while the request was being committed, so \
                 it may or may not have taken effect: retry with the same Idempotency-Key, which \
                 returns the result if it did and runs the request if it did not",
            )
            .retry_after(1),
            Error::Pool(_) => Problem::new(
                status_of(e),
                problem_type::UNAVAILABLE,
                "Service busy",
                "no database connection could be had in time; nothing was done, retry later",
            )
            .retry_after(1),
            Error::Unstorable(why) => Problem::new(
                status_of(e),
                problem_type::RESPONSE_UNSTORABLE,
                "Response cannot be stored",
                format!(
                    "the response to this request cannot be stored for replay under its \
                     Idempotency-Key ({why}); nothing was done and the key is still free"
                ),
            ),
            other => Problem::unreplayed_or_internal(other),
        }
    }
}

impl From<&VersionedError> for Problem {
    fn from(e: &VersionedError) -> Problem {
        match e {
            VersionedError::Stale { expected, actual } => Problem::new(
                status_of(e),
                problem_type::PRECONDITION_FAILED,
                "Precondition failed",
                format!(
                    "the resource changed since you read it (you sent version {expected}, it is at \
                     version {actual}); nothing was changed: read it again and reapply your change"
                ),
            )
            .with("current_etag", etag_for_version(*actual)),
            VersionedError::NotFound => Problem::new(
                status_of(e),
                problem_type::NOT_FOUND,
                "Not found",
                "no such resource",
            ),
            VersionedError::StateMismatch { expected, actual } => Problem::new(
                status_of(e),
                problem_type::STATE_CONFLICT,
                "State conflict",
                format!(
                    "the change requires state {expected}, but the resource is in state {actual}"
                ),
            ),
            VersionedError::IllegalTransition { from, to } => Problem::new(
                status_of(e),
                problem_type::STATE_CONFLICT,
                "Illegal transition",
                format!(
                    "the resource cannot go from state {from} to state {to}; nothing was changed"
                ),
            ),
            other => Problem::unreplayed_or_internal(other),
        }
    }
}

impl From<&CreateOnceError> for Problem {
    fn from(e: &CreateOnceError) -> Problem {
        match e {
            CreateOnceError::Mismatch { fields } => Problem::new(
                status_of(e),
                problem_type::FINGERPRINT_MISMATCH,
                "Idempotency key reused",
                format!(
                    "this idempotency key was used before for a request with other {}; nothing \
                     was created: send a new key for a new request",
                    fields.join(", ")
                ),
            ),
            CreateOnceError::Conflict => Problem::new(
                status_of(e),
                problem_type::UNIQUE_CONFLICT,
                "Conflict",
                "another resource already holds one of this one's unique values; nothing was created",
            ),
            CreateOnceError::MissingKey => Problem::new(
                status_of(e),
                problem_type::IDEMPOTENCY_KEY_MISSING,
                "Idempotency key missing",
                "this request creates a resource once per idempotency key, and carries none",
            ),
            other => Problem::unreplayed_or_internal(other),
        }
    }
}

impl From<&EtagError> for Problem {
    fn from(e: &EtagError) -> Problem {
        if e.http_status() == 412 {
            Problem::new(
                status_of(e),
                problem_type::PRECONDITION_FAILED,
                "Precondition failed",
                e.to_string(),
            )
        } else {
            Problem::new(
                status_of(e),
                problem_type::IF_MATCH_INVALID,
                "Invalid If-Match",
                e.to_string(),
            )
        }
    }
}

macro_rules! by_value {
    ($($t:ty),*) => {$(
        impl From<$t> for Problem {
            fn from(e: $t) -> Problem {
                Problem::from(&e)
            }
        }
    )*};
}
by_value!(Error, VersionedError, CreateOnceError, EtagError);

#[cfg(test)]
mod tests;
