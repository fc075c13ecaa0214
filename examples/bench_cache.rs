//! A retry storm against an idempotent handler, with and without the Redis
//! front cache (seed 003 §6.4).
//!
//! `cargo run --release --features redis --example bench_cache -- --iterations 10000 --warmup 0`
//!
//! 100 keys are completed once, then `--warmup` + `--iterations` duplicates
//! of them are sent to both contenders, interleaved one by one
//! with a rotating first place, so drift on a shared machine hits both
//! alike:
//!
//! - `cache`: `#[idempotent(.., cache = ..)]` with a `ReplayCache` on Redis;
//! - `nocache`: the same handler without it (the database replays).
//!
//! Each contender has a database of its own, so what the storm cost each is
//! counted by PostgreSQL, never by idem: transactions (`xact_commit +
//! xact_rollback` in `pg_stat_database`, read once the contender's backends
//! exited) and reads of the idempotency record, over every duplicate sent (`idx_scan + seq_scan` of
//! `idem_requests` in `pg_stat_user_tables`). Redis: `REDIS_URL`, else
//! 127.0.0.1:6379, else a throwaway `redis-server`. The last line is
//! machine-readable: `duplicates=.. keys=.. db_queries_cache=..
//! db_queries_nocache=.. db_xacts_cache=.. db_xacts_nocache=..
//! replay_p50_us_cache=.. replay_p50_us_db=.. replay_p99_us_cache=..
//! replay_p99_us_db=..`.

#[path = "common/bench.rs"]
mod bench;
#[path = "common/mod.rs"]
mod common;

use bench::{parse_args, percentile_us};

use std::time::{Duration, Instant};

use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idem::idempotency::{CacheConfig, ReplayCache};
use idem::pool::{build_pool_with, PoolConfig};
use idem::{idempotent, retryable, Pool};
use serde::{Deserialize, Serialize};

