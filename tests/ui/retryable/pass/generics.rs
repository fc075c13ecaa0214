#![deny(warnings)]

use diesel_async::AsyncPgConnection;
use idem::{retryable, Pool};

include!("../app_error_pub.rs");

use std::fmt::Display;

/// Type and lifetime parameters, a where clause and `impl Trait` arguments.
#[retryable]
async fn describe<'a, T>(
    conn: &mut AsyncPgConnection,
    label: &'a str,
    value: T,
    extra: impl Clone + Display + Send,
) -> Result<String, AppError>
where
    T: Clone + Display + Send + Sync,
{
    let _ = conn;
    Ok(format!("{label}: {value} {extra}"))
}

async fn callers(pool: &Pool) -> Result<String, AppError> {
    describe(pool, "n", 4_u8, "units").await?;
    describe(pool, "s", String::from("x"), 1.5).await
}

fn main() {
    let _ = callers;
}
