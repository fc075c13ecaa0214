//! A retry storm counted by the database: transactions in
//! `pg_stat_database` ([`idem_testing::stats::settled_transactions`]).

use super::*;

async fn settled_transactions(admin: &tokio_postgres::Client, name: &str) -> i64 {
    idem_testing::stats::settled_transactions(admin, name)
        .await
        .expect("the database's counters")
}

/// Transactions that `duplicates` replays of `key` cost the database, on
/// a pool of their own.
async fn storm(
    db: &TestDatabase,
    admin: &tokio_postgres::Client,
    cache: Option<&ReplayCache>,
    key: &str,
    duplicates: usize,
) -> i64 {
    let before = settled_transactions(admin, db.name()).await;
    {
        let pool = pool_on(db.url());
        for _ in 0..duplicates {
            let answer = pay(&pool, cache, &cmd(key, 10.0)).await.unwrap();
            assert!(answer.replayed);
        }
    }
    settled_transactions(admin, db.name()).await - before
}

/// 50 duplicates of a cached key cost the database no transaction; the
/// same storm without the cache costs at least one each.
#[tokio::test]
async fn a_storm_of_cached_duplicates_costs_the_database_nothing() {
    let db = migrated_database().await;
    let admin = admin().await;
    let cache = shared_cache();
    {
        let pool = pool_on(db.url());
        for key in ["storm-cached", "storm-db"] {
            let first = pay(&pool, Some(&cache), &cmd(key, 10.0)).await.unwrap();
            assert!(!first.replayed);
        }
    }

    let cached = storm(&db, &admin, Some(&cache), "storm-cached", 50).await;
    let uncached = storm(&db, &admin, None, "storm-db", 50).await;
    assert_eq!(cached, 0, "answered from Redis");
    assert!(uncached >= 50, "{uncached}");
}
