#![deny(warnings)]

use diesel_async::AsyncPgConnection;
use idem::{retryable, Pool};

include!("../app_error_pub.rs");

/// Each attempt gets its own clone of a by-value argument.
#[derive(Clone)]
struct Transfer {
    from: i64,
    to: i64,
    amount: i64,
}

#[retryable]
async fn transfer(
    conn: &mut AsyncPgConnection,
    cmd: Transfer,
    note: String,
) -> Result<i64, AppError> {
    let _ = conn;
    let Transfer { from, to, amount } = cmd;
    drop(note);
    Ok(from + to + amount)
}

async fn callers(pool: &Pool) -> Result<i64, AppError> {
    let cmd = Transfer {
        from: 1,
        to: 2,
        amount: 3,
    };
    transfer(pool, cmd, "rent".to_owned()).await
}

fn main() {
    let _ = callers;
}
