//! Seed 003 end to end: an order service with a state machine over a version
//! column, payment callbacks over HTTP and NATS, operator edits compensated
//! through a delay queue, and a Redis front cache of replays.
//!
//! `cargo run --release --features nats,redis --example orders [-- --orders N
//! --repeats R --ladder-scale F --admin-actions]` (defaults 200 orders, 3
//! deliveries per callback and path, ladder × 0.01: 50 ms, 300 ms, 1.2 s).
//! While it runs, idem's admin page is mounted at `/admin` of its HTTP
//! server (the URL is printed first): loopback peers only, read-only unless
//! `--admin-actions`. PostgreSQL:
//! `DATABASE_URL`, else 127.0.0.1:5432, else a throwaway cluster; the example
//! works in a fresh database of its own. NATS: `NATS_URL`, else 127.0.0.1:4222
//! if it has JetStream, else a throwaway `nats-server -js`. Redis: a
//! throwaway `redis-server` of its own (it is flushed and stopped mid-run).
//!
//! 1. Orders are created over HTTP, once per request id with the key on the
//!    order row (`create_once`, the seed's `uk_idempotent_key`): one request
//!    id sent twice at once (201 and 200, one order), then again with
//!    another amount (422, nothing written).
//! 2. Each order's payment callback is delivered `R` times over HTTP
//!    (`Idempotency-Key` = the provider's transaction id, through
//!    `#[idempotent(cache = ..)]`) and `R` times over NATS (the same id as
//!    `Nats-Msg-Id`, consumed through the inbox), all at once. Every fifth
//!    NATS message is left unacknowledged once after its commit, so JetStream
//!    redelivers it and the inbox must skip it. A quarter of the orders also
//!    get an operator's edit computed from the version before the payment:
//!    raced with it, or sent right after it; the loser is compensated through
//!    `idem::jobs` and applied after the ladder's first step.
//! 3. A retry storm: every callback `R` times more, answered from Redis.
//! 4. The seed's self-test: two writers on one order (one wins); the request
//!    id of step 1 sent twice gave one order.
//! 5. Replies of a sample of callbacks with Redis up, flushed and stopped
//!    are compared byte for byte.
//!
//! Every figure of the last line is read from PostgreSQL and Redis:
//! `callbacks=N duplicates=M paid=P double_paid=0 race_winners=1
//! same_request_rows=1 compensated=C dead=0 cache_hits=H
//! cache_down_identical=yes`. `callbacks` counts the deliveries that reached
//! the service (logged before any deduplication), `duplicates` those beyond
//! one per transaction id, `paid` the orders paid, `double_paid` the orders
//! with more than one payment row, `compensated` the edits the queue made,
//! `dead` the dead jobs and inbox messages, `cache_hits` Redis's own
//! `keyspace_hits`, `same_request_rows` the orders under the twice-sent
//! request id. The process exits with 1 when a figure is wrong.

#[path = "../common/mod.rs"]
mod common;

mod check;
mod client;
mod http;
mod nats;
mod service;

use std::net::SocketAddr;
use std::time::Duration;

use axum::http::Method;
use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};
use idem::admin::{self, AdminConfig};
use idem::idempotency::{CacheConfig, ReplayCache};
use idem::jobs::{Ladder, Worker};
use idem::pool::{build_pool_with, PoolConfig};
use idem_testing::redis::RedisServer;
use idem_testing::TestDatabase;
use serde_json::json;

use client::{Client, Reply};

struct Args {
    orders: i64,
    repeats: usize,
    ladder_scale: f64,
    /// The admin page may requeue and discard (else read-only).
    admin_actions: bool,
}

fn parse_args() -> Args {
    let mut args = Args {
        orders: 200,
        repeats: 3,
        ladder_scale: 0.01,
        admin_actions: false,
    };
    let usage =
        || -> ! { panic!("usage: [--orders N --repeats R --ladder-scale F --admin-actions]") };
    let mut it = std::env::args().skip(1);
    while let Some(name) = it.next() {
        if name == "--admin-actions" {
            args.admin_actions = true;
            continue;
        }
        let value = it.next().unwrap_or_else(|| usage());
        match name.as_str() {
            "--orders" => args.orders = value.parse().unwrap_or_else(|_| usage()),
            "--repeats" => args.repeats = value.parse().unwrap_or_else(|_| usage()),
            "--ladder-scale" => args.ladder_scale = value.parse().unwrap_or_else(|_| usage()),
            _ => usage(),
        }
    }
    assert!(
        args.orders >= 4 && args.repeats >= 1,
        "at least 4 orders and 1 repeat"
    );
    args
}

