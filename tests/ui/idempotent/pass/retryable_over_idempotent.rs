#![deny(warnings)]

use diesel_async::AsyncPgConnection;
use idem::{
    idempotent, retryable, IdempotencyError, Idempotent, IdempotentError, NoFinalErrors, Pool, RetryCause,
    RetryError, Transient,
};

#[derive(Debug)]
pub enum AppError {
    Db(diesel::result::Error),
    Idem(IdempotencyError),
    Retry(RetryError),
}

impl From<diesel::result::Error> for AppError {
    fn from(e: diesel::result::Error) -> Self {
        AppError::Db(e)
    }
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

impl IdempotentError for AppError {
    type Final = NoFinalErrors;
    fn to_final(&self) -> Option<NoFinalErrors> {
        None
    }
    fn from_final(never: NoFinalErrors) -> Self {
        match never {}
    }
}

pub struct PaymentCmd {
    pub key: String,
    pub amount: i64,
    pub currency: String,
}

// The other order means the same, and the imported `idempotent` counts as used
// (regression: #[retryable] re-emitted it as `::idem::idempotent`).
#[retryable(max = 4, deadline_ms = 800)]
#[idempotent(key = cmd.key, fingerprint(cmd.amount, cmd.currency))]
async fn pay(conn: &mut AsyncPgConnection, cmd: &PaymentCmd) -> Result<i64, AppError> {
    let _ = conn;
    Ok(cmd.amount)
}

async fn caller(pool: &Pool, cmd: &PaymentCmd) -> Result<Idempotent<i64>, AppError> {
    pay(pool, cmd).await
}

fn main() {
    let _ = caller;
}
