use diesel_async::AsyncPgConnection;
use idem::retryable;

include!("../app_error.rs");

// Written twice: one error, at the second, which meets the function the
// first expanded.
#[retryable(max = 3)]
#[retryable(max = 2)]
async fn transfer(conn: &mut AsyncPgConnection) -> Result<(), AppError> {
    let _ = conn;
    Ok(())
}

fn main() {}
