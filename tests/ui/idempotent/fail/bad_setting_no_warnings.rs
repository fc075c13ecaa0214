#![deny(warnings)]

use diesel_async::AsyncPgConnection;
use idem::idempotent;

include!("../app_error.rs");

// A wrong setting is one error, also under `deny(warnings)`: the parameters
// that only `key = ..` and `scope = ..` use are not reported as unused.
#[idempotent(key = key, scope = tenant, fingerprint(amount), mode = remote)]
async fn pay(conn: &mut AsyncPgConnection, key: &str, tenant: i64, amount: i64) -> Result<i64, AppError> {
    let _ = conn;
    Ok(amount)
}

fn main() {
    let _ = pay;
}
