use diesel_async::AsyncPgConnection;
use idem::retryable;

include!("../app_error.rs");

// The connection must come first: callers pass the pool in its place.
#[retryable]
async fn transfer(amount: i64, conn: &mut AsyncPgConnection) -> Result<i64, AppError> {
    let _ = conn;
    Ok(amount)
}

fn main() {}
