//! The code under test's pool for a test database, shared by the test
//! binaries that include this file (`#[path = "../support/pool.rs"] mod
//! test_pool;`): idem's pool on the database's `pool_url`, set up for
//! transaction pooling when the database is reached through PgBouncer
//! (`IDEM_TEST_VIA=pgbouncer`).

// Each binary uses what it needs of this file.
#![allow(dead_code)]

use std::time::Duration;

use idem::pool::{build_pool_with, PoolConfig, Pooler};
use idem::Pool;
use idem_testing::TestDatabase;

/// How `db`'s pool URL reaches the server, as idem's pool must be told.
pub fn pooler(db: &TestDatabase) -> Pooler {
    if db.via().is_transaction_pooling() {
        Pooler::TransactionPooling
    } else {
        Pooler::Direct
    }
}

/// A pool of at most `max_size` connections to `db`'s pool URL, whose
/// checkouts wait at most `wait`.
pub fn test_pool(db: &TestDatabase, max_size: usize, wait: Duration) -> Pool {
    build_pool_with(
        db.pool_url(),
        &PoolConfig {
            max_size,
            wait_timeout: wait,
            pooler: pooler(db),
            ..PoolConfig::default()
        },
    )
    .expect("build the pool of the code under test")
}
