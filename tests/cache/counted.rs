//! A retry storm counted by the database: transactions in
//! `pg_stat_database`, read from another database once the test database's
//! backends exited (they flush their counters at the latest then).

use super::*;

/// `xact_commit + xact_rollback` of database `name` once it has no backend
/// and the counters stopped moving.
async fn settled_transactions(admin: &tokio_postgres::Client, name: &str) -> i64 {
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let connected: i64 = admin
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = $1",
                &[&name],
            )
            .await
            .unwrap()
            .get(0);
        if connected == 0 {
            break;
        }
        assert!(Instant::now() < until, "backends of {name} did not exit");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let read = || async {
        admin
            .batch_execute("SELECT pg_stat_clear_snapshot()")
            .await
            .unwrap();
        admin
            .query_one(
                "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = $1",
                &[&name],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
    };
    let mut last = read().await;
    let mut stable = 0;
    while stable < 5 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = read().await;
        if now == last {
            stable += 1;
        } else {
            (last, stable) = (now, 0);
        }
    }
    last
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
    let db = TestDatabase::create().await.expect("a test database");
    {
        let mut conn = AsyncPgConnection::establish(db.url())
            .await
            .expect("connect");
        idem::migrate(&mut conn).await.expect("migrate");
        conn.batch_execute(SCHEMA).await.expect("schema");
    }
    let server_url = tokio::task::spawn_blocking(idem_testing::server_url)
        .await
        .unwrap()
        .expect("the server");
    let admin = idem_testing::connect(&server_url).await.expect("admin");
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
