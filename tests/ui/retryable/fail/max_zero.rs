use diesel_async::AsyncPgConnection;
use idem::retryable;

include!("../app_error.rs");

#[retryable(max = 0)]
async fn transfer(conn: &mut AsyncPgConnection) -> Result<(), AppError> {
    let _ = conn;
    Ok(())
}

fn main() {}
