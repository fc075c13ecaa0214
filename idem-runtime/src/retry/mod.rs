//! Replaying a transaction that lost a race: from the start, outside the
//! transaction, on a connection checked out anew (a new one after a lost
//! connection), within a budget of attempts and time.
//!
//! The loop ([`RetryLoop`], or the closure form [`retry`], or the
//! `#[retryable]` macro that expands to the loop) runs each attempt as
//!
//! 1. check a connection out of the [`Pool`](crate::pool::Pool);
//! 2. `BEGIN ISOLATION LEVEL ..`, with the attempt's timeouts (see below);
//! 3. run the body, built anew from the original arguments;
//! 4. on `Ok`, `COMMIT`, unless a statement of the body failed and the body
//!    swallowed the error, which would otherwise turn the `COMMIT` into a
//!    silent rollback reported as success ([`Error::RolledBack`]);
//! 5. on `Err`, `ROLLBACK` (or discard the connection when that fails), then
//!    replay only if the attempt failed on a race the server reported (a
//!    statement's 40001 or 40P01, a lost connection, a versioned write gone
//!    stale from a version read in the attempt, a lock wait that reached the
//!    attempt's `lock_timeout`) and the budget allows. What the body returned
//!    does not decide it: see [`Transient`].
//!
//! # The deadline bounds the call
//!
//! [`RetryPolicy::deadline`] bounds the call: every statement of an attempt
//! is cancelled by the server when the call's deadline passes. Each attempt's
//! `BEGIN` carries, in the same simple query (no extra round trip),
//! `SET LOCAL statement_timeout` set to the time left before the deadline and
//! `SET LOCAL lock_timeout` set to half of it (all of it on the last attempt
//! the budget allows): a row lock held elsewhere cannot pin the call, nor its
//! pooled connection, past the deadline, and a lock wait that gives up early
//! leaves time to back off and replay ([`RetryCause::LockTimeout`], replayed
//! whatever [`RetryPolicy::retry_lock_not_available`] says). A statement the
//! deadline cancels ends the call with [`Error::Exhausted`] and
//! [`RetryCause::DeadlineExceeded`] (HTTP 503). The settings are
//! transaction-scoped: they end with the attempt, leave nothing on the pooled
//! connection, and hold behind PgBouncer's transaction pooling.
//!
//! What the server bounds is each statement, from when it starts, by the time
//! left when its attempt began: a statement that starts late in an attempt
//! can outlive the deadline by the time the attempt had already run. The wait
//! for a pooled connection is bounded by the deadline too, and no attempt
//! begins after it. Repeats that spend no attempt (a duplicate waiting for
//! the first request, bounded by its own `wait`; an external claim committed
//! before the body) are not charged to the deadline. `COMMIT` is the one statement bounded from the client,
//! by [`RetryPolicy::commit_timeout`]. In external idempotent mode the body's
//! call to another system runs with nothing open and is not bounded by idem
//! (give its client a timeout); the transaction that records its outcome gets
//! the time that was left when the body started, counted from when it begins.
//!
//! A connection that breaks while `COMMIT` is in flight, or whose `COMMIT`
//! gets no answer within [`RetryPolicy::commit_timeout`], leaves the outcome
//! unknown: the loop returns [`Error::CommitUnknown`] and never replays,
//! since the transaction may have committed. An idempotency record (see the
//! `#[idempotent]` macro) is what tells a later request which it was.

mod attempt;
mod backoff;
mod ended;
mod run;

use std::time::Duration;

pub use crate::cause::{RetryCause, Transient};
pub use crate::tx::Isolation;
pub use attempt::{Attempt, Begin, Deferred};
pub use run::{commit, retry, RetryLoop, Step};

/// What the loop does about rows that keep conflicting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnConflict {
    /// Replay optimistically every time.
    #[default]
    Retry,
    /// After an attempt fails on a version conflict or a 40001, the next
    /// attempts load versioned rows with `SELECT ... FOR UPDATE`: a hot row
    /// stops burning attempts, while calls that never conflict never lock.
    /// A row that lost a version race is also remembered for
    /// [`RetryPolicy::hot_row_memory`], and later calls lock it from their
    /// first attempt.
    Lock,
}

