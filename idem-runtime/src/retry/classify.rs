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

use std::fmt;

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
    /// 55P03 lock_not_available (`NOWAIT`, `lock_timeout`). Replayed only when
    /// the policy opts in ([`super::RetryPolicy::retry_lock_not_available`]).
    LockNotAvailable,
    /// The connection broke before COMMIT was sent, so the transaction did not
    /// commit; the next attempt runs on a fresh connection.
    ConnectionLost,
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
        }
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
            VersionedError::NotFound | VersionedError::StateMismatch { .. } => None,
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
}
