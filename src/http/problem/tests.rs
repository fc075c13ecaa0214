//! The statuses and bodies of `Problem`, per idem error.
use std::time::Duration;

use diesel::result::{DatabaseErrorKind, Error as DieselError};

use super::*;
use crate::RetryCause;

#[test]
fn statuses_follow_the_table() {
    let cases: Vec<(Problem, u16, &str)> = vec![
        (
            Error::MissingKey.into(),
            400,
            problem_type::IDEMPOTENCY_KEY_MISSING,
        ),
        (
            Error::InvalidKey {
                reason: "it is empty",
            }
            .into(),
            400,
            problem_type::IDEMPOTENCY_KEY_INVALID,
        ),
        (
            Error::FingerprintMismatch.into(),
            422,
            problem_type::FINGERPRINT_MISMATCH,
        ),
        (Error::InProgress.into(), 409, problem_type::IN_PROGRESS),
        (
            Error::OutcomeUnknown.into(),
            502,
            problem_type::OUTCOME_UNKNOWN,
        ),
        (
            Error::Exhausted {
                attempts: 4,
                elapsed: Duration::from_millis(800),
                last_cause: RetryCause::Stale,
            }
            .into(),
            409,
            problem_type::RETRIES_EXHAUSTED,
        ),
        (
            Error::Exhausted {
                attempts: 2,
                elapsed: Duration::from_millis(800),
                last_cause: RetryCause::LockTimeout,
            }
            .into(),
            503,
            problem_type::UNAVAILABLE,
        ),
        (
            Error::Exhausted {
                attempts: 3,
                elapsed: Duration::from_millis(80),
                last_cause: RetryCause::LockNotAvailable,
            }
            .into(),
            503,
            problem_type::UNAVAILABLE,
        ),
        (
            Error::CommitUnknown {
                attempts: 1,
                elapsed: Duration::ZERO,
            }
            .into(),
            503,
            problem_type::COMMIT_OUTCOME_UNKNOWN,
        ),
        (
            VersionedError::Stale {
                expected: 1,
                actual: 2,
            }
            .into(),
            412,
            problem_type::PRECONDITION_FAILED,
        ),
        (
            VersionedError::NotFound.into(),
            404,
            problem_type::NOT_FOUND,
        ),
        (
            EtagError::Weak {
                tag: "W/\"v1\"".into(),
            }
            .into(),
            412,
            problem_type::PRECONDITION_FAILED,
        ),
        (EtagError::Empty.into(), 400, problem_type::IF_MATCH_INVALID),
        (Error::RolledBack.into(), 500, problem_type::INTERNAL),
    ];
    for (problem, status, type_uri) in cases {
        assert_eq!(problem.status().as_u16(), status, "{problem}");
        assert_eq!(problem.type_uri(), type_uri, "{problem}");
        let response = problem.into_response();
        assert_eq!(response.status().as_u16(), status);
        assert_eq!(response.headers()[CONTENT_TYPE], super::super::PROBLEM_JSON);
    }
}

#[test]
fn commit_unknown_says_retry_with_the_same_key() {
    let p = Problem::from(Error::CommitUnknown {
        attempts: 1,
        elapsed: Duration::ZERO,
    });
    assert!(p.detail().contains("same Idempotency-Key"), "{p}");
    let o = Problem::from(Error::OutcomeUnknown);
    assert!(o.detail().contains("may have reached"), "{o}");
}

/// A repeat of a request whose caller hung up mid outside call also gets
/// `InProgress` until the claim's lease runs out: the text must not promise
/// that the first request is still running.
#[test]
fn in_progress_says_the_first_may_have_been_interrupted() {
    let p = Problem::from(Error::InProgress);
    assert!(p.detail().contains("interrupted"), "{p}");
    assert!(!p.detail().contains("being processed"), "{p}");
    let response = p.into_response();
    assert_eq!(response.headers()["retry-after"], "1");
}

fn database(kind: DatabaseErrorKind, message: &str) -> DieselError {
    DieselError::DatabaseError(kind, Box::new(message.to_string()))
}

/// A race lost or a lock refused outside a retry loop is the client's to
/// retry, in each error type that carries a database error; a lost
/// connection (it may have committed) and any other database error stay 500.
#[test]
fn unreplayed_transients_are_409_or_503_in_every_error_type() {
    let cases = [
        (
            DatabaseErrorKind::SerializationFailure,
            "could not serialize access",
            409,
            problem_type::RETRIES_EXHAUSTED,
        ),
        (
            DatabaseErrorKind::Unknown,
            "deadlock detected",
            409,
            problem_type::RETRIES_EXHAUSTED,
        ),
        (
            DatabaseErrorKind::Unknown,
            "could not obtain lock on row in relation \"t\"",
            503,
            problem_type::UNAVAILABLE,
        ),
        (
            DatabaseErrorKind::Unknown,
            "canceling statement due to lock timeout",
            503,
            problem_type::UNAVAILABLE,
        ),
        (
            DatabaseErrorKind::ClosedConnection,
            "server closed the connection",
            500,
            problem_type::INTERNAL,
        ),
        (
            DatabaseErrorKind::UniqueViolation,
            "duplicate key",
            500,
            problem_type::INTERNAL,
        ),
        (
            DatabaseErrorKind::Unknown,
            "division by zero",
            500,
            problem_type::INTERNAL,
        ),
    ];
    for (kind, message, status, type_uri) in cases {
        let problems = [
            Problem::from(Error::Database(database(kind, message))),
            Problem::from(VersionedError::Database(database(kind, message))),
            Problem::from(CreateOnceError::Database(database(kind, message))),
        ];
        for p in problems {
            assert_eq!(p.status().as_u16(), status, "{message}: {p}");
            assert_eq!(p.type_uri(), type_uri, "{message}: {p}");
            assert!(!p.detail().contains(message), "no SQL detail is sent: {p}");
            let retry_after = p.into_response().headers().get("retry-after").cloned();
            assert_eq!(retry_after.is_some(), status == 503, "{message}");
        }
    }
    assert_eq!(
        VersionedError::Database(database(DatabaseErrorKind::SerializationFailure, ""))
            .http_status(),
        409
    );
}

#[test]
fn round_trips_through_json() {
    let p = Problem::from(VersionedError::Stale {
        expected: 3,
        actual: 5,
    });
    let json = serde_json::to_value(&p).unwrap();
    assert_eq!(json["current_etag"], "\"v5\"");
    assert_eq!(json["status"], 412);
    let back: Problem = serde_json::from_value(json).unwrap();
    assert_eq!(back, p);
}
