#![deny(warnings)]

use diesel_async::AsyncPgConnection;
use idem::{idempotent, Idempotent, Pool};

include!("../app_error.rs");

pub struct PaymentCmd {
    pub key: String,
    pub amount: i64,
    pub currency: String,
}

pub struct Ledger {
    pub merchant: String,
}

impl Ledger {
    /// A method taking `&self`; `self` is handed to every attempt again and
    /// its fields may be part of the scope.
    #[idempotent(key = cmd.key, scope = self.merchant, fingerprint(cmd.amount, cmd.currency))]
    pub async fn pay(
        &self,
        conn: &mut AsyncPgConnection,
        cmd: &PaymentCmd,
    ) -> Result<String, AppError> {
        let _ = conn;
        Ok(format!("{}:{}", self.merchant, cmd.amount))
    }
}

async fn caller(pool: &Pool, cmd: &PaymentCmd) -> Result<Idempotent<String>, AppError> {
    let ledger = Ledger {
        merchant: "demo".into(),
    };
    ledger.pay(pool, cmd).await
}

fn main() {
    let _ = caller;
}
