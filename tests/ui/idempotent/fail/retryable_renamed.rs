use diesel_async::AsyncPgConnection;
use idem::idempotent;
use idem::retryable as retry;

include!("../app_error.rs");

pub struct PaymentCmd {
    pub key: String,
    pub amount: i64,
}

// `#[retryable]` renamed on import, below `#[idempotent]`, which finds it
// only by a path ending in `retryable`: one error, at the renamed attribute.
#[idempotent(key = cmd.key, scope = "payments", fingerprint(cmd.amount))]
#[retry(max = 3)]
async fn pay(conn: &mut AsyncPgConnection, cmd: &PaymentCmd) -> Result<i64, AppError> {
    let _ = conn;
    Ok(cmd.amount)
}

fn main() {}
