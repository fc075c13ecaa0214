use diesel_async::AsyncPgConnection;
use idem::retryable;

include!("../app_error.rs");

// A `&mut` would carry one attempt's changes into the next.
#[retryable]
async fn transfer(conn: &mut AsyncPgConnection, log: &mut Vec<String>) -> Result<(), AppError> {
    let _ = conn;
    log.push("transferred".to_owned());
    Ok(())
}

fn main() {}
