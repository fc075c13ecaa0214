#![deny(warnings)]

use diesel_async::AsyncPgConnection;
use idem::{idempotent, retryable, Pool};

include!("../app_error.rs");

/// `mut conn`, reborrowed in the body, and `mut amount`, changed in it,
/// under both attributes: each binding keeps its `mut`.
#[idempotent(key = key, scope = none, fingerprint(amount))]
#[retryable(max = 3)]
async fn keyed(mut conn: &mut AsyncPgConnection, key: &str, mut amount: i64) -> Result<i64, AppError> {
    let again = &mut conn;
    let _ = again;
    amount += 1;
    Ok(amount)
}

async fn callers(pool: &Pool) -> Result<i64, AppError> {
    Ok(keyed(pool, "k", 2).await?.value)
}

fn main() {
    let _ = callers;
}
