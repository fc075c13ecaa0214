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

/// Documented: the doc comment stays on the function.
///
/// ```ignore
/// transfer(&pool).await?;
/// ```
#[retryable(isolation = repeatable_read, deadline_ms = 900)]
#[cfg(any())]
async fn transfer(conn: &mut AsyncPgConnection) -> Result<u8, AppError> {
    let _ = conn;
    Ok(1)
}

// The `cfg` above was kept, so that function does not exist and this one can
// take its name.
/// The one that is compiled.
#[cfg(all())]
#[retryable(isolation = repeatable_read, deadline_ms = 900)]
#[allow(clippy::needless_return)]
pub async fn transfer(conn: &mut AsyncPgConnection) -> Result<u8, AppError> {
    let _ = conn;
    return Ok(2);
}

async fn callers(pool: &Pool) -> Result<u8, AppError> {
    transfer(pool).await
}

fn main() {
    let _ = callers;
}
