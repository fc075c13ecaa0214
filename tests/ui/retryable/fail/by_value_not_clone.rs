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

// Not Clone: the second attempt would have nothing to work with.
struct Command {
    amount: i64,
}

#[retryable]
async fn transfer(conn: &mut AsyncPgConnection, cmd: Command) -> Result<i64, AppError> {
    let _ = conn;
    Ok(cmd.amount)
}

fn main() {}
