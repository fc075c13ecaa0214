use diesel_async::AsyncPgConnection;
use idem::{retryable, RetryCause, RetryError, Transient};

#[derive(Debug)]
enum AppError {
    Db(diesel::result::Error),
    Retry(RetryError),
}

impl From<RetryError> for AppError {
    fn from(e: RetryError) -> Self {
        AppError::Retry(e)
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

// The connection must come first: callers pass the pool in its place.
#[retryable]
async fn transfer(amount: i64, conn: &mut AsyncPgConnection) -> Result<i64, AppError> {
    let _ = conn;
    Ok(amount)
}

fn main() {}
