//! Which failures are worth replaying, and how to tell them apart.
//!
//! The set is deliberately narrow. diesel-async reports SQLSTATE only for a few
//! classes (40001 among them); everything else, deadlocks included, arrives as
//! `DatabaseErrorKind::Unknown` with the server's message. idem's pool asks the
//! server for untranslated (C locale) messages on every new connection, which
//! makes the text of 40P01 and 55P03 fixed. Where the server refuses that
//! (a non-superuser without `GRANT SET ON PARAMETER lc_messages`) and the
//! server's own `lc_messages` is not English, a deadlock is not recognised:
//! it is returned to the caller instead of being replayed. That is the safe
//! direction: nothing that is not known to be replayable is replayed.
//!
//! Two causes come only from the loop's own bounds, which each attempt sets
//! from the call's deadline (see [`crate::retry`]): [`RetryCause::LockTimeout`]
//! and [`RetryCause::DeadlineExceeded`]. The server's error does not say whose
//! `lock_timeout` or `statement_timeout` expired, so the attempt's connection
//! tells them apart by how long the failed statement ran ([`own_timeout`]): a
//! body's own, shorter `SET LOCAL lock_timeout` keeps its meaning (55P03,
//! [`RetryCause::LockNotAvailable`], replayed only on opt-in), and a body's own
//! `statement_timeout` is not replayed at all.

use std::fmt;
use std::time::Duration;

use diesel::result::{DatabaseErrorKind, Error as DieselError};

use crate::versioned::VersionedError;

/// Why an attempt failed in a way that replaying the whole transaction can fix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RetryCause {
    /// 40001 serialization_failure: the transaction lost a race under
    /// REPEATABLE READ or SERIALIZABLE.
    SerializationFailure,
    /// 40P01 deadlock_detected: the server chose this transaction as the victim.
    Deadlock,
    /// A versioned write found a newer version ([`VersionedError::Stale`]).
    Stale,
    /// 55P03 lock_not_available (`NOWAIT`, or a `lock_timeout` the body set
    /// itself). Replayed only when the policy opts in
    /// ([`super::RetryPolicy::retry_lock_not_available`]); the loop's own
    /// `lock_timeout` is [`RetryCause::LockTimeout`].
    LockNotAvailable,
    /// The connection broke before COMMIT was sent, so the transaction did not
    /// commit; the next attempt runs on a fresh connection.
    ConnectionLost,
    /// 55P03 from the `lock_timeout` the loop sets on each attempt (a share
    /// of the time left): a lock wait gave up while there was still time to
    /// replay. Always replayed while the budget allows.
    LockTimeout,
    /// The call's deadline passed: a statement was cancelled by the
    /// `statement_timeout` the loop sets from it (57014), or no time was left
    /// to begin another attempt. Replayed only if the budget still allows,
    /// which it normally does not: the loop then ends with
    /// [`Error::Exhausted`](crate::Error::Exhausted).
    DeadlineExceeded,
}

impl RetryCause {
    /// A stable lower-case name, used in logs and metrics labels.
    pub fn as_str(self) -> &'static str {
        match self {
            RetryCause::SerializationFailure => "serialization_failure",
            RetryCause::Deadlock => "deadlock_detected",
            RetryCause::Stale => "stale_version",
            RetryCause::LockNotAvailable => "lock_not_available",
            RetryCause::ConnectionLost => "connection_lost",
            RetryCause::LockTimeout => "lock_timeout",
            RetryCause::DeadlineExceeded => "deadline_exceeded",
        }
    }

    /// The call ran out of time rather than out of luck: a budget that
    /// ends on it means the database was busy (HTTP 503), not that the
    /// request lost a race (409).
    pub fn is_timeout(self) -> bool {
        matches!(self, RetryCause::LockTimeout | RetryCause::DeadlineExceeded)
    }

    /// A conflict with another writer over the same rows: what makes the
    /// `on_conflict = lock` policy lock rows on the next attempts.
    pub fn is_write_conflict(self) -> bool {
        matches!(self, RetryCause::SerializationFailure | RetryCause::Stale)
    }
}

impl fmt::Display for RetryCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether a failure is worth replaying the transaction for.
///
/// The retry loop does not ask your error type: it classifies the failed
/// statements it sees on the attempt's connection, and the version conflicts
/// of its versioned writes, with this trait's implementations for diesel's
/// error and [`VersionedError`]. They are public for code that classifies by
/// hand (a handler choosing a status, say).
///
/// ```
/// use idem_runtime::retry::{RetryCause, Transient};
/// use diesel::result::{DatabaseErrorKind, Error};
///
/// let lost = Error::DatabaseError(DatabaseErrorKind::SerializationFailure, Box::new(String::new()));
/// assert_eq!(lost.transient(), Some(RetryCause::SerializationFailure));
/// ```
pub trait Transient {
    /// `Some(cause)` when replaying the whole transaction may succeed.
    fn transient(&self) -> Option<RetryCause>;
}

/// The untranslated messages of the errors diesel-async reports as `Unknown`.
const DEADLOCK: &str = "deadlock detected";
const LOCK_TIMEOUT: &str = "canceling statement due to lock timeout";
const NOWAIT_ROW: &str = "could not obtain lock on row";
const NOWAIT_RELATION: &str = "could not obtain lock on relation";
const ADMIN_SHUTDOWN: &str = "terminating connection due to administrator command";
const STATEMENT_TIMEOUT: &str = "canceling statement due to statement timeout";

