use diesel_async::AsyncPgConnection;
use idem::retryable;

// The function's error type has no room for idem's own failures (a budget
// that ran out, a commit whose outcome is unknown).
#[derive(Debug)]
enum AppError {
    Db(diesel::result::Error),
}

#[retryable]
async fn transfer(conn: &mut AsyncPgConnection) -> Result<(), AppError> {
    let _ = conn;
    Ok(())
}

fn main() {}
