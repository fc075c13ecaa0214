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

pub struct Ctx {
    pub tenant_id: i64,
    pub user_id: i64,
    // Not Copy: the scope tuple borrows it (regression: `(ctx.tenant_id,
    // ctx.conversation)` tried to move the String out of `&Ctx`).
    pub conversation: String,
}

// A key space per (tenant, user); a by-value parameter used only in the scope.
#[idempotent(key = cmd.key, scope = (ctx.tenant_id, ctx.user_id, ctx.conversation, region), fingerprint(cmd.amount, cmd.currency))]
async fn pay(
    conn: &mut AsyncPgConnection,
    ctx: &Ctx,
    region: u8,
    cmd: &PaymentCmd,
) -> Result<i64, AppError> {
    let _ = conn;
    Ok(ctx.tenant_id + cmd.amount)
}

async fn caller(pool: &Pool, cmd: &PaymentCmd) -> Result<Idempotent<i64>, AppError> {
    pay(
        pool,
        &Ctx {
            tenant_id: 1,
            user_id: 2,
            conversation: "c-1".to_owned(),
        },
        3,
        cmd,
    )
    .await
}

fn main() {
    let _ = caller;
}
