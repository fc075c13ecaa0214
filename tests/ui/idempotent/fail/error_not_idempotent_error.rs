use diesel_async::AsyncPgConnection;
use idem::{idempotent, IdempotencyError, RetryCause, RetryError, Transient};

// Transient, but it does not say which of its errors are final.
#[derive(Debug)]
pub enum AppError {
    Db(diesel::result::Error),
    Idem(IdempotencyError),
    Retry(RetryError),
}

impl From<IdempotencyError> for AppError {
    fn from(e: IdempotencyError) -> Self {
        AppError::Idem(e)
    }
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
            AppError::Idem(e) => e.transient(),
            AppError::Retry(_) => None,
        }
    }
}

pub struct PaymentCmd {
    pub key: String,
    pub amount: i64,
}

#[idempotent(key = cmd.key, fingerprint(cmd.amount))]
async fn pay(conn: &mut AsyncPgConnection, cmd: &PaymentCmd) -> Result<i64, AppError> {
    let _ = conn;
    Ok(cmd.amount)
}

fn main() {}
