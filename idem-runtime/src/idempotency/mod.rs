//! A request that arrives twice has its effect once.
//!
//! Duplicates are stopped **before** acting, and the primary key of
//! `idem_requests (scope, key)` is the arbiter: never "check, then act".
//!
//! * **local mode** (every effect is in this database): body and stored
//!   response commit in one transaction, and the record is written once, as
//!   a completed row, in the round trip of `COMMIT` (pipelined with it).
//!   Duplicates are serialized by a transaction-level advisory lock on a
//!   64-bit hash of (scope, key), taken before the record is read, both in
//!   the round trip of `BEGIN`: a concurrent duplicate waits for the winner
//!   and, once it committed, reads and replays its record (READ COMMITTED:
//!   the read is a later statement; under REPEATABLE READ or SERIALIZABLE the
//!   record is invisible to the snapshot, so the insert fails, the `COMMIT`
//!   behind it rolls back, and the replayed attempt reads it). Two keys whose
//!   hashes collide only wait for each other. A body that fails writes
//!   nothing, so a retry really runs again; a *final* error (declined,
//!   insufficient funds) is stored instead: its attempt is rolled back and
//!   the next attempt of the same loop stores the error, without the body.
//! * **external mode** (the body calls something outside the database), in
//!   three phases: the claim commits first, in progress, with a lease and the
//!   call's owner token; the body's outside call runs with no transaction
//!   open and no connection held ([`crate::retry::Deferred`]); one
//!   transaction then records the outcome with the body's local writes. A
//!   claim whose commit went unanswered is recognised by its token and
//!   resumed. A failure that proves nothing left releases the claim; any
//!   other failure keeps it as *outcome unknown*, and every later caller is
//!   told the request may have reached its target, until [`settle`] decides
//!   it. A lease that runs out becomes outcome unknown, never a re-run.
//!
//! Every step (checkout, claim, record, storing a final error) is a step of
//! the same retry loop as the body ([`Call`] drives them), under its budget
//! and classification.
//!
//! The same key again gets: the stored response ([`Idempotent::replayed`]),
//! or [`Error::FingerprintMismatch`] (422) for a different
//! request, [`Error::InProgress`] (409), or
//! [`Error::OutcomeUnknown`]. Scopes are separate key spaces.

mod admin;
#[cfg(feature = "redis")]
mod cache;
mod call;
pub mod fingerprint;
mod local;
mod request;
mod store;

use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;
use sha2::{Digest, Sha256};

pub use admin::{purge_expired, settle, PurgeReport, Settlement};
#[cfg(feature = "redis")]
pub use cache::{CacheConfig, CacheError, CacheInput, CacheStats, ReplayCache};
pub use call::{Call, Reply};
pub use fingerprint::Field;
pub(crate) use request::storable_tree;
pub use request::{lock_key, Request};

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
    /// before answering [`Error::InProgress`]. Default 0: at once.
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

/// The deepest nesting of arrays and objects a stored response (or final
/// error) may have. Deeper, it is refused with
/// [`Unstorable::TooDeep`](crate::Unstorable::TooDeep) before anything is
/// written: serde_json reads at most 128 levels back, and a record that
/// cannot be read would answer every retry of its key with an error.
pub const MAX_STORED_DEPTH: usize = 64;

pub use crate::error::OUTCOME_UNKNOWN_MESSAGE;

pub use crate::error::Error;

/// What can go wrong with an idempotency key, now variants of [`Error`].
#[deprecated(
    since = "0.2.0",
    note = "use `idem::Error`: retry and idempotency failures are one type"
)]
pub type IdempotencyError = Error;

/// The result of an idempotent function: the value, and whether it is the
/// stored result of an earlier request with the same key (what an API
/// answers as `{ id, idempotent: true }`).
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

