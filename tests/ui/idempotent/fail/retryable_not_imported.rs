use diesel_async::AsyncPgConnection;
use idem::idempotent;

include!("../app_error.rs");

pub struct PaymentCmd {
    pub key: String,
    pub amount: i64,
}

// `#[retryable]` under `#[idempotent]` without `use idem::retryable;`:
// `#[idempotent]` reads its settings, and the missing import is reported at
// the user's `retryable` (not over the whole `#[idempotent]` attribute).
#[idempotent(key = cmd.key, scope = "payments", fingerprint(cmd.amount))]
#[retryable(max = 3)]
async fn pay(conn: &mut AsyncPgConnection, cmd: &PaymentCmd) -> Result<i64, AppError> {
    let _ = conn;
    Ok(cmd.amount)
}

fn main() {}
