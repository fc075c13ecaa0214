//! A request that arrives twice has its effect once.
//!
//! The claim is taken **before** acting, and the primary key of
//! `idem_requests (scope, key)` is the arbiter: never "check, then act".
//!
//! * **local mode** (every effect is in this database): claim, body and stored
//!   response commit in one transaction. A concurrent duplicate blocks on the
//!   uncommitted claim and, once the winner commits, replays the winner's
//!   record. A body that fails rolls everything back, claim included, so a
//!   retry really runs again; a *final* error (declined, insufficient funds) is
//!   stored instead, with the body's writes rolled back to a savepoint.
//! * **external mode** (the body calls something outside the database): the
//!   claim commits first, in progress, with a lease; the result is recorded
//!   when the body is done. A failure that proves nothing left releases the
//!   claim; any other failure keeps it as *outcome unknown*, and every later
//!   caller is told the request may have reached its target, until
//!   [`settle`] decides it. A lease that runs out becomes outcome unknown,
//!   never a re-run.
//!
//! The same key again gets: the stored response ([`Idempotent::replayed`]),
//! or [`IdempotencyError::FingerprintMismatch`] (422) for a different
//! request, [`IdempotencyError::InProgress`] (409), or
//! [`IdempotencyError::OutcomeUnknown`]. Scopes are separate key spaces.

mod admin;
mod call;
pub mod fingerprint;
mod request;
mod store;

use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;
use sha2::{Digest, Sha256};

pub use admin::{purge_expired, settle, PurgeReport, Settlement};
pub use call::{Call, Reply};
pub use fingerprint::Field;
pub use request::Request;

/// Where the effects of an idempotent function live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// Every effect is in this database: one transaction does it all.
    #[default]
    Local,
    /// The body calls another system: the claim commits before the call.
    External,
}

impl Mode {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Mode::Local => "local",
            Mode::External => "external",
        }
    }
}

/// Settings of an idempotent function; every one has a documented default
/// and can be set in `#[idempotent(..)]` or built at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdempotencyConfig {
    /// Default [`Mode::Local`].
    pub mode: Mode,
    /// How long a completed record is kept and replayed. Default 24 h. After
    /// it, the same key is a new request.
    pub ttl: Duration,
    /// External mode: how long a claim may stay in progress before it is
    /// reported as outcome unknown. Default 30 s.
    pub lease: Duration,
    /// How long a duplicate waits for an in-progress record (external mode)
    /// before answering [`IdempotencyError::InProgress`]. Default 0: at once.
    pub wait: Duration,
    /// Largest stored response, in bytes of JSON. Default 64 KiB.
    pub max_response_bytes: usize,
}

impl IdempotencyConfig {
    /// The defaults.
    pub const fn new() -> Self {
        IdempotencyConfig {
            mode: Mode::Local,
            ttl: Duration::from_secs(24 * 60 * 60),
            lease: Duration::from_secs(30),
            wait: Duration::ZERO,
            max_response_bytes: 64 * 1024,
        }
    }
    /// Set [`mode`](Self::mode).
    pub const fn mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }
    /// Set [`ttl`](Self::ttl).
    pub const fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }
    /// Set [`lease`](Self::lease).
    pub const fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }
    /// Set [`wait`](Self::wait).
    pub const fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }
    /// Set [`max_response_bytes`](Self::max_response_bytes).
    pub const fn max_response_bytes(mut self, bytes: usize) -> Self {
        self.max_response_bytes = bytes;
        self
    }
}

impl Default for IdempotencyConfig {
    fn default() -> Self {
        Self::new()
    }
}

/// The message every caller of a key with an unknown outcome gets.
pub const OUTCOME_UNKNOWN_MESSAGE: &str =
    "the request may have reached the target system; its outcome is decided there; not retried";

