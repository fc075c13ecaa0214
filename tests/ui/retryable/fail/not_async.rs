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

// Each attempt awaits the database: a blocking fn cannot be one.
#[retryable]
fn transfer(conn: &mut AsyncPgConnection) -> Result<(), AppError> {
    let _ = conn;
    Ok(())
}

fn main() {}