#[tokio::main]
async fn main() {
    let ok = run(parse_args()).await;
    std::process::exit(if ok { 0 } else { 1 });
}

/// How many requests are in flight at once.
const IN_FLIGHT: usize = 16;

async fn run(args: Args) -> bool {
    let admin = common::database_url().await;
    let db = TestDatabase::create_on(&admin)
        .await
        .expect("a fresh database");
    let mut conn = AsyncPgConnection::establish(db.url())
        .await
        .expect("connect");
    idem::migrate(&mut conn).await.expect("migrate");
    conn.batch_execute(service::SCHEMA).await.expect("schema");
    let pool = build_pool_with(
        db.url(),
        &PoolConfig {
            max_size: 24,
            wait_timeout: Duration::from_secs(10),
            ..PoolConfig::default()
        },
    )
    .expect("a pool");

    let redis = RedisServer::start().expect("a redis-server of the example's own");
    // 250 ms rather than the default 30 ms: the first command also opens the
    // connection, and on a loaded machine that can take longer; one failure
    // rests the cache for a second, which is most of a short run.
    let cache = ReplayCache::with_config(
        redis.url(),
        CacheConfig::new().timeout(Duration::from_millis(250)),
    )
    .expect("the cache");
    let ladder = Ladder::default().scaled(args.ladder_scale);
    let first_step = ladder.steps()[0];

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|stop| *stop).await;
        }
    };
    let consumer = nats::Consumer::start(pool.clone(), stopped()).await;
    let worker = tokio::spawn(
        Worker::new(pool.clone())
            .handle(service::reapply_note)
            .ladder(ladder)
            .poll_interval(Duration::from_millis(20))
            .run(stopped()),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let client = Client {
        addr: listener.local_addr().expect("address"),
    };
    println!(
        "admin page on http://{}/admin while the run lasts ({})",
        client.addr,
        if args.admin_actions {
            "requeue and discard enabled"
        } else {
            "read-only; --admin-actions to requeue and discard"
        }
    );
    let app = http::router(http::AppState {
        pool: pool.clone(),
        cache: Some(cache.clone()),
        first_step,
    })
    .nest(
        "/admin",
        admin::router(pool.clone(), AdminConfig::new().actions(args.admin_actions)),
    );
    // The peer address: the admin page answers loopback peers only.
    let server = tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
    });

    let orders: Vec<i64> = (1..=args.orders).collect();
    for_each(&orders, |id| async move {
        let reply = create(client, id, amount(id)).await;
        assert_eq!(reply.status, 201, "create order {id}: {reply:?}");
    })
    .await;
    let selftest_order = args.orders + 1;
    let (a, b) = futures_util::future::join(
        create(client, selftest_order, amount(selftest_order)),
        create(client, selftest_order, amount(selftest_order)),
    )
    .await;
    // One of them created it (201), the other found it (200), and both were
    // answered the same order.
    let mut statuses = [a.status, b.status];
    statuses.sort();
    assert!(
        statuses == [200, 201] && a.body == b.body && a.etag == b.etag,
        "one request id sent twice: {a:?} {b:?}"
    );
    // The request id reused for another amount: refused, nothing written
    // (counted in the database at the end).
    let reused = create(client, selftest_order, MISMATCHED_AMOUNT).await;
    assert!(
        reused.status == 422 && String::from_utf8_lossy(&reused.body).contains("amount"),
        "a request id reused with another amount: {reused:?}"
    );

    // Callbacks on both paths, with a quarter of the orders edited too.
    let edited = args.orders / 4;
    let repeats = args.repeats;
    let consumer_ref = &consumer;
    for_each(&orders, |id| async move {
        let seen = if id <= edited {
            Some(version_of(client, id).await)
        } else {
            None
        };
        let http = (0..repeats).map(|_| callback(client, id));
        let nats = (0..repeats).map(|_| consumer_ref.publish(id));
        let deliveries = async {
            futures_util::future::join(
                futures_util::future::join_all(http),
                futures_util::future::join_all(nats),
            )
            .await
        };
        match seen {
            // Raced: the edit and the deliveries at once.
            Some(seen) if id % 2 == 0 => {
                futures_util::future::join(deliveries, edit(client, id, seen, "compensate")).await;
            }
            // After the payment: that version is gone for sure.
            Some(seen) => {
                deliveries.await;
                edit(client, id, seen, "compensate").await;
            }
            None => {
                deliveries.await;
            }
        }
    })
    .await;

    // A retry storm: every callback again, answered from Redis.
    for_each(&orders, |id| async move {
        for _ in 0..repeats {
            callback(client, id).await;
        }
    })
    .await;

    // Seed 003's self-test: two writers on one order, at the same version.
    let seen = version_of(client, selftest_order).await;
    futures_util::future::join(
        edit(client, selftest_order, seen.clone(), "fail"),
        edit(client, selftest_order, seen, "fail"),
    )
    .await;

    // Byte for byte: with Redis up, flushed, then stopped.
    let sample: Vec<i64> = orders.iter().copied().take(20).collect();
    let up = replies(client, &sample).await;
    let hits = redis_hits(&redis).await;
    println!("cache (its own count) {:?}", cache.stats());
    assert_eq!(redis.command(&["FLUSHALL"]).expect("FLUSHALL"), "+OK");
    let flushed = replies(client, &sample).await;
    redis.stop();
    let down = replies(client, &sample).await;
    let identical = up.iter().all(|r| r.status == 200 && r.replayed) && up == flushed && up == down;

    let settled = consumer.drain(Duration::from_secs(60)).await
        && check::jobs_settled(&pool, Duration::from_secs(60)).await;
    let _ = stop_tx.send(true);
    let _ = worker.await;
    consumer.stop().await;
    server.abort();

    let figures = check::Figures::read(
        &mut conn,
        args.orders,
        edited,
        selftest_order,
        MISMATCHED_AMOUNT,
        hits,
        identical,
    )
    .await;
    let ok = settled && figures.report();
    drop(conn);
    drop(pool);
    ok
}

