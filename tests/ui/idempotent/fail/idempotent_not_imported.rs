use diesel_async::AsyncPgConnection;
use idem::retryable;

include!("../app_error.rs");

pub struct PaymentCmd {
    pub key: String,
    pub amount: i64,
}

// `#[idempotent]` not imported, in either order with `#[retryable]`: rustc's
// own error at `idempotent`, once each (#[retryable] hands the function over
// once, not again and again until the recursion limit).
#[retryable(max = 3)]
#[idempotent(key = cmd.key, scope = "payments", fingerprint(cmd.amount))]
async fn above(conn: &mut AsyncPgConnection, cmd: &PaymentCmd) -> Result<i64, AppError> {
    let _ = conn;
    Ok(cmd.amount)
}

#[idempotent(key = cmd.key, scope = "payments", fingerprint(cmd.amount))]
#[retryable(max = 3)]
async fn below(conn: &mut AsyncPgConnection, cmd: &PaymentCmd) -> Result<i64, AppError> {
    let _ = conn;
    Ok(cmd.amount)
}

fn main() {}