/// What can go wrong with an idempotency key, each with its HTTP status.
#[derive(Debug, thiserror::Error)]
pub enum IdempotencyError {
    /// The key is empty, longer than 255 bytes, or has control characters (400).
    #[error("invalid idempotency key: {reason}")]
    InvalidKey {
        /// What is wrong with it.
        reason: &'static str,
    },
    /// No key was given where one is required (400).
    #[error("an idempotency key is required for this request")]
    MissingKey,
    /// The key was used before for a different request (422). Nothing was
    /// written, and the stored response is not revealed.
    #[error("this idempotency key was already used for a different request")]
    FingerprintMismatch,
    /// The first request with this key is still running (409).
    #[error("a request with this idempotency key is still in progress")]
    InProgress,
    /// The first request may have reached an outside system and its outcome is
    /// not known here; it is not retried (until [`settle`]d).
    #[error("{}", OUTCOME_UNKNOWN_MESSAGE)]
    OutcomeUnknown,
    /// A fingerprint field, the scope or the response could not be serialized;
    /// nothing was written.
    #[error("could not serialize {what}: {source}")]
    Unserializable {
        /// Which value.
        what: String,
        /// serde's error.
        source: serde_json::Error,
    },
    /// The stored response could not be read back as the function's type (the
    /// type changed since it was stored).
    #[error("the stored response for this key cannot be read back: {0}")]
    UnreadableResponse(serde_json::Error),
    /// The response is larger than [`IdempotencyConfig::max_response_bytes`];
    /// nothing was committed.
    #[error("the response is {size} bytes, over the {limit}-byte limit for stored responses")]
    ResponseTooLarge {
        /// Its size in bytes of JSON.
        size: usize,
        /// The configured limit.
        limit: usize,
    },
    /// External mode: the claim of this key was settled by hand, or its
    /// lease ran out and another request took the key, while this request
    /// ran. Its writes were rolled back; nothing was committed (409).
    #[error(
        "the claim of this idempotency key was lost while the request ran; nothing was committed"
    )]
    ClaimLost,
    /// The database failed.
    #[error("database error: {0}")]
    Database(#[from] diesel::result::Error),
}

impl IdempotencyError {
    /// The HTTP status a handler usually answers with.
    pub fn http_status(&self) -> u16 {
        match self {
            IdempotencyError::InvalidKey { .. } | IdempotencyError::MissingKey => 400,
            IdempotencyError::FingerprintMismatch => 422,
            IdempotencyError::InProgress | IdempotencyError::ClaimLost => 409,
            IdempotencyError::OutcomeUnknown => 502,
            _ => 500,
        }
    }
}

impl crate::retry::Transient for IdempotencyError {
    fn transient(&self) -> Option<crate::retry::RetryCause> {
        match self {
            IdempotencyError::Database(e) => crate::retry::Transient::transient(e),
            _ => None,
        }
    }
}

/// The result of an idempotent function: the value, and whether it is the
/// stored result of an earlier request with the same key (seed 001's
/// `{ id, idempotent: true }`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Idempotent<T> {
    /// The result.
    pub value: T,
    /// True when the body did not run: this is the first request's result.
    pub replayed: bool,
}

impl<T> Idempotent<T> {
    /// The value, whether replayed or not.
    pub fn into_inner(self) -> T {
        self.value
    }
}

impl<T> std::ops::Deref for Idempotent<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.value
    }
}

