#![deny(warnings)]

use diesel_async::AsyncPgConnection;
use idem::{retryable, Pool};

include!("../app_error_pub.rs");

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