/// The budget and settings of a retry loop. Every number has a documented
/// default; build one with [`RetryPolicy::new`] and the `const` setters, in a
/// `#[retryable(..)]` attribute or at run time.
///
/// ```
/// use std::time::Duration;
/// use idem_runtime::retry::{Isolation, RetryPolicy};
///
/// const TRANSFER: RetryPolicy = RetryPolicy::new()
///     .max_attempts(5)
///     .deadline(Duration::from_millis(500))
///     .isolation(Isolation::Serializable);
/// assert_eq!(TRANSFER.max_attempts, 5);
/// assert_eq!(TRANSFER.base_backoff, Duration::from_millis(10));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Most attempts, the first included. Default 4. At least 1.
    pub max_attempts: u32,
    /// Total time budget from the call (repeats that spend no attempt, such
    /// as a duplicate waiting for the first request, are not charged to
    /// it). The deadline bounds the call: every
    /// statement of an attempt is cancelled by the server when the call's
    /// deadline passes (each attempt sets `statement_timeout`, and a shorter
    /// `lock_timeout`, from the time left when it begins; see the [module
    /// docs](self)); no checkout waits, no attempt starts and no backoff
    /// sleeps past it. A call that runs out of it ends with
    /// [`Error::Exhausted`], whose cause [`RetryCause::is_timeout`] (HTTP 503).
    /// Default 800 ms. Zero is taken as it is and fails every call with
    /// [`Error::Exhausted`] before any attempt (the attribute refuses
    /// `deadline_ms = 0`).
    pub deadline: Duration,
    /// First backoff ceiling; it doubles after each failed attempt. Default 10 ms.
    pub base_backoff: Duration,
    /// Largest backoff ceiling. Default 150 ms.
    pub max_backoff: Duration,
    /// Isolation level of each attempt. Default read committed.
    pub isolation: Isolation,
    /// What to do about hot rows. Default [`OnConflict::Retry`].
    pub on_conflict: OnConflict,
    /// Replay 55P03 lock_not_available too (`NOWAIT`, or a `lock_timeout`
    /// the body set itself). Default false. The `lock_timeout` each attempt
    /// sets from the deadline is replayed regardless
    /// ([`RetryCause::LockTimeout`]).
    pub retry_lock_not_available: bool,
    /// How long to wait for the answer to `COMMIT` before declaring the
    /// outcome unknown. Default 10 s.
    pub commit_timeout: Duration,
    /// Under [`OnConflict::Lock`]: how long a row that lost a version race
    /// stays hot, read `FOR UPDATE` from the first attempt of later calls.
    /// Default 10 s.
    pub hot_row_memory: Duration,
}

impl RetryPolicy {
    /// The defaults: 4 attempts, 800 ms, backoff 10 ms doubling to 150 ms with
    /// full jitter, read committed, no locking, 55P03 not replayed.
    pub const fn new() -> RetryPolicy {
        RetryPolicy {
            max_attempts: 4,
            deadline: Duration::from_millis(800),
            base_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(150),
            isolation: Isolation::ReadCommitted,
            on_conflict: OnConflict::Retry,
            retry_lock_not_available: false,
            commit_timeout: Duration::from_secs(10),
            hot_row_memory: Duration::from_secs(10),
        }
    }

    /// Set [`max_attempts`](Self::max_attempts); 0 is raised to 1.
    pub const fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = if n == 0 { 1 } else { n };
        self
    }

    /// Set [`deadline`](Self::deadline).
    pub const fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// Set [`base_backoff`](Self::base_backoff) and [`max_backoff`](Self::max_backoff).
    pub const fn backoff(mut self, base: Duration, cap: Duration) -> Self {
        self.base_backoff = base;
        self.max_backoff = cap;
        self
    }

    /// Set [`base_backoff`](Self::base_backoff) alone.
    pub const fn backoff_base(mut self, base: Duration) -> Self {
        self.base_backoff = base;
        self
    }

    /// Set [`max_backoff`](Self::max_backoff) alone.
    pub const fn backoff_cap(mut self, cap: Duration) -> Self {
        self.max_backoff = cap;
        self
    }

    /// Set [`isolation`](Self::isolation).
    pub const fn isolation(mut self, isolation: Isolation) -> Self {
        self.isolation = isolation;
        self
    }

    /// Set [`on_conflict`](Self::on_conflict).
    pub const fn on_conflict(mut self, on_conflict: OnConflict) -> Self {
        self.on_conflict = on_conflict;
        self
    }

    /// Set [`retry_lock_not_available`](Self::retry_lock_not_available).
    pub const fn retry_lock_not_available(mut self, yes: bool) -> Self {
        self.retry_lock_not_available = yes;
        self
    }

    /// Set [`commit_timeout`](Self::commit_timeout).
    pub const fn commit_timeout(mut self, timeout: Duration) -> Self {
        self.commit_timeout = timeout;
        self
    }

    /// Set [`hot_row_memory`](Self::hot_row_memory).
    pub const fn hot_row_memory(mut self, memory: Duration) -> Self {
        self.hot_row_memory = memory;
        self
    }

    /// Whether this policy replays failures of this cause at all.
    pub fn replays(&self, cause: RetryCause) -> bool {
        cause != RetryCause::LockNotAvailable || self.retry_lock_not_available
    }
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy::new()
    }
}

pub use crate::error::Error;

/// The retry loop's failures, now variants of [`Error`].
#[deprecated(
    since = "0.2.0",
    note = "use `idem::Error`: retry and idempotency failures are one type"
)]
pub type RetryError = Error;