const KEYS: usize = 100;
const NAMES: [&str; 2] = ["cache", "nocache"];
/// The contenders' databases, dropped and created afresh.
const DATABASES: [&str; 2] = ["bench_cache_on", "bench_cache_off"];
const SCHEMA: &str = "CREATE TABLE bench_cache_orders (id bigserial PRIMARY KEY, order_key text NOT NULL, amount bigint NOT NULL);";

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Db(#[from] diesel::result::Error),
    #[error(transparent)]
    Idem(#[from] idem::Error),
}

idem::final_errors!(AppError);

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Paid {
    order_key: String,
    amount: i64,
    status: String,
}

/// The payment callback of seed 003: mark the order paid, once per key.
#[idempotent(key = key, scope = "bench_cache", fingerprint(amount), cache = cache)]
#[retryable(max = 4)]
async fn paid(
    conn: &mut AsyncPgConnection,
    cache: Option<&ReplayCache>,
    key: &str,
    amount: i64,
) -> Result<Paid, AppError> {
    diesel::sql_query("INSERT INTO bench_cache_orders (order_key, amount) VALUES ($1, $2)")
        .bind::<diesel::sql_types::Text, _>(key)
        .bind::<diesel::sql_types::BigInt, _>(amount)
        .execute(conn)
        .await?;
    Ok(Paid {
        order_key: key.to_owned(),
        amount,
        status: "paid".to_owned(),
    })
}

fn url_of(server: &str, database: &str) -> String {
    match server.rsplit_once('/') {
        Some((base, _)) => format!("{base}/{database}"),
        None => format!("{server}/{database}"),
    }
}

/// `xact_commit + xact_rollback` of `database`, settled (read from the
/// admin database once its backends exited).
async fn settled_xacts(admin: &tokio_postgres::Client, database: &str) -> i64 {
    idem_testing::stats::settled_transactions(admin, database)
        .await
        .expect("the database's counters")
}

/// Reads of `idem_requests` in `url`'s database, by index or by scan.
async fn record_reads(url: &str) -> i64 {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .expect("connect");
    let task = tokio::spawn(connection);
    let reads = client
        .query_one(
            "SELECT coalesce(idx_scan, 0) + coalesce(seq_scan, 0) FROM pg_stat_user_tables \
             WHERE relname = 'idem_requests'",
            &[],
        )
        .await
        .expect("pg_stat_user_tables")
        .get::<_, i64>(0);
    drop(client);
    let _ = task.await;
    reads
}

fn pool(url: &str) -> Pool {
    let one = PoolConfig {
        max_size: 1,
        ..PoolConfig::default()
    };
    build_pool_with(url, &one).expect("pool")
}

#[tokio::main]
async fn main() {
    let args = parse_args();
    let server = common::database_url().await;
    let (admin, connection) = tokio_postgres::connect(&server, tokio_postgres::NoTls)
        .await
        .expect("connect to the server");
    tokio::spawn(connection);
    let urls = DATABASES.map(|name| url_of(&server, name));
    for (name, url) in DATABASES.iter().zip(&urls) {
        // Two statements: DROP DATABASE refuses an implicit transaction.
        for sql in [
            format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
            format!("CREATE DATABASE {name}"),
        ] {
            admin
                .batch_execute(&sql)
                .await
                .expect("create the contender's database");
        }
        let mut conn = AsyncPgConnection::establish(url).await.expect("connect");
        idem::migrate(&mut conn).await.expect("migrate");
        conn.batch_execute(SCHEMA).await.expect("schema");
    }
    let redis_url = tokio::task::spawn_blocking(idem_testing::redis::url)
        .await
        .expect("no panic")
        .expect("a Redis");
    let prefix = format!("bench_cache:{}:", std::process::id());
    let cache = ReplayCache::with_config(&redis_url, CacheConfig::new().prefix(prefix))
        .expect("a replay cache");
    let caches = [Some(&cache), None];
    let keys: Vec<String> = (0..KEYS).map(|k| format!("callback-{k}")).collect();

    // The first callback of each key: the body runs, the record commits
    // (and, with the cache, is copied to Redis).
    for (which, url) in urls.iter().enumerate() {
        let pool = pool(url);
        for key in &keys {
            let first = paid(&pool, caches[which], key, 3000).await.expect("first");
            assert!(!first.replayed);
        }
    }

    let mut before = [(0, 0); 2];
    for (which, url) in urls.iter().enumerate() {
        let reads = record_reads(url).await;
        before[which] = (settled_xacts(&admin, DATABASES[which]).await, reads);
    }
    let pools = [pool(&urls[0]), pool(&urls[1])];
    let mut samples: [Vec<Duration>; 2] = Default::default();
    for i in 0..args.warmup + args.iterations {
        let key = &keys[i % KEYS];
        for slot in 0..2 {
            let which = (i + slot) % 2;
            let started = Instant::now();
            let answer = paid(&pools[which], caches[which], key, 3000)
                .await
                .expect("a replay");
            let elapsed = started.elapsed();
            assert!(answer.replayed, "{} {key}", NAMES[which]);
            if i >= args.warmup {
                samples[which].push(elapsed);
            }
        }
    }
    drop(pools);
    let mut cost = [(0, 0); 2];
    for (which, url) in urls.iter().enumerate() {
        let xacts = settled_xacts(&admin, DATABASES[which]).await - before[which].0;
        let reads = record_reads(url).await - before[which].1;
        cost[which] = (xacts, reads);
    }
    let effects = {
        let mut conn = AsyncPgConnection::establish(&urls[1])
            .await
            .expect("connect");
        diesel::sql_query("DELETE FROM bench_cache_orders")
            .execute(&mut conn)
            .await
            .expect("count")
    };
    assert_eq!(effects, KEYS, "each key's body ran once");

    println!(
        "{} duplicates of {KEYS} keys per contender ({} warm-up), interleaved; Redis {redis_url}; \
         counts over all, latencies after the warm-up",
        args.warmup + args.iterations,
        args.warmup
    );
    println!(
        "{:<8} {:>10} {:>14} {:>10} {:>10} {:>10}",
        "contender", "db_xacts", "record_reads", "p50_us", "p90_us", "p99_us"
    );
    let mut pct = [[0.0; 3]; 2];
    for (which, s) in samples.iter_mut().enumerate() {
        s.sort();
        pct[which] = [0.5, 0.9, 0.99].map(|p| percentile_us(s, p));
        println!(
            "{:<8} {:>10} {:>14} {:>10.1} {:>10.1} {:>10.1}",
            NAMES[which], cost[which].0, cost[which].1, pct[which][0], pct[which][1], pct[which][2]
        );
    }
    for name in DATABASES {
        admin
            .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            .await
            .expect("drop the contender's database");
    }
    println!(
        "duplicates={} keys={KEYS} db_queries_cache={} db_queries_nocache={} db_xacts_cache={} \
         db_xacts_nocache={} replay_p50_us_cache={:.1} replay_p50_us_db={:.1} \
         replay_p99_us_cache={:.1} replay_p99_us_db={:.1}",
        args.warmup + args.iterations,
        cost[0].1,
        cost[1].1,
        cost[0].0,
        cost[1].0,
        pct[0][0],
        pct[1][0],
        pct[0][2],
        pct[1][2]
    );
}
