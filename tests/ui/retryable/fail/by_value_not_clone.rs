use diesel_async::AsyncPgConnection;
use idem::retryable;

include!("../app_error.rs");

// Not Clone: the second attempt would have nothing to work with.
struct Command {
    amount: i64,
}

#[retryable]
async fn transfer(conn: &mut AsyncPgConnection, cmd: Command) -> Result<i64, AppError> {
    let _ = conn;
    Ok(cmd.amount)
}

fn main() {}
