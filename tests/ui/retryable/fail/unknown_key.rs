use diesel_async::AsyncPgConnection;
use idem::retryable;

include!("../app_error.rs");

// A misspelt key must not be silently ignored.
#[retryable(max = 4, dealine_ms = 800)]
async fn transfer(conn: &mut AsyncPgConnection) -> Result<(), AppError> {
    let _ = conn;
    Ok(())
}

fn main() {}
