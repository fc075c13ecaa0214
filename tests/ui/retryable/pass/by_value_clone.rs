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

/// Each attempt gets its own clone of a by-value argument.
#[derive(Clone)]
struct Transfer {
    from: i64,
    to: i64,
    amount: i64,
}

#[retryable]
async fn transfer(
    conn: &mut AsyncPgConnection,
    cmd: Transfer,
    note: String,
) -> Result<i64, AppError> {
    let _ = conn;
    let Transfer { from, to, amount } = cmd;
    drop(note);
    Ok(from + to + amount)
}

async fn callers(pool: &Pool) -> Result<i64, AppError> {
    let cmd = Transfer {
        from: 1,
        to: 2,
        amount: 3,
    };
    transfer(pool, cmd, "rent".to_owned()).await
}

fn main() {
    let _ = callers;
}
