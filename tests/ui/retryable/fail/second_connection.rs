use diesel_async::AsyncPgConnection;
use idem::retryable;

include!("../app_error.rs");

// A second connection: one error, at it, saying so.
#[retryable(max = 3)]
async fn two(conn: &mut AsyncPgConnection, other: &mut AsyncPgConnection) -> Result<(), AppError> {
    let _ = (conn, other);
    Ok(())
}

// A connection without a name: one error, at it (not a second one at the
// next parameter).
#[retryable(max = 3)]
async fn unnamed(_: &mut AsyncPgConnection, amount: i64) -> Result<i64, AppError> {
    Ok(amount)
}

fn main() {}
