use diesel_async::AsyncPgConnection;
use idem::idempotent;

include!("../app_error.rs");

pub struct PaymentCmd {
    pub key: String,
    pub amount: i64,
    pub currency: String,
}

// `amount` is a field of `cmd`, not a parameter: the name must be spelt `cmd.amount`.
#[idempotent(key = cmd.key, fingerprint(amount, cmd.currency), scope = none)]
async fn pay(conn: &mut AsyncPgConnection, cmd: &PaymentCmd) -> Result<i64, AppError> {
    let _ = conn;
    Ok(cmd.amount)
}

fn main() {}
