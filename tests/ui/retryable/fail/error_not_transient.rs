use diesel_async::AsyncPgConnection;
use idem::{retryable, RetryError};

// The loop cannot tell which of these failures are worth replaying.
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

#[retryable]
async fn transfer(conn: &mut AsyncPgConnection) -> Result<(), AppError> {
    let _ = conn;
    Ok(())
}

fn main() {}
