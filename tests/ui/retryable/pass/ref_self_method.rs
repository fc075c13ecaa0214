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

struct Ledger {
    fee: i64,
}

impl Ledger {
    /// A method: `&self` is handed to every attempt again.
    #[retryable(max = 3)]
    async fn charge(&self, conn: &mut AsyncPgConnection, amount: i64) -> Result<i64, AppError> {
        let _ = conn;
        Ok(amount + self.fee)
    }
}

async fn callers(pool: &Pool) -> Result<i64, AppError> {
    let ledger = Ledger { fee: 1 };
    ledger.charge(pool, 100).await
}

fn main() {
    let _ = callers;
}
