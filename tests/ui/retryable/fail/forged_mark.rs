use diesel_async::AsyncPgConnection;
use idem::retryable;

include!("../app_error.rs");

// The mark #[retryable] leaves when it hands a function to #[idempotent],
// written by hand: refused, and the rest expands as without it.
#[retryable(__idem_handed_off, max = 3)]
async fn transfer(conn: &mut AsyncPgConnection) -> Result<(), AppError> {
    let _ = conn;
    Ok(())
}

fn main() {}
