#![deny(warnings)]

use diesel_async::AsyncPgConnection;
use idem::{retryable, Pool, RetryCause, RetryError, Transient};

#[derive(Debug)]
pub enum AppError {
    Db(diesel::result::Error),
    Retry(RetryError),
}

impl From<RetryError> for AppError {
    fn from(e: RetryError) -> Self {
        AppError::Retry(e)
    }
}

impl From<diesel::result::Error> for AppError {
    fn from(e: diesel::result::Error) -> Self {
        AppError::Db(e)
    }
}

impl Transient for AppError {
    fn transient(&self) -> Option<RetryCause> {
        match self {
            AppError::Db(e) => e.transient(),
            AppError::Retry(_) => None,
        }
    }
}

use std::time::Duration;

use idem::{Isolation, OnConflict, RetryPolicy};

const TRANSFERS: RetryPolicy = RetryPolicy::new()
    .max_attempts(5)
    .deadline(Duration::from_millis(500))
    .isolation(Isolation::Serializable);

/// A shared policy, with one setting overridden for this function.
#[retryable(policy = TRANSFERS, max = 8, on_conflict = lock)]
async fn transfer(conn: &mut AsyncPgConnection) -> Result<(), AppError> {
    let _ = conn;
    Ok(())
}

/// Any expression of type `RetryPolicy` will do.
#[retryable(policy = RetryPolicy::new().on_conflict(OnConflict::Lock), retry_lock_not_available = true)]
async fn audit(conn: &mut AsyncPgConnection) -> Result<(), AppError> {
    let _ = conn;
    Ok(())
}

async fn callers(pool: &Pool) -> Result<(), AppError> {
    transfer(pool).await?;
    audit(pool).await
}

fn main() {
    let _ = callers;
}