/// Which errors of an idempotent function are *final*: stored under the key
/// and replayed to later requests (declined, insufficient funds), rather than
/// run again. Write it with [`final_errors!`](crate::final_errors) in one
/// line; implement it by hand for external mode's [`nothing_sent`](Self::nothing_sent).
///
/// ```
/// #[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
/// enum Declined { InsufficientFunds }
///
/// #[derive(Debug, thiserror::Error)]
/// enum AppError {
///     #[error(transparent)]
///     Idem(#[from] idem_runtime::Error),
///     #[error("declined: {0:?}")]
///     Declined(Declined),
/// }
/// idem_runtime::final_errors!(AppError::Declined(Declined));
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` does not say which of its errors are final for an idempotency key",
    label = "the error type of this #[idempotent] function",
    note = "add `idem::final_errors!({Self}::Variant(StoredType));` for the variant stored and replayed under the key, or `idem::final_errors!({Self});` when there is none"
)]
pub trait IdempotentError: From<Error> + Sized {
    /// The stored form of final errors. Use [`NoFinalErrors`] when there are none.
    type Final: Serialize + DeserializeOwned;
    /// This error's stored form, when it is final: it is then recorded under
    /// the key (the body's writes rolled back) and replayed to later callers.
    fn to_final(&self) -> Option<Self::Final>;
    /// Rebuild a final error for a *replay*: idem calls this only when it
    /// answers a request from a stored record (the request that ran gets its
    /// own error back), so the error it builds is a replay by construction.
    fn from_final(stored: Self::Final) -> Self;
    /// External mode: true when this failure proves the request never left
    /// (e.g. validation before sending), so the claim is released and the key
    /// may be used again. Default false: the outcome is then unknown.
    fn nothing_sent(&self) -> bool {
        false
    }
}

/// Implement [`IdempotentError`] in one line.
///
/// `final_errors!(AppError::Declined(Declined))`: the variant `Declined`
/// wrapping the (`Clone + Serialize + Deserialize`) type `Declined` is
/// stored and replayed; `final_errors!(AppError)`: no error is final.
#[macro_export]
macro_rules! final_errors {
    ($ty:ident :: $variant:ident ($stored:ty)) => {
        impl $crate::IdempotentError for $ty {
            type Final = $stored;
            fn to_final(&self) -> ::core::option::Option<$stored> {
                #[allow(unreachable_patterns)]
                match self {
                    $ty::$variant(stored) => {
                        ::core::option::Option::Some(::core::clone::Clone::clone(stored))
                    }
                    _ => ::core::option::Option::None,
                }
            }
            fn from_final(stored: $stored) -> Self {
                $ty::$variant(stored)
            }
        }
    };
    ($ty:ty) => {
        impl $crate::IdempotentError for $ty {
            type Final = $crate::NoFinalErrors;
            fn to_final(&self) -> ::core::option::Option<$crate::NoFinalErrors> {
                ::core::option::Option::None
            }
            fn from_final(stored: $crate::NoFinalErrors) -> Self {
                match stored {}
            }
        }
    };
}

/// `IdempotentError::Final` for error types without final errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum NoFinalErrors {}

/// Check a caller-supplied key: 1 to 255 bytes, no control characters.
pub fn validate_key(key: &str) -> Result<(), Error> {
    if key.is_empty() {
        return Err(Error::InvalidKey {
            reason: "it is empty",
        });
    }
    if key.len() > 255 {
        return Err(Error::InvalidKey {
            reason: "it is longer than 255 bytes",
        });
    }
    if key.chars().any(char::is_control) {
        return Err(Error::InvalidKey {
            reason: "it contains control characters",
        });
    }
    if key.chars().any(is_invisible) {
        return Err(Error::InvalidKey {
            reason:
                "it contains invisible or direction-changing characters (zero-width, bidi controls)",
        });
    }
    Ok(())
}

/// Characters that change how a key looks without being seen: two keys that
/// print alike must not be two keys (Unicode format characters of the kinds
/// that reorder or hide text, and the byte-order mark).
fn is_invisible(c: char) -> bool {
    matches!(c,
        '\u{00AD}'                    // soft hyphen
        | '\u{061C}'                  // Arabic letter mark
        | '\u{180E}'                  // Mongolian vowel separator
        | '\u{200B}'..='\u{200F}'      // zero-width space, joiners, LRM, RLM
        | '\u{202A}'..='\u{202E}'      // bidi embeddings and overrides
        | '\u{2060}'..='\u{2064}'      // word joiner, invisible operators
        | '\u{2066}'..='\u{206F}'      // bidi isolates, deprecated format chars
        | '\u{FEFF}'                  // byte-order mark
        | '\u{FFF9}'..='\u{FFFB}'      // interlinear annotation
    )
}

/// The stored form of a scope (the `scope` column of `idem_requests`): the
/// hex SHA-256 of its canonical encoding, under the fingerprint's rules, so
/// map order does not matter and any size fits. For operators and tests that
/// look a record up by hand.
///
/// ```
/// let a = idem_runtime::idempotency::scope_hash(&(7_i64, "alice")).unwrap();
/// assert_eq!(a.len(), 64);
/// assert_ne!(a, idem_runtime::idempotency::scope_hash(&(7_i64, "bob")).unwrap());
/// ```
pub fn scope_hash<S: Serialize + ?Sized>(scope: &S) -> Result<String, Error> {
    request::Scope::of(scope).map(|scope| scope.hash)
}

/// The key derived when the caller gives none (who, operation, and the
/// request's fields, so the same call made twice gets the same key): hex SHA-256 of `scope : operation : fingerprint`,
/// where `scope` is the stored scope (the hex SHA-256 of its canonical
/// encoding, [`Request::scope`]) and `fingerprint` is hex.
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
/// [`Error::MissingKey`]).
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
        assert!(matches!(validate_key(""), Err(Error::InvalidKey { .. })));
        assert!(matches!(
            validate_key(&"k".repeat(256)),
            Err(Error::InvalidKey { .. })
        ));
        assert!(matches!(
            validate_key("a\nb"),
            Err(Error::InvalidKey { .. })
        ));
        assert!(matches!(
            validate_key("a\u{7f}"),
            Err(Error::InvalidKey { .. })
        ));
        // Keys that print like another key.
        for sneaky in [
            "order\u{200B}-1",
            "order-1\u{202E}",
            "\u{2066}order-1\u{2069}",
            "\u{FEFF}order-1",
            "or\u{00AD}der-1",
        ] {
            assert!(
                matches!(validate_key(sneaky), Err(Error::InvalidKey { .. })),
                "{sneaky:?}"
            );
        }
        // Ordinary non-ASCII keys are fine.
        assert!(validate_key("commande-été-1").is_ok());
        assert!(validate_key("注文-1").is_ok());
    }

    #[test]
    fn key_inputs() {
        assert_eq!(KeyInput::key(&"k"), Some("k"));
        assert_eq!(KeyInput::key(&String::from("k")), Some("k"));
        assert_eq!(KeyInput::key(&Some(String::from("k"))), Some("k"));
        assert_eq!(KeyInput::key(&None::<String>), None);
    }
}
