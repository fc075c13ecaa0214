#![deny(warnings)]

use diesel_async::AsyncPgConnection;
use idem::{retryable, Pool, RetryCause, RetryError, Transient};

#[derive(Debug)]
pub enum AppError {
    Db(diesel::result::Error),
    Retry(RetryError),
}

impl From<RetryError> for AppError {
    fn from(e: RetryError) -> Self {
        AppError::Retry(e)
    }
}

impl From<diesel::result::Error> for AppError {
    fn from(e: diesel::result::Error) -> Self {
        AppError::Db(e)
    }
}

impl Transient for AppError {
    fn transient(&self) -> Option<RetryCause> {
        match self {
            AppError::Db(e) => e.transient(),
            AppError::Retry(_) => None,
        }
    }
}

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