/// Runs `task` for every id, `IN_FLIGHT` at a time.
async fn for_each<F, Fut>(ids: &[i64], task: F)
where
    F: Fn(i64) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    use futures_util::StreamExt;
    futures_util::stream::iter(ids.iter().map(|&id| task(id)))
        .buffer_unordered(IN_FLIGHT)
        .collect::<Vec<()>>()
        .await;
}

fn amount(id: i64) -> i64 {
    1000 + id
}

/// The amount of the self-test's create that reuses a request id: no order
/// has it.
const MISMATCHED_AMOUNT: i64 = 999_999;

/// `POST /orders` with the request id `create-{id}`.
async fn create(client: Client, id: i64, amount: i64) -> Reply {
    let body = json!({ "request_id": format!("create-{id}"), "id": id, "amount": amount });
    client.send(Method::POST, "/orders", &[], Some(body)).await
}

async fn callback(client: Client, id: i64) -> Reply {
    let body = json!({ "order": id, "amount": amount(id) });
    let key = vec![("idempotency-key", format!("txn-{id}"))];
    let reply = client
        .send(Method::POST, "/callbacks/payment", &key, Some(body))
        .await;
    assert_eq!(reply.status, 200, "payment callback {id}: {reply:?}");
    reply
}

async fn version_of(client: Client, id: i64) -> String {
    let reply = client
        .send(Method::GET, &format!("/orders/{id}"), &[], None)
        .await;
    assert_eq!(reply.status, 200, "read order {id}: {reply:?}");
    reply.etag.expect("an ETag")
}

async fn edit(client: Client, id: i64, etag: String, on_conflict: &str) -> Reply {
    let body = json!({ "note": format!("operator-{id}"), "on_conflict": on_conflict });
    let reply = client
        .send(
            Method::PATCH,
            &format!("/orders/{id}"),
            &[("if-match", etag)],
            Some(body),
        )
        .await;
    assert_eq!(reply.status, 200, "edit order {id}: {reply:?}");
    reply
}

async fn replies(client: Client, ids: &[i64]) -> Vec<Reply> {
    let mut out = Vec::with_capacity(ids.len());
    for &id in ids {
        out.push(callback(client, id).await);
    }
    out
}

/// Redis's own count of lookups that found their key.
async fn redis_hits(redis: &RedisServer) -> u64 {
    let client = redis::Client::open(redis.url()).expect("a Redis URL");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("connect to Redis");
    let info: String = redis::cmd("INFO")
        .arg("stats")
        .query_async(&mut conn)
        .await
        .expect("INFO stats");
    info.lines()
        .find_map(|line| line.trim().strip_prefix("keyspace_hits:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("keyspace_hits in INFO stats")
}
