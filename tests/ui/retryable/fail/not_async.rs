use diesel_async::AsyncPgConnection;
use idem::retryable;

include!("../app_error.rs");

// Each attempt awaits the database: a blocking fn cannot be one.
#[retryable]
fn transfer(conn: &mut AsyncPgConnection) -> Result<(), AppError> {
    let _ = conn;
    Ok(())
}

fn main() {}
