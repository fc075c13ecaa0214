#![deny(warnings)]

use diesel_async::AsyncPgConnection;
use idem::{
    idempotent, IdempotencyError, Idempotent, IdempotentError, NoFinalErrors, Pool, RetryCause,
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

pub struct Ledger {
    pub merchant: String,
}

impl Ledger {
    /// A method taking `&self`; `self` is handed to every attempt again and
    /// its fields may be part of the scope.
    #[idempotent(key = cmd.key, scope = self.merchant, fingerprint(cmd.amount, cmd.currency))]
    pub async fn pay(
        &self,
        conn: &mut AsyncPgConnection,
        cmd: &PaymentCmd,
    ) -> Result<String, AppError> {
        let _ = conn;
        Ok(format!("{}:{}", self.merchant, cmd.amount))
    }
}

async fn caller(pool: &Pool, cmd: &PaymentCmd) -> Result<Idempotent<String>, AppError> {
    let ledger = Ledger {
        merchant: "demo".into(),
    };
    ledger.pay(pool, cmd).await
}

fn main() {
    let _ = caller;
}
