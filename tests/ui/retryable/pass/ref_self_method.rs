#![deny(warnings)]

use diesel_async::AsyncPgConnection;
use idem::{retryable, Pool};

include!("../app_error_pub.rs");

struct Ledger {
    fee: i64,
}

impl Ledger {
    /// A method: `&self` is handed to every attempt again.
    #[retryable(max = 3)]
    async fn charge(&self, conn: &mut AsyncPgConnection, amount: i64) -> Result<i64, AppError> {
        let _ = conn;
        Ok(amount + self.fee)
    }
}

async fn callers(pool: &Pool) -> Result<i64, AppError> {
    let ledger = Ledger { fee: 1 };
    ledger.charge(pool, 100).await
}

fn main() {
    let _ = callers;
}
