use diesel_async::AsyncPgConnection;
use idem::idempotent as once;
use idem::retryable;

include!("../app_error.rs");

pub struct PaymentCmd {
    pub key: String,
    pub amount: i64,
}

// `#[idempotent]` renamed on import, below `#[retryable]`, which finds it
// only by a path ending in `idempotent`: one error, at the renamed attribute.
#[retryable(max = 3)]
#[once(key = cmd.key, scope = "payments", fingerprint(cmd.amount))]
async fn pay(conn: &mut AsyncPgConnection, cmd: &PaymentCmd) -> Result<i64, AppError> {
    let _ = conn;
    Ok(cmd.amount)
}

fn main() {}
