use diesel_async::AsyncPgConnection;
use idem::idempotent;

include!("../app_error.rs");

pub struct PaymentCmd {
    pub key: String,
    pub amount: i64,
}

// The connection in `key = ..` or `scope = ..`: one error each, at it.
#[idempotent(key = conn.key, scope = "payments", fingerprint(cmd.amount))]
async fn in_key(conn: &mut AsyncPgConnection, cmd: &PaymentCmd) -> Result<i64, AppError> {
    let _ = conn;
    Ok(cmd.amount)
}

#[idempotent(key = cmd.key, scope = (conn, 1), fingerprint(cmd.amount))]
async fn in_scope(conn: &mut AsyncPgConnection, cmd: &PaymentCmd) -> Result<i64, AppError> {
    let _ = conn;
    Ok(cmd.amount)
}

fn main() {}
