use diesel_async::AsyncPgConnection;
use idem::idempotent;

include!("../app_error.rs");

pub struct RefundCmd {
    pub key: String,
    pub order: String,
}

// External mode runs the outside call with no transaction open: the body
// takes the deferred handle, not a connection.
#[idempotent(key = cmd.key, fingerprint(cmd.order), mode = external, scope = none)]
async fn refund(conn: &mut AsyncPgConnection, cmd: &RefundCmd) -> Result<String, AppError> {
    let _ = conn;
    Ok(cmd.order.clone())
}

fn main() {}
