//! The one table that decides the HTTP status of each of idem's outcomes.
//! [`Problem`](super::Problem) takes its statuses from here.

use crate::{CreateOnceError, Error, VersionedError};

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
    /// 503 when the database is busy (the call's deadline passed) or
    /// unreachable or the commit's outcome is unknown (retry with the same
    /// key), 500 otherwise.
    fn http_status(&self) -> u16 {
        match self {
            Error::InvalidKey { .. } | Error::MissingKey => 400,
            Error::FingerprintMismatch | Error::Unstorable(_) => 422,
            Error::Exhausted { last_cause, .. } if last_cause.is_timeout() => 503,
            Error::Exhausted { .. } | Error::InProgress | Error::ClaimLost => 409,
            Error::OutcomeUnknown => 502,
            Error::CommitUnknown { .. } | Error::Pool(_) => 503,
            _ => 500,
        }
    }
}

impl HttpStatus for VersionedError {
    /// 412 for a stale precondition, 404, 409 for a refused or illegal
    /// transition, 500 otherwise.
    fn http_status(&self) -> u16 {
        match self {
            VersionedError::Stale { .. } => 412,
            VersionedError::NotFound => 404,
            VersionedError::StateMismatch { .. } | VersionedError::IllegalTransition { .. } => 409,
            _ => 500,
        }
    }
}

impl HttpStatus for CreateOnceError {
    /// 422 for a key reused for another request (as for
    /// [`Error::FingerprintMismatch`]), 409 when another row holds one of
    /// the new row's unique values, 400 for a missing key, 500 otherwise (a
    /// missing unique index is the service's fault, not the client's).
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
            _ => 500,
        }
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
