#![deny(warnings)]

use diesel_async::AsyncPgConnection;
use idem::{idempotent, retryable, Idempotent, Pool};

include!("../app_error.rs");

pub struct PaymentCmd {
    pub key: String,
    pub amount: i64,
    pub currency: String,
}

// The documented order: #[idempotent] outside, #[retryable] inside.
#[idempotent(key = cmd.key, fingerprint(cmd.amount, cmd.currency), scope = none)]
#[retryable(max = 4, deadline_ms = 800)]
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
