//! Which failures are worth replaying a transaction for, and how to tell
//! them apart: the vocabulary the transaction driver, the retry loop and the
//! one error type share.
//!
//! The retry loop classifies by SQLSTATE and severity, not by message text
//! (but for one, below). Its connections are read on the wire
//! ([`crate::pool`]), where every failed statement comes with its SQLSTATE,
//! whichever diesel call ran it: [`from_sqlstate`] is what the loop replays
//! for. The [`Transient`] trait classifies a diesel error by
//! hand (diesel reports SQLSTATE only for a few classes, 40001 among them;
//! deadlocks and lock timeouts arrive as `DatabaseErrorKind::Unknown` with
//! the server's message, so it reads the untranslated message, which idem's
//! pool asks for where the server lets it).
//!
//! Two causes come only from the loop's own bounds, which each attempt sets
//! from the call's deadline (see [`crate::retry`]): [`RetryCause::LockTimeout`]
//! and [`RetryCause::DeadlineExceeded`]. The server's error does not say whose
//! `lock_timeout` or `statement_timeout` expired, so they are told apart by
//! how long the failed statement ran (the wire knows when it was sent): a
//! body's own, shorter `SET LOCAL lock_timeout` keeps its meaning (55P03,
//! [`RetryCause::LockNotAvailable`], replayed only on opt-in), and a body's own
//! `statement_timeout` is not replayed at all. Nor is a statement someone
//! cancelled (`pg_cancel_backend`), which the server's message tells from
//! a timeout, nor a shutdown code (57P01, 57P02) a body raised itself,
//! which did not end the session (its severity, FATAL or not, says so).

use std::fmt;
use std::time::Duration;

use diesel::result::{DatabaseErrorKind, Error as DieselError};

/// Why an attempt failed in a way that replaying the whole transaction can fix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RetryCause {
    /// 40001 serialization_failure: the transaction lost a race under
    /// REPEATABLE READ or SERIALIZABLE.
    SerializationFailure,
    /// 40P01 deadlock_detected: the server chose this transaction as the victim.
    Deadlock,
    /// A versioned write found a newer version
    /// ([`VersionedError::Stale`](crate::versioned::VersionedError::Stale)).
    Stale,
    /// 55P03 lock_not_available (`NOWAIT`, or a `lock_timeout` the body set
    /// itself). Replayed only when the policy opts in
    /// ([`crate::retry::RetryPolicy::retry_lock_not_available`]); the loop's own
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
/// The retry loop does not ask your error type, nor this trait: it reads the
/// SQLSTATE of every failed statement off the attempt's connection
/// (`from_sqlstate` in `cause.rs`), and counts the version conflicts of its versioned
/// writes. This trait's implementations (for diesel's error and
/// `VersionedError`) are for code that classifies by hand (a handler
/// choosing a status, say); they read the server's message where diesel
/// gives no SQLSTATE.
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

/// The loop's own bounds on one transaction's statements (see
/// [`crate::retry`]): what its `statement_timeout` and `lock_timeout` were.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Bounds {
    pub(crate) statement: Duration,
    pub(crate) lock: Duration,
}

/// What the server said of a failed statement besides its SQLSTATE, read
/// off its `ErrorResponse` on the wire.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Said {
    /// Its severity (never translated) was FATAL or PANIC: the session
    /// ended with it. A 57P01 or 57P02 a body raises itself is an ERROR,
    /// and its connection goes on.
    pub(crate) fatal: bool,
    /// A 57014 whose message is the server's for a cancel request
    /// ([`CANCEL_REQUEST`]): someone cancelled it (an operator's
    /// `pg_cancel_backend`, a client's cancel), not a timeout. Read from
    /// the untranslated message, so only where the session's messages are
    /// in English (idem's pool asks for `lc_messages = C`); a translated
    /// one counts as not said.
    pub(crate) cancel_request: bool,
}

/// The server's untranslated message for a statement stopped by a cancel
/// request; a timeout's says "due to statement timeout".
pub(crate) const CANCEL_REQUEST: &[u8] = b"canceling statement due to user request";

/// What a statement that failed with SQLSTATE `code` after running for `ran`
/// means for its transaction, under the loop's `bounds` (none: a transaction
/// the loop did not bound).
///
/// 55P03 and 57014 are the loop's own timeouts only when the statement ran
/// as long as the loop's bound: the server cancels a statement only once its
/// timeout has passed, and `ran` spans the whole statement (counted from
/// its write, or from the answer before it), so an expiry of the loop's own
/// timeout always ran at least as long; but for a request sent behind
/// another's, `ran` counts from when the client read the answer before it,
/// which a loaded client reads late. So a margin: a fifth of the bound, at
/// most 100 ms, or a twentieth of a bound over 2 s (a body's own lock
/// timeout of 1.7 s under the loop's 2 s was replayed to the deadline when
/// the margin was a fifth of any bound). A body's own setting within it is
/// counted as the loop's, which only means it is replayed within the
/// budget. A `NOWAIT` fails at once, so it stays 55P03's own meaning,
/// and a 57014 the server says a cancel request caused is nobody's timeout.
/// 57P01 and 57P02 are a lost connection only when they ended the session.
pub(crate) fn from_sqlstate(
    code: &[u8; 5],
    said: Said,
    ran: Duration,
    bounds: Option<Bounds>,
) -> Option<RetryCause> {
    let at_least = |limit: Duration| ran >= limit - margin(limit);
    match code {
        b"40001" => Some(RetryCause::SerializationFailure),
        b"40P01" => Some(RetryCause::Deadlock),
        b"55P03" if bounds.is_some_and(|b| at_least(b.lock)) => Some(RetryCause::LockTimeout),
        b"55P03" => Some(RetryCause::LockNotAvailable),
        b"57014" if !said.cancel_request && bounds.is_some_and(|b| at_least(b.statement)) => {
            Some(RetryCause::DeadlineExceeded)
        }
        // admin_shutdown, crash_shutdown: the connection ends with it.
        b"57P01" | b"57P02" if said.fatal => Some(RetryCause::ConnectionLost),
        _ => None,
    }
}

