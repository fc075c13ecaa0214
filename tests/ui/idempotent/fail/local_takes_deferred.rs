use idem::{idempotent, Deferred};

include!("../app_error.rs");

pub struct PaymentCmd {
    pub key: String,
    pub amount: i64,
}

// A local body runs in one transaction with its claim: it takes the connection.
#[idempotent(key = cmd.key, fingerprint(cmd.amount), scope = none)]
async fn pay(db: &mut Deferred<'_>, cmd: &PaymentCmd) -> Result<i64, AppError> {
    let _ = db;
    Ok(cmd.amount)
}

fn main() {}
