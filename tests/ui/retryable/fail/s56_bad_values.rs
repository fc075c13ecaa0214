//! Values of the right key but the wrong kind: each error points at the
//! value the user wrote.
use diesel_async::AsyncPgConnection;
use idem::retryable;

include!("../app_error.rs");

#[retryable(max = -1)]
async fn negative_max(conn: &mut AsyncPgConnection) -> Result<(), AppError> {
    let _ = conn;
    Ok(())
}

#[retryable(max = 2.5)]
async fn fractional_max(conn: &mut AsyncPgConnection) -> Result<(), AppError> {
    let _ = conn;
    Ok(())
}

#[retryable(deadline_ms = 0)]
async fn zero_deadline(conn: &mut AsyncPgConnection) -> Result<(), AppError> {
    let _ = conn;
    Ok(())
}

#[retryable(deadline_ms = "800")]
async fn quoted_deadline(conn: &mut AsyncPgConnection) -> Result<(), AppError> {
    let _ = conn;
    Ok(())
}

#[retryable(commit_timeout_ms = 0)]
async fn zero_commit_timeout(conn: &mut AsyncPgConnection) -> Result<(), AppError> {
    let _ = conn;
    Ok(())
}

#[retryable(retry_lock_not_available = 1)]
async fn numeric_flag(conn: &mut AsyncPgConnection) -> Result<(), AppError> {
    let _ = conn;
    Ok(())
}

#[retryable(policy = 5)]
async fn policy_not_a_policy(conn: &mut AsyncPgConnection) -> Result<(), AppError> {
    let _ = conn;
    Ok(())
}

fn main() {}

#[retryable(max = 99999999999)]
async fn max_too_large(conn: &mut AsyncPgConnection) -> Result<(), AppError> {
    let _ = conn;
    Ok(())
}

#[retryable(max)]
async fn key_without_value(conn: &mut AsyncPgConnection) -> Result<(), AppError> {
    let _ = conn;
    Ok(())
}