/// What an idempotent function's error type must tell idem.
///
/// ```
/// use idem_runtime::idempotency::{IdempotencyError, IdempotentError};
///
/// #[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
/// enum Declined { InsufficientFunds }
///
/// enum AppError { Idem(IdempotencyError), Declined(Declined), Timeout }
/// impl From<IdempotencyError> for AppError {
///     fn from(e: IdempotencyError) -> Self { AppError::Idem(e) }
/// }
/// impl IdempotentError for AppError {
///     type Final = Declined;
///     fn to_final(&self) -> Option<Declined> {
///         match self { AppError::Declined(d) => Some(d.clone()), _ => None }
///     }
///     fn from_final(d: Declined) -> Self { AppError::Declined(d) }
/// }
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` does not say which of its errors are final for an idempotency key",
    label = "the error type of this #[idempotent] function",
    note = "implement `idem::IdempotentError` for `{Self}` (and `From<idem::IdempotencyError>`): `to_final` returns the errors stored and replayed under the key (declined, insufficient funds), `None` for errors after which a retry should run again"
)]
pub trait IdempotentError: From<IdempotencyError> + Sized {
    /// The stored form of final errors. Use [`NoFinalErrors`] when there are none.
    type Final: Serialize + DeserializeOwned;
    /// This error's stored form, when it is final: it is then recorded under
    /// the key (the body's writes rolled back) and replayed to later callers.
    fn to_final(&self) -> Option<Self::Final>;
    /// Rebuild a replayed final error.
    fn from_final(stored: Self::Final) -> Self;
    /// External mode: true when this failure proves the request never left
    /// (e.g. validation before sending), so the claim is released and the key
    /// may be used again. Default false: the outcome is then unknown.
    fn nothing_sent(&self) -> bool {
        false
    }
}

/// `IdempotentError::Final` for error types without final errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum NoFinalErrors {}

/// Check a caller-supplied key: 1 to 255 bytes, no control characters.
pub fn validate_key(key: &str) -> Result<(), IdempotencyError> {
    if key.is_empty() {
        return Err(IdempotencyError::InvalidKey {
            reason: "it is empty",
        });
    }
    if key.len() > 255 {
        return Err(IdempotencyError::InvalidKey {
            reason: "it is longer than 255 bytes",
        });
    }
    if key.chars().any(char::is_control) {
        return Err(IdempotencyError::InvalidKey {
            reason: "it contains control characters",
        });
    }
    Ok(())
}

/// The key derived when the caller gives none (seed 001: who : conversation :
/// tool : sorted parameters): hex SHA-256 of `scope : operation : fingerprint`.
pub fn derived_key(scope: &str, operation: &str, fingerprint: &[u8; 32]) -> String {
    let mut hasher = Sha256::new();
    hasher.update(scope.as_bytes());
    hasher.update(b":");
    hasher.update(operation.as_bytes());
    hasher.update(b":");
    hasher.update(fingerprint::hex(fingerprint).as_bytes());
    fingerprint::hex(&hasher.finalize())
}

/// A value usable as `key = ..`: a string, or an `Option` of one (`None` is
/// [`IdempotencyError::MissingKey`]).
pub trait KeyInput {
    /// The key, if there is one.
    fn key(&self) -> Option<&str>;
}
impl KeyInput for str {
    fn key(&self) -> Option<&str> {
        Some(self)
    }
}
impl KeyInput for String {
    fn key(&self) -> Option<&str> {
        Some(self)
    }
}
impl<T: KeyInput + ?Sized> KeyInput for &T {
    fn key(&self) -> Option<&str> {
        (**self).key()
    }
}
impl<T: KeyInput> KeyInput for Option<T> {
    fn key(&self) -> Option<&str> {
        self.as_ref().and_then(KeyInput::key)
    }
}

tokio::task_local! {
    static CURRENT_KEY: String;
}

/// Run `body` with [`current_key`] returning `key`.
#[doc(hidden)]
pub fn under_key<F: std::future::Future>(
    key: String,
    body: F,
) -> impl std::future::Future<Output = F::Output> {
    CURRENT_KEY.scope(key, body)
}

/// The idempotency key of the request whose body is running, so an external
/// call can pass it on (e.g. as an `Idempotency-Key` header to the target).
pub fn current_key() -> Option<String> {
    CURRENT_KEY.try_with(Clone::clone).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_validated() {
        assert!(validate_key("idem-order-1001").is_ok());
        assert!(validate_key(&"k".repeat(255)).is_ok());
        assert!(matches!(
            validate_key(""),
            Err(IdempotencyError::InvalidKey { .. })
        ));
        assert!(matches!(
            validate_key(&"k".repeat(256)),
            Err(IdempotencyError::InvalidKey { .. })
        ));
        assert!(matches!(
            validate_key("a\nb"),
            Err(IdempotencyError::InvalidKey { .. })
        ));
        assert!(matches!(
            validate_key("a\u{7f}"),
            Err(IdempotencyError::InvalidKey { .. })
        ));
        assert_eq!(
            IdempotencyError::InvalidKey { reason: "x" }.http_status(),
            400
        );
    }

    #[test]
    fn key_inputs() {
        assert_eq!(KeyInput::key(&"k"), Some("k"));
        assert_eq!(KeyInput::key(&String::from("k")), Some("k"));
        assert_eq!(KeyInput::key(&Some(String::from("k"))), Some("k"));
        assert_eq!(KeyInput::key(&None::<String>), None);
    }
}
