//! What the binary's tests share.

use std::process::Command;

use idem_testing::TestDatabase;
use tokio_postgres::Client;

/// Runs the binary with `--database-url url` and `args`, with neither
/// `DATABASE_URL` nor `NATS_URL` from the environment (a NATS URL only as
/// `args` give it); returns the exit code, stdout and stderr.
pub fn idem(url: &str, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .env_remove("DATABASE_URL")
        .env_remove("NATS_URL")
        .arg("--database-url")
        .arg(url)
        .args(args)
        .output()
        .expect("the binary runs");
    (
        out.status.code().expect("exited, not killed"),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// stdout as JSON.
pub fn json(stdout: &str) -> serde_json::Value {
    serde_json::from_str(stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"))
}

/// A fresh, migrated database and a client on it. (Not every test binary
/// that shares this module uses it.)
#[allow(dead_code)]
pub async fn migrated() -> (TestDatabase, Client) {
    let db = TestDatabase::create().await.expect("a database");
    let client = idem_testing::connect(db.url()).await.expect("connect");
    let pool = idem::pool::build_pool(db.url()).expect("pool");
    let mut conn = pool.get().await.expect("conn");
    idem::migrate(&mut conn).await.expect("migrated");
    (db, client)
}

/// The one `bigint` `sql` returns (a `count(*)`).
#[allow(dead_code)]
pub async fn count(client: &Client, sql: &str) -> i64 {
    client
        .query_one(sql, &[])
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .get(0)
}
