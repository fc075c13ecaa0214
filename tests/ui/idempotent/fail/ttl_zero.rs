use diesel_async::AsyncPgConnection;
use idem::idempotent;

include!("../app_error.rs");

pub struct PaymentCmd {
    pub key: String,
    pub amount: i64,
    pub currency: String,
}

// A record that expires at once would replay nothing.
#[idempotent(key = cmd.key, fingerprint(cmd.amount), ttl_s = 0, scope = none)]
async fn pay(conn: &mut AsyncPgConnection, cmd: &PaymentCmd) -> Result<i64, AppError> {
    let _ = conn;
    Ok(cmd.amount)
}

fn main() {}
