#![deny(warnings)]

use diesel_async::AsyncPgConnection;
use idem::{retryable, Pool};

include!("../app_error_pub.rs");

/// Documented: the doc comment stays on the function.
///
/// ```ignore
/// transfer(&pool).await?;
/// ```
#[retryable(isolation = repeatable_read, deadline_ms = 900)]
#[cfg(any())]
async fn transfer(conn: &mut AsyncPgConnection) -> Result<u8, AppError> {
    let _ = conn;
    Ok(1)
}

// The `cfg` above was kept, so that function does not exist and this one can
// take its name.
/// The one that is compiled.
#[cfg(all())]
#[retryable(isolation = repeatable_read, deadline_ms = 900)]
#[allow(clippy::needless_return)]
pub async fn transfer(conn: &mut AsyncPgConnection) -> Result<u8, AppError> {
    let _ = conn;
    return Ok(2);
}

async fn callers(pool: &Pool) -> Result<u8, AppError> {
    transfer(pool).await
}

fn main() {
    let _ = callers;
}
