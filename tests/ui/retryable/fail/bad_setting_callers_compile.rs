use diesel_async::AsyncPgConnection;
use idem::retryable;

include!("../app_error.rs");

// A wrong setting is one error, at the setting: the function still takes a
// pool, so its callers compile as they will once the setting is fixed.
#[retryable(max = 4, isolation = snapshot)]
async fn transfer(conn: &mut AsyncPgConnection, amount: i64) -> Result<i64, AppError> {
    let _ = conn;
    Ok(amount)
}

async fn caller(pool: &idem::Pool) -> Result<i64, AppError> {
    transfer(pool, 5).await
}

fn main() {
    let _ = caller;
}
