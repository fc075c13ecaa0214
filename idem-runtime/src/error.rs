//! The one error type of idem's own failures: the retry loop's, the
//! idempotency record's, and the database's under them.
//!
//! A function under `#[retryable]` or `#[idempotent]` returns your error
//! type; it needs one conversion, `From<idem::Error>`, and nothing else:
//! whether a failed attempt is worth replaying is decided by what happened
//! on the attempt's connection (a serialization failure, a deadlock, a lost
//! connection, a version conflict), never by asking your type, so no variant
//! can be forgotten.
//!
//! ```
//! #[derive(Debug, thiserror::Error)]
//! enum AppError {
//!     #[error(transparent)]
//!     Idem(#[from] idem_runtime::Error),
//!     #[error(transparent)]
//!     Db(#[from] diesel::result::Error),
//!     #[error("insufficient funds")]
//!     InsufficientFunds,
//! }
//! ```

use std::time::Duration;

use crate::cause::{RetryCause, Transient};

/// idem's own failures. `idem::http` (feature `axum`) answers each with
/// the status its one table gives it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Every attempt the budget allowed failed with a replayable cause. Answer
    /// 409 (conflict) or 503 (busy); the request may be sent again.
    #[error(
        "gave up after {attempts} attempt(s) in {elapsed:?}; the last one failed with {last_cause}"
    )]
    Exhausted {
        /// Attempts made.
        attempts: u32,
        /// Time from the call to giving up.
        elapsed: Duration,
        /// Why the last attempt failed.
        last_cause: RetryCause,
    },
    /// The connection failed, or went silent, while `COMMIT` was in flight: the
    /// transaction may or may not have committed. Not replayed. Answer 503 and
    /// let the client retry with the same idempotency key, whose record tells.
    #[error("the outcome of COMMIT is unknown (attempt {attempts}): the connection failed while it was in flight; not retried")]
    CommitUnknown {
        /// The attempt whose commit was lost.
        attempts: u32,
        /// Time from the call to the failure.
        elapsed: Duration,
    },
    /// The body returned `Ok`, but one of its statements had failed and the
    /// body ignored the error, so PostgreSQL would have turned the `COMMIT`
    /// into a rollback. The transaction was rolled back; nothing was committed.
    #[error("the transaction was rolled back: the body returned Ok, but one of its statements had failed and its error was ignored")]
    RolledBack,
    /// The body ended idem's transaction itself, or began another: a
    /// `COMMIT`, `ROLLBACK`, `BEGIN` or `PREPARE TRANSACTION` of its own (use
    /// `conn.transaction(..)`, a savepoint, instead), or a statement whose
    /// failure ends the transaction on the server. Not replayed: when
    /// `committed` is true, some of what it wrote was committed (the
    /// attempt's atomicity is gone, and a replay would write it again): what
    /// it wrote before its own `COMMIT`, or a statement sent in the same
    /// request as its end, after it, outside any transaction (which commits
    /// on its own). Nothing the body sends in a later request goes out: the
    /// connection refuses it, and is closed. A bug in the body (500). Under
    /// a local `#[idempotent]` call with `committed` true, the key is then
    /// held as outcome unknown: its record rode on idem's `COMMIT`.
    #[error("the body ended idem's transaction itself (a COMMIT, ROLLBACK, BEGIN or PREPARE TRANSACTION of its own, or a statement that ended it): {}; not replayed", if *committed { "some of what it wrote was committed" } else { "nothing was committed" })]
    TransactionEnded {
        /// Some of what the body wrote was committed (or prepared): before
        /// its own end of the transaction, or after it in the same request,
        /// outside any.
        committed: bool,
    },
    /// The body returned with a savepoint still open: a `conn.transaction(..)`
    /// whose future it dropped before it finished (under a timeout or a
    /// `select!`, say), or a `begin_transaction` without its end. diesel-async
    /// would have sent `RELEASE SAVEPOINT` where the `COMMIT` belongs and left
    /// the transaction open; idem closed the connection instead, so nothing
    /// was committed, and the open part's writes are not kept half-done.
    /// Also when the future was dropped while the savepoint's own
    /// `SAVEPOINT`, `RELEASE SAVEPOINT` or `ROLLBACK TO SAVEPOINT` was
    /// unanswered: diesel-async then no longer knows how deep the
    /// transaction is. Not replayed: the body would do the same again. A bug
    /// in the body (500).
    #[error("the body returned with a savepoint still open (a conn.transaction(..) whose future was dropped before it finished?): nothing was committed; not replayed")]
    SavepointOpen,
    /// The body swapped the connection it was lent for another
    /// (`std::mem::replace` or `swap` through the `&mut`): idem committed
    /// nothing. It closed the connection swapped in, which rolls back what
    /// the body had begun there, and the one the body took, wherever it is
    /// now held (a task of the body's, another checkout, the pool's idle
    /// queue), which rolls back idem's transaction and frees its locks. In
    /// external mode the outcome is not recorded: the key stays held. Only
    /// what the body committed itself is kept: what it wrote outside any
    /// transaction on a connection of its own (as any write through a
    /// second connection would be), or a `COMMIT` it sent by hand on either
    /// connection, idem's included once in its hands (idem cannot tell
    /// which; treat the call's writes as possibly committed). Not
    /// replayed: the body would do the same again. A bug in the body (500).
    #[error("the body swapped the connection it was lent for another: idem committed nothing, and closed both connections; not replayed")]
    ConnectionReplaced,
    /// Local mode: the transaction committed, but the statement that writes
    /// the key's record wrote no row, because a statement of the
    /// application's stood under the name of idem's (prepared inside a
    /// function, where idem cannot see it; names starting `idem_` are
    /// reserved). The body's writes are committed without a record, so a
    /// repeat of the key would run again; the connection is closed, and its
    /// statements with it. A bug in the application (500).
    #[error("the body's writes were committed, but the key's record was not written: a statement of the application's stands under a name idem reserves (idem_..); a repeat of the key would run again")]
    RecordNotWritten,
    /// `COMMIT` was answered with an error that is not replayable (a deferred
    /// constraint, say): nothing was committed.
    #[error("COMMIT failed, nothing was committed: {0}")]
    Commit(#[source] diesel::result::Error),
    /// `BEGIN` failed for a reason that is not replayable.
    #[error("could not begin a transaction: {0}")]
    Begin(#[source] diesel::result::Error),
    /// No connection could be checked out of the pool in time.
    #[error("could not check out a connection: {0}")]
    Pool(#[from] crate::pool::PoolError),
    /// A retryable function was called from inside another one's attempt. Its
    /// loop would commit on its own connection, outside the caller's
    /// transaction, and be replayed with it: call the inner function's body
    /// directly with the caller's connection instead.
    #[error("a #[retryable] function was called inside another retry loop's attempt; call its body with the attempt's connection instead")]
    Nested,

    /// The key is empty, longer than 255 bytes, or has control, invisible or
    /// direction-changing characters (400).
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
    /// not known here (or, in local mode, its body committed by hand, without
    /// its record); it is not retried (until [`settle`](crate::idempotency::settle)d).
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
    /// The key's record says something idem cannot read as any answer: a
    /// completed record without an outcome or a response, or a state idem
    /// does not know (written by hand; idem's own writes never make one).
    /// Nothing is replayed and the body does not run: the key stays held
    /// until someone repairs or deletes the record by hand (`idem key show`
    /// shows it) or, for a completed one, its retention ends (500).
    #[error("the idempotency record of this key is malformed ({reason}): not replayed, and the request not run")]
    MalformedRecord {
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The response cannot be stored under the key (too large, a NUL
    /// character, nested too deep), so it could not be replayed: nothing was
    /// committed and the key stays free (422). A *final* error that cannot be
    /// stored is returned as it is instead, unrecorded, with a warning.
    #[error("the response cannot be stored for replay: {0}; nothing was committed")]
    Unstorable(Unstorable),
    /// External mode: the claim of this key was settled by hand, or its
    /// lease ran out and another request took the key, while this request
    /// ran. Its writes were rolled back; nothing was committed (409).
    #[error(
        "the claim of this idempotency key was lost while the request ran; nothing was committed"
    )]
    ClaimLost,
    /// A statement idem ran for the request failed, for a reason that is
    /// not replayable (or after the budget ran out).
    #[error("database error: {0}")]
    Database(#[from] diesel::result::Error),
}

/// The message every caller of a key with an unknown outcome gets. It names
/// no outside system: a local key is held this way too, after its body
/// committed by hand without the record (see [`Error::OutcomeUnknown`]).
pub const OUTCOME_UNKNOWN_MESSAGE: &str =
    "the first request with this key may have taken effect and its outcome is not known here; \
     not run again until the key is settled";

/// Why a response cannot be stored under its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Unstorable {
    /// Larger than [`IdempotencyConfig::max_response_bytes`](crate::IdempotencyConfig::max_response_bytes).
    #[error("it is {size} bytes of JSON, over the {limit}-byte limit")]
    TooLarge {
        /// Its size in bytes of JSON.
        size: usize,
        /// The configured limit.
        limit: usize,
    },
    /// A string or object key has U+0000, which PostgreSQL's `jsonb` cannot hold.
    #[error("it contains the character U+0000, which PostgreSQL cannot store")]
    NulCharacter,
    /// Arrays and objects nested deeper than [`MAX_STORED_DEPTH`](crate::idempotency::MAX_STORED_DEPTH):
    /// stored, it could not be read back.
    #[error("arrays and objects are nested more than {limit} deep")]
    TooDeep {
        /// The limit.
        limit: usize,
    },
}

impl Transient for Error {
    fn transient(&self) -> Option<RetryCause> {
        match self {
            Error::Database(e) => e.transient(),
            _ => None,
        }
    }
}

/// Names the error types a `#[retryable]` or `#[idempotent]` function may
/// return: those that can carry idem's own failures.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot carry idem's own failures",
    label = "the error type of this function",
    note = "add a variant `Idem(#[from] idem::Error)` to `{Self}` (or implement `From<idem::Error>` for it)"
)]
pub trait FromIdemError: From<Error> {}
impl<T: From<Error>> FromIdemError for T {}
