use diesel_async::AsyncPgConnection;
use idem::idempotent;

include!("../app_error.rs");

pub struct PaymentCmd {
    pub key: String,
    pub amount: i64,
}

// A wrong setting is one error, at the setting: the function still takes a
// pool and answers an `Idempotent<T>`, so its callers compile as they will
// once the setting is fixed.
#[idempotent(key = cmd.key, fingerprint(cmd.amount), mode = remote, scope = none)]
async fn pay(conn: &mut AsyncPgConnection, cmd: &PaymentCmd) -> Result<i64, AppError> {
    let _ = conn;
    Ok(cmd.amount)
}

async fn caller(pool: &idem::Pool, cmd: &PaymentCmd) -> Result<i64, AppError> {
    let paid = pay(pool, cmd).await?;
    Ok(paid.value + i64::from(paid.replayed))
}

fn main() {
    let _ = caller;
}
