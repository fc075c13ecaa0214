//! The one table that decides the HTTP status of each of idem's outcomes.
//! [`Problem`](super::Problem) takes its statuses from here.

use crate::{CreateOnceError, Error, RetryCause, Transient, VersionedError};

use super::etag::EtagError;

/// The HTTP status a handler answers an outcome with.
///
/// ```
/// use idem::http::HttpStatus;
/// assert_eq!(idem::Error::FingerprintMismatch.http_status(), 422);
/// assert_eq!(idem::VersionedError::NotFound.http_status(), 404);
/// ```
pub trait HttpStatus {
    /// The status code.
    fn http_status(&self) -> u16;
}

impl HttpStatus for Error {
    /// 400 for a bad key, 409 for a conflict that a later retry may win,
    /// 422 for a key reused for another request or a response that cannot
    /// be stored under its key, 502 when an outside system may have acted,
    /// 503 when the database is busy (the call's deadline passed, or rows
    /// stayed locked through every attempt) or unreachable or the commit's
    /// outcome is unknown (retry with the same key), 409 or 503 for a race
    /// lost or a lock refused outside a retry loop (see
    /// [the table](crate::http)), 500 otherwise.
    fn http_status(&self) -> u16 {
        match self {
            Error::InvalidKey { .. } | Error::MissingKey => 400,
            Error::FingerprintMismatch | Error::Unstorable(_) => 422,
            Error::Exhausted { last_cause, .. } if busy(*last_cause) => 503,
            Error::Exhausted { .. } | Error::InProgress | Error::ClaimLost => 409,
            Error::OutcomeUnknown => 502,
            Error::CommitUnknown { .. } | Error::Pool(_) => 503,
            _ => unreplayed(self).unwrap_or(500),
        }
    }
}

impl HttpStatus for VersionedError {
    /// 412 for a stale precondition, 404, 409 for a refused or illegal
    /// transition, 409 or 503 for a race lost or a lock refused outside a
    /// retry loop (see [the table](crate::http)), 500 otherwise.
    ///
    /// ```
    /// use diesel::result::{DatabaseErrorKind, Error as DieselError};
    /// use idem::http::HttpStatus;
    /// use idem::VersionedError;
    ///
    /// let lost = DieselError::DatabaseError(DatabaseErrorKind::SerializationFailure, Box::new(String::new()));
    /// assert_eq!(VersionedError::Database(lost).http_status(), 409);
    /// let broken = DieselError::DatabaseError(DatabaseErrorKind::ClosedConnection, Box::new(String::new()));
    /// assert_eq!(VersionedError::Database(broken).http_status(), 500);
    /// ```
    fn http_status(&self) -> u16 {
        match self {
            VersionedError::Stale { .. } => 412,
            VersionedError::NotFound => 404,
            VersionedError::StateMismatch { .. } | VersionedError::IllegalTransition { .. } => 409,
            _ => unreplayed(self).unwrap_or(500),
        }
    }
}

impl HttpStatus for CreateOnceError {
    /// 422 for a key reused for another request (as for
    /// [`Error::FingerprintMismatch`]), 409 when another row holds one of
    /// the new row's unique values, 400 for a missing key, 409 or 503 for a
    /// race lost or a lock refused outside a retry loop (see
    /// [the table](crate::http)), 500 otherwise (a missing unique index is
    /// the service's fault, not the client's).
    ///
    /// ```
    /// use idem::http::HttpStatus;
    /// assert_eq!(idem::CreateOnceError::Mismatch { fields: vec!["amount"] }.http_status(), 422);
    /// assert_eq!(idem::CreateOnceError::Conflict.http_status(), 409);
    /// ```
    fn http_status(&self) -> u16 {
        match self {
            CreateOnceError::Mismatch { .. } => 422,
            CreateOnceError::Conflict => 409,
            CreateOnceError::MissingKey => 400,
            _ => unreplayed(self).unwrap_or(500),
        }
    }
}

/// Whether a failure the retry loop replays means the database was busy
/// (503: rows stayed locked, or time ran out) rather than that the request
/// lost a race (409), whether it ends a loop's last attempt or reaches a
/// handler unreplayed.
pub(super) fn busy(cause: RetryCause) -> bool {
    cause.is_timeout() || cause == RetryCause::LockNotAvailable
}

/// The status of a failure the retry loop replays, when it reaches a handler
/// unreplayed: a statement outside `#[retryable]` (or `#[idempotent]`, whose
/// loop ends in [`Error::Exhausted`] instead). A lost race (40001
/// serialization failure, 40P01 deadlock) is 409; rows locked elsewhere
/// (55P03: `NOWAIT`, a `lock_timeout` of the handler's own) are 503 (see
/// [`busy`]). The statement that failed was rolled back with its
/// transaction; statements the handler committed before it are not, which
/// is why the problem says no more. A lost connection is not here (500):
/// the statement itself may have committed.
///
/// The kind is read as [`Transient`] reads it: diesel names 40001, but
/// gives 40P01 and 55P03 no kind of their own, so those are told by the
/// server's message (in English: idem's pool sets `lc_messages` to `C`). An
/// error of another SQLSTATE raised with the same message (a PL/pgSQL
/// handler re-raising `SQLERRM`) counts as one, and a 40P01 or 55P03 raised
/// with a message of its own does not.
///
/// Only the database error variants reach it; the other variants are
/// matched before.
pub(super) fn unreplayed(e: &impl Transient) -> Option<u16> {
    match e.transient()? {
        RetryCause::SerializationFailure | RetryCause::Deadlock => Some(409),
        cause if busy(cause) => Some(503),
        _ => None,
    }
}

/// ```
/// use idem::http::{etag::{version_from_etag, IfMatch}, HttpStatus};
/// assert_eq!(IfMatch::parse("v1").unwrap_err().http_status(), 400);
/// assert_eq!(version_from_etag("\"v-1\"").unwrap_err().http_status(), 412);
/// ```
impl HttpStatus for EtagError {
    /// 412 for a tag that can never match, 400 for a malformed header.
    fn http_status(&self) -> u16 {
        self.status()
    }
}
