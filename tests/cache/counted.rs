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

/// A storm of cached duplicates costs the database nothing per duplicate:
/// its new pool opens one connection to read the cache's sealing key (the
/// connection's set-up and one read-only transaction), and then 20 or 200
/// duplicates cost the same. The same storm without the cache costs at
/// least one transaction each.
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

    let small = storm(&db, &admin, Some(&cache), "storm-cached", 20).await;
    let large = storm(&db, &admin, Some(&cache), "storm-cached", 200).await;
    let uncached = storm(&db, &admin, None, "storm-db", 50).await;
    assert_eq!(small, large, "nothing per duplicate: {small} then {large}");
    assert!(large <= 8, "one connection's set-up and one read: {large}");
    assert!(uncached >= 50, "{uncached}");
}
