use diesel_async::AsyncPgConnection;
use idem::retryable;

include!("../app_error.rs");

#[retryable(on_conflict = wait)]
async fn transfer(conn: &mut AsyncPgConnection) -> Result<(), AppError> {
    let _ = conn;
    Ok(())
}

fn main() {}
