//! What `Replication::Synchronous` costs per request, on a real primary and
//! synchronous standby (`idem_testing::replica::ReplicaPair`, started from
//! the installed PostgreSQL binaries on loopback).
//!
//! `cargo run --release --example bench_replication -- --iterations 2000`
//!
//! Two pools on the same pair, interleaved request by request with a
//! rotating first place, so drift on a shared machine hits both alike:
//!
//! - `single`: `Replication::Single` (the default);
//! - `synchronous`: `Replication::Synchronous`, which replays a stored
//!   outcome only once the standby holds it (one more statement, a wait on
//!   the server) and never cancels a `COMMIT`.
//!
//! Each contender makes fresh requests (a payment and its record, committed
//! synchronously in both, since the server decides that) and replays of
//! them. The last line is machine-readable: `iterations=..
//! fresh_p50_us_single=.. fresh_p50_us_sync=.. fresh_ratio=..
//! replay_p50_us_single=.. replay_p50_us_sync=.. replay_ratio=..` (ratios:
//! synchronous / single, of the medians).

#[path = "common/bench.rs"]
mod bench;

use std::time::{Duration, Instant};

use bench::{parse_args, percentile_us};
use diesel::sql_types::Text;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idem::pool::{build_pool_with, PoolConfig, Replication};
use idem::{idempotent, retryable, Pool};
use idem_testing::replica::{self, ReplicaPair};

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] idem::Error),
    #[error(transparent)]
    Db(#[from] diesel::result::Error),
}

impl idem::IdempotentError for AppError {
    type Final = ();
    fn to_final(&self) -> Option<()> {
        None
    }
    fn from_final(_: ()) -> Self {
        AppError::Idem(idem::Error::ClaimLost)
    }
}

#[idempotent(key = key, fingerprint(key), scope = none)]
#[retryable(max = 4, deadline_ms = 5000)]
async fn pay(conn: &mut AsyncPgConnection, key: &str) -> Result<(), AppError> {
    diesel::sql_query("INSERT INTO payments (key) VALUES ($1)")
        .bind::<Text, _>(key)
        .execute(conn)
        .await?;
    Ok(())
}

const NAMES: [&str; 2] = ["single", "synchronous"];

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse_args();
    let pair = ReplicaPair::start(replica::Replication::Sync).await?;
    let url = pair.create_database("bench").await?;
    let mut conn = AsyncPgConnection::establish(&pair.primary_url_for("bench")).await?;
    idem::migrate(&mut conn).await?;
    conn.batch_execute("CREATE TABLE payments (id bigserial PRIMARY KEY, key text NOT NULL)")
        .await?;
    drop(conn);
    let pool = |replication| -> Result<Pool, idem::pool::BuildError> {
        build_pool_with(
            &url,
            &PoolConfig {
                max_size: 2,
                replication,
                ..PoolConfig::default()
            },
        )
    };
    let pools = [pool(Replication::Single)?, pool(Replication::Synchronous)?];

    let total = args.warmup + args.iterations;
    let mut fresh: [Vec<Duration>; 2] = [Vec::new(), Vec::new()];
    let mut replay: [Vec<Duration>; 2] = [Vec::new(), Vec::new()];
    for i in 0..total {
        for turn in 0..2 {
            let which = (i + turn) % 2;
            let key = format!("{}-{i}", NAMES[which]);
            let started = Instant::now();
            pay(&pools[which], &key).await?;
            let made = started.elapsed();
            let started = Instant::now();
            let again = pay(&pools[which], &key).await?;
            let replayed = started.elapsed();
            assert!(again.replayed, "{key}: the second call is a replay");
            if i >= args.warmup {
                fresh[which].push(made);
                replay[which].push(replayed);
            }
        }
    }
    println!(
        "{} requests and {} replays per contender ({} warm-up), interleaved; a primary and a synchronous standby on loopback",
        args.iterations, args.iterations, args.warmup
    );
    println!(
        "{:<12} {:>14} {:>14} {:>15} {:>15}",
        "contender", "fresh_p50_us", "fresh_p99_us", "replay_p50_us", "replay_p99_us"
    );
    let mut p50 = [[0.0; 2]; 2];
    for which in 0..2 {
        fresh[which].sort();
        replay[which].sort();
        p50[which] = [
            percentile_us(&fresh[which], 0.5),
            percentile_us(&replay[which], 0.5),
        ];
        println!(
            "{:<12} {:>14.1} {:>14.1} {:>15.1} {:>15.1}",
            NAMES[which],
            p50[which][0],
            percentile_us(&fresh[which], 0.99),
            p50[which][1],
            percentile_us(&replay[which], 0.99),
        );
    }
    println!(
        "iterations={} fresh_p50_us_single={:.1} fresh_p50_us_sync={:.1} fresh_ratio={:.2} replay_p50_us_single={:.1} replay_p50_us_sync={:.1} replay_ratio={:.2}",
        args.iterations,
        p50[0][0],
        p50[1][0],
        p50[1][0] / p50[0][0],
        p50[0][1],
        p50[1][1],
        p50[1][1] / p50[0][1],
    );
    Ok(())
}
