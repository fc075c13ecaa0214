use diesel_async::AsyncPgConnection;
use idem::retryable;

include!("../app_error.rs");

#[retryable(max = 4, deadline_ms = 800, max = 6)]
async fn transfer(conn: &mut AsyncPgConnection) -> Result<(), AppError> {
    let _ = conn;
    Ok(())
}

fn main() {}