/// Whether `err`, met by a statement that ran for `ran`, is the expiry of
/// the loop's own `statement_timeout` (`statement`) or `lock_timeout`
/// (`lock`), and not of a shorter one the body set.
///
/// The server cancels a statement only once its timeout has passed, and the
/// client's `ran` spans the whole statement, so an expiry of the loop's own
/// timeout always ran at least as long. A fifth of margin absorbs clock
/// differences; a body's own setting that close to the loop's is counted as
/// the loop's, which only means it is replayed within the budget.
pub(crate) fn own_timeout(
    err: &DieselError,
    ran: Duration,
    statement: Duration,
    lock: Duration,
) -> Option<RetryCause> {
    let DieselError::DatabaseError(DatabaseErrorKind::Unknown, info) = err else {
        return None;
    };
    let at_least = |limit: Duration| ran >= limit - limit / 5;
    match info.message() {
        STATEMENT_TIMEOUT if at_least(statement) => Some(RetryCause::DeadlineExceeded),
        LOCK_TIMEOUT if at_least(lock) => Some(RetryCause::LockTimeout),
        _ => None,
    }
}

impl Transient for DieselError {
    fn transient(&self) -> Option<RetryCause> {
        match self {
            DieselError::DatabaseError(DatabaseErrorKind::SerializationFailure, _) => {
                Some(RetryCause::SerializationFailure)
            }
            DieselError::DatabaseError(
                DatabaseErrorKind::UnableToSendCommand | DatabaseErrorKind::ClosedConnection,
                _,
            ) => Some(RetryCause::ConnectionLost),
            DieselError::DatabaseError(DatabaseErrorKind::Unknown, info) => {
                let message = info.message();
                if message == DEADLOCK {
                    Some(RetryCause::Deadlock)
                } else if message == LOCK_TIMEOUT
                    || message.starts_with(NOWAIT_ROW)
                    || message.starts_with(NOWAIT_RELATION)
                {
                    Some(RetryCause::LockNotAvailable)
                } else if message == ADMIN_SHUTDOWN {
                    Some(RetryCause::ConnectionLost)
                } else {
                    None
                }
            }
            _ => None,
        }
    }
}

impl Transient for VersionedError {
    fn transient(&self) -> Option<RetryCause> {
        match self {
            VersionedError::Stale { .. } => Some(RetryCause::Stale),
            VersionedError::Database(e) => e.transient(),
            VersionedError::NotFound
            | VersionedError::StateMismatch { .. }
            | VersionedError::IllegalTransition { .. } => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unknown(message: &'static str) -> DieselError {
        DieselError::DatabaseError(DatabaseErrorKind::Unknown, Box::new(message.to_string()))
    }

    #[test]
    fn the_retry_set_is_narrow() {
        assert_eq!(
            unknown("deadlock detected").transient(),
            Some(RetryCause::Deadlock)
        );
        assert_eq!(
            unknown("could not obtain lock on row in relation \"t\"").transient(),
            Some(RetryCause::LockNotAvailable)
        );
        assert_eq!(
            unknown("canceling statement due to statement timeout").transient(),
            None
        );
        assert_eq!(unknown("permission denied for table t").transient(), None);
        let unique =
            DieselError::DatabaseError(DatabaseErrorKind::UniqueViolation, Box::new(String::new()));
        assert_eq!(unique.transient(), None);
        let check =
            DieselError::DatabaseError(DatabaseErrorKind::CheckViolation, Box::new(String::new()));
        assert_eq!(check.transient(), None);
        assert_eq!(DieselError::NotFound.transient(), None);
        assert_eq!(
            VersionedError::Stale {
                expected: 1,
                actual: 2
            }
            .transient(),
            Some(RetryCause::Stale)
        );
        assert_eq!(VersionedError::NotFound.transient(), None);
    }

    #[test]
    fn only_the_loops_own_timeouts_are_its_own() {
        let ms = Duration::from_millis;
        let statement = unknown("canceling statement due to statement timeout");
        let lock = unknown("canceling statement due to lock timeout");
        // Ran as long as the loop's bound: the loop's own.
        assert_eq!(
            own_timeout(&statement, ms(300), ms(300), ms(150)),
            Some(RetryCause::DeadlineExceeded)
        );
        assert_eq!(
            own_timeout(&lock, ms(151), ms(300), ms(150)),
            Some(RetryCause::LockTimeout)
        );
        // Much shorter: a bound the body set itself keeps its meaning.
        assert_eq!(own_timeout(&statement, ms(50), ms(300), ms(150)), None);
        assert_eq!(own_timeout(&lock, ms(50), ms(300), ms(150)), None);
        assert_eq!(lock.transient(), Some(RetryCause::LockNotAvailable));
        // Other errors are never the loop's timeouts, however long they ran.
        assert_eq!(
            own_timeout(&unknown("deadlock detected"), ms(900), ms(300), ms(150)),
            None
        );
        assert_eq!(
            own_timeout(
                &unknown("canceling statement due to user request"),
                ms(900),
                ms(300),
                ms(150)
            ),
            None
        );
    }
}
