use diesel_async::AsyncPgConnection;
use idem::{
    idempotent, IdempotencyError, IdempotentError, NoFinalErrors, RetryCause, RetryError, Transient,
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

// The stored response is the `T` of a `Result<T, E>`.
#[idempotent(key = cmd.key, fingerprint(cmd.amount))]
async fn pay(conn: &mut AsyncPgConnection, cmd: &PaymentCmd) -> Option<i64> {
    let _ = conn;
    Some(cmd.amount)
}

#[idempotent(key = cmd.key, fingerprint(cmd.amount))]
async fn pay_plain(conn: &mut AsyncPgConnection, cmd: &PaymentCmd) -> i64 {
    let _ = conn;
    cmd.amount
}

// An alias that is no `Result` is caught by the type check.
type Amount = i64;

#[idempotent(key = cmd.key, fingerprint(cmd.amount))]
async fn pay_alias(conn: &mut AsyncPgConnection, cmd: &PaymentCmd) -> Amount {
    let _ = conn;
    cmd.amount
}

#[idempotent(key = cmd.key, fingerprint(cmd.amount))]
async fn pay_nothing(conn: &mut AsyncPgConnection, cmd: &PaymentCmd) {
    let _ = (conn, cmd);
}

fn main() {}
