use diesel_async::AsyncPgConnection;
use idem::{idempotent, retryable, Pool};

include!("../../idempotent/app_error.rs");

pub struct PaymentCmd {
    pub key: String,
    pub amount: i64,
}

// The connection after another parameter: one error, at it, and the
// function stands in with the pool where the connection is, so the callers
// written for that order see no error of their own.
#[retryable(max = 3)]
async fn transfer(amount: i64, conn: &mut AsyncPgConnection) -> Result<i64, AppError> {
    let _ = conn;
    Ok(amount)
}

#[idempotent(key = cmd.key, scope = "payments", fingerprint(cmd.amount))]
async fn pay(cmd: &PaymentCmd, conn: &mut AsyncPgConnection) -> Result<i64, AppError> {
    let _ = conn;
    Ok(cmd.amount)
}

async fn callers(pool: &Pool, cmd: &PaymentCmd) -> Result<i64, AppError> {
    let moved = transfer(1, pool).await?;
    let paid = pay(cmd, pool).await?.value;
    Ok(moved + paid)
}

fn main() {
    let _ = callers;
}
