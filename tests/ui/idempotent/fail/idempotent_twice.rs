use diesel_async::AsyncPgConnection;
use idem::idempotent;

include!("../app_error.rs");

pub struct PaymentCmd {
    pub key: String,
    pub amount: i64,
}

// `#[idempotent]` written twice: one error, at the second.
#[idempotent(key = cmd.key, scope = "payments", fingerprint(cmd.amount))]
#[idempotent(key = cmd.key, scope = "payments", fingerprint(cmd.amount))]
async fn pay(conn: &mut AsyncPgConnection, cmd: &PaymentCmd) -> Result<i64, AppError> {
    let _ = conn;
    Ok(cmd.amount)
}

fn main() {}
