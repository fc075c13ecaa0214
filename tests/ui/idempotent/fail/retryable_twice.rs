use diesel_async::AsyncPgConnection;
use idem::{idempotent, retryable};

include!("../app_error.rs");

pub struct PaymentCmd {
    pub key: String,
    pub amount: i64,
}

// `#[retryable]` twice with `#[idempotent]`, in two orders: one error each,
// at the second `#[retryable]` (not a word about renaming it).
#[idempotent(key = cmd.key, scope = "payments", fingerprint(cmd.amount))]
#[retryable(max = 3)]
#[retryable(max = 2)]
async fn below(conn: &mut AsyncPgConnection, cmd: &PaymentCmd) -> Result<i64, AppError> {
    let _ = conn;
    Ok(cmd.amount)
}

#[retryable(max = 3)]
#[idempotent(key = cmd.key, scope = "payments", fingerprint(cmd.amount))]
#[retryable(max = 2)]
async fn around(conn: &mut AsyncPgConnection, cmd: &PaymentCmd) -> Result<i64, AppError> {
    let _ = conn;
    Ok(cmd.amount)
}

fn main() {}
