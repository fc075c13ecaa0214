use diesel_async::AsyncPgConnection;
use idem::idempotent;

include!("../app_error.rs");

pub struct PaymentCmd {
    pub key: String,
    pub amount: i64,
}

// The cache is built once per process, not named by its address here.
#[idempotent(key = cmd.key, scope = none, cache = "redis://127.0.0.1:6379")]
async fn pay(conn: &mut AsyncPgConnection, cmd: &PaymentCmd) -> Result<i64, AppError> {
    let _ = conn;
    Ok(cmd.amount)
}

fn main() {}