/// How much shorter than the loop's bound a timeout may have looked and
/// still be the loop's (see [`from_sqlstate`]).
fn margin(limit: Duration) -> Duration {
    (limit / 5).min(Duration::from_millis(100)).max(limit / 20)
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
    }

    #[test]
    fn sqlstates_the_loop_replays() {
        let ms = Duration::from_millis;
        let bounds = Some(Bounds {
            statement: ms(300),
            lock: ms(150),
        });
        let fatal = Said {
            fatal: true,
            ..Said::default()
        };
        assert_eq!(
            from_sqlstate(b"40001", Said::default(), ms(1), bounds),
            Some(RetryCause::SerializationFailure)
        );
        assert_eq!(
            from_sqlstate(b"40P01", Said::default(), ms(1), None),
            Some(RetryCause::Deadlock)
        );
        assert_eq!(
            from_sqlstate(b"57P01", fatal, ms(1), bounds),
            Some(RetryCause::ConnectionLost)
        );
        assert_eq!(
            from_sqlstate(b"57P02", fatal, ms(1), bounds),
            Some(RetryCause::ConnectionLost)
        );
        // Raised by a body (ERROR, the session goes on): its own error.
        for code in [b"57P01", b"57P02"] {
            assert_eq!(from_sqlstate(code, Said::default(), ms(1), bounds), None);
        }
        // Not transient whatever they ran: a user's 23505, 22012, 25P02.
        for code in [b"23505", b"22012", b"25P02", b"42P01"] {
            assert_eq!(from_sqlstate(code, Said::default(), ms(900), bounds), None);
        }
    }

    #[test]
    fn only_the_loops_own_timeouts_are_its_own() {
        let ms = Duration::from_millis;
        let bounds = Some(Bounds {
            statement: ms(300),
            lock: ms(150),
        });
        // Ran as long as the loop's bound: the loop's own.
        assert_eq!(
            from_sqlstate(b"57014", Said::default(), ms(300), bounds),
            Some(RetryCause::DeadlineExceeded)
        );
        assert_eq!(
            from_sqlstate(b"55P03", Said::default(), ms(151), bounds),
            Some(RetryCause::LockTimeout)
        );
        // Much shorter: a bound the body set itself (or NOWAIT) keeps its meaning.
        assert_eq!(
            from_sqlstate(b"57014", Said::default(), ms(50), bounds),
            None
        );
        assert_eq!(
            from_sqlstate(b"55P03", Said::default(), ms(50), bounds),
            Some(RetryCause::LockNotAvailable)
        );
        // The margin: a fifth of a short bound, 100 ms of a longer one, a
        // twentieth of one over 2 s.
        assert_eq!(
            from_sqlstate(b"57014", Said::default(), ms(241), bounds),
            Some(RetryCause::DeadlineExceeded)
        );
        assert_eq!(
            from_sqlstate(b"57014", Said::default(), ms(239), bounds),
            None
        );
        assert_eq!(margin(ms(1000)), ms(100));
        assert_eq!(margin(ms(4000)), ms(200));
        let long = Some(Bounds {
            statement: ms(4000),
            lock: ms(2000),
        });
        // A body's own lock timeout at 85% of the loop's 2 s is its own.
        assert_eq!(
            from_sqlstate(b"55P03", Said::default(), ms(1700), long),
            Some(RetryCause::LockNotAvailable)
        );
        assert_eq!(
            from_sqlstate(b"55P03", Said::default(), ms(1901), long),
            Some(RetryCause::LockTimeout)
        );
        // A cancel request is nobody's timeout, however long it ran.
        let cancelled = Said {
            cancel_request: true,
            ..Said::default()
        };
        assert_eq!(from_sqlstate(b"57014", cancelled, ms(900), bounds), None);
        // A transaction the loop did not bound has no timeouts of its own.
        assert_eq!(
            from_sqlstate(b"57014", Said::default(), ms(900), None),
            None
        );
        assert_eq!(
            from_sqlstate(b"55P03", Said::default(), ms(900), None),
            Some(RetryCause::LockNotAvailable)
        );
    }
}
