#![deny(warnings)]

use diesel_async::AsyncPgConnection;
use idem::{idempotent, Idempotent, Pool};

include!("../app_error.rs");

pub struct PaymentCmd {
    pub key: String,
    pub amount: i64,
    pub currency: String,
}

// No `key =`: the key is derived from scope, operation and fingerprint; no
// `fingerprint(..)`: every parameter is in it, `serde_json::Value` too.
#[idempotent(scope = who)]
async fn tool(
    conn: &mut AsyncPgConnection,
    who: &str,
    args: &serde_json::Value,
) -> Result<usize, AppError> {
    let _ = conn;
    Ok(args.to_string().len())
}

// A fingerprint list without a key, and an explicit operation name.
#[idempotent(operation = "tools.search", fingerprint(query, limit), scope = none)]
async fn search(
    conn: &mut AsyncPgConnection,
    query: String,
    limit: u32,
) -> Result<Vec<String>, AppError> {
    let _ = conn;
    Ok(vec![query; limit as usize])
}

async fn caller(pool: &Pool) -> Result<(Idempotent<usize>, Idempotent<Vec<String>>), AppError> {
    let a = tool(pool, "agent-1", &serde_json::json!({"a": 1})).await?;
    let b = search(pool, "idem".to_owned(), 2).await?;
    Ok((a, b))
}

fn main() {
    let _ = caller;
}
