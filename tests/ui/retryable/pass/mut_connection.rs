#![deny(warnings)]

use diesel_async::AsyncPgConnection;
use idem::{retryable, Pool};

include!("../app_error_pub.rs");

/// `mut conn`, reborrowed in the body: the binding keeps its `mut`.
#[retryable(max = 3)]
async fn plain(mut conn: &mut AsyncPgConnection, amount: i64) -> Result<i64, AppError> {
    let again = &mut conn;
    let _ = again;
    Ok(amount)
}

/// `mut` on a by-value argument: each attempt's own clone is mutable.
#[retryable(max = 3)]
async fn counted(conn: &mut AsyncPgConnection, mut times: i64) -> Result<i64, AppError> {
    let _ = conn;
    times += 1;
    Ok(times)
}

struct Ledger {
    fee: i64,
}

impl Ledger {
    /// `self: &Self` is `&self` written out.
    #[retryable(max = 3)]
    async fn charge(self: &Self, conn: &mut AsyncPgConnection, amount: i64) -> Result<i64, AppError> {
        let _ = conn;
        Ok(amount + self.fee)
    }
}

async fn callers(pool: &Pool) -> Result<i64, AppError> {
    let ledger = Ledger { fee: 1 };
    let a = plain(pool, 1).await?;
    let c = ledger.charge(pool, 100).await?;
    let d = counted(pool, 1).await?;
    Ok(a + c + d)
}

fn main() {
    let _ = callers;
}
