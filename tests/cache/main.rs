//! The Redis front cache of `#[idempotent(cache = ..)]` against a real
//! PostgreSQL and a real Redis. What reaches the database is counted from
//! outside the library: connections through the wire-level proxy (a replay
//! that opens none sent no query) and transactions in `pg_stat_database`.
//! Tests that stop, freeze or flush Redis start a `redis-server` of their
//! own; the others share one and keep to a key prefix of their own.

use std::sync::Arc;
use std::time::{Duration, Instant};

use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idem::idempotency::{scope_hash, CacheConfig, ReplayCache};
use idem::pool::{build_pool_with, PoolConfig};
use idem::{idempotent, retryable, Deferred, IdempotentError, Pool};
use idem_testing::proxy::Proxy;
use idem_testing::TestDatabase;
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

mod attack_s54;
mod counted;
mod failures;
mod forged;
mod replays;
mod shared;

// ---------------------------------------------------------------------------
// Fixtures
// ---------------------------------------------------------------------------

/// A final error, stored under the key and replayed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum Declined {
    /// Carries a float whose sign `jsonb` drops: its replay shows which
    /// form was copied.
    Refused { amount: f64, balance: f64 },
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Db(#[from] diesel::result::Error),
    #[error(transparent)]
    Idem(#[from] idem::Error),
    #[error("declined: {0:?}")]
    Declined(Declined),
    /// The target did not answer: it may have done it.
    #[error("the target timed out")]
    Timeout,
}

impl IdempotentError for AppError {
    type Final = Declined;
    fn to_final(&self) -> Option<Declined> {
        match self {
            AppError::Declined(d) => Some(d.clone()),
            _ => None,
        }
    }
    fn from_final(stored: Declined) -> Self {
        AppError::Declined(stored)
    }
}

/// The response. `signed_zero` is `-0.0` when the body returns it; `jsonb`
/// stores `0.0`, so every replay (database or cache) must say `0.0`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Receipt {
    id: i64,
    amount: f64,
    signed_zero: f64,
    note: serde_json::Value,
}

#[derive(Debug, Clone)]
struct Cmd {
    tenant: i64,
    key: String,
    /// Negative: declined (a final error). 13: the target times out.
    amount: f64,
}

fn cmd(key: &str, amount: f64) -> Cmd {
    Cmd {
        tenant: 7,
        key: key.to_owned(),
        amount,
    }
}

/// Runs its effect (one `effects` row) and answers, or declines.
async fn effect(conn: &mut AsyncPgConnection, cmd: &Cmd) -> Result<Receipt, AppError> {
    if cmd.amount < 0.0 {
        return Err(AppError::Declined(Declined::Refused {
            amount: cmd.amount,
            balance: -0.0,
        }));
    }
    let id: i64 = diesel::sql_query("INSERT INTO effects (tag) VALUES ($1) RETURNING id")
        .bind::<Text, _>(&cmd.key)
        .get_result::<Id>(conn)
        .await?
        .id;
    Ok(Receipt {
        id,
        amount: cmd.amount,
        signed_zero: -0.0,
        note: serde_json::json!({ "zeta": 1, "alpha": [1.5, 1e300, -0.0], "mid": "ü\u{1F600}" }),
    })
}

#[derive(diesel::QueryableByName)]
struct Id {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

#[idempotent(key = cmd.key, scope = cmd.tenant, fingerprint(cmd.amount), cache = cache)]
#[retryable(max = 4)]
async fn pay(
    conn: &mut AsyncPgConnection,
    cache: Option<&ReplayCache>,
    cmd: &Cmd,
) -> Result<Receipt, AppError> {
    effect(conn, cmd).await
}

/// External mode: the claim commits, then the body waits for `gate` (so a
/// test can look at the in-progress record), then records its effect.
#[idempotent(key = cmd.key, scope = cmd.tenant, fingerprint(cmd.amount), mode = external, cache = cache)]
async fn charge(
    db: &mut Deferred<'_>,
    cache: Option<&ReplayCache>,
    cmd: &Cmd,
    gate: &Semaphore,
) -> Result<Receipt, AppError> {
    drop(gate.acquire().await);
    if cmd.amount == 13.0 {
        return Err(AppError::Timeout);
    }
    effect(db.conn().await?, cmd).await
}

const SCHEMA: &str = "CREATE TABLE effects (id bigserial PRIMARY KEY, tag text NOT NULL);";

struct Env {
    db: TestDatabase,
    client: tokio_postgres::Client,
    pool: Pool,
}

/// A fresh database, migrated, with the `effects` table, and no connection
/// left open to it.
async fn migrated_database() -> TestDatabase {
    let db = TestDatabase::create().await.expect("a test database");
    let mut conn = AsyncPgConnection::establish(db.url())
        .await
        .expect("connect");
    idem::migrate(&mut conn).await.expect("migrate");
    conn.batch_execute(SCHEMA).await.expect("schema");
    db
}

/// A connection to the server itself (its counters, `CREATE DATABASE`).
async fn admin() -> tokio_postgres::Client {
    let server_url = tokio::task::spawn_blocking(idem_testing::server_url)
        .await
        .unwrap()
        .expect("the server");
    idem_testing::connect(&server_url).await.expect("admin")
}

async fn env() -> Env {
    let db = migrated_database().await;
    let client = idem_testing::connect(db.url()).await.expect("connect");
    let pool = pool_on(db.url());
    Env { db, client, pool }
}

fn pool_on(url: &str) -> Pool {
    build_pool_with(
        url,
        &PoolConfig {
            max_size: 2,
            wait_timeout: Duration::from_secs(60),
            ..PoolConfig::default()
        },
    )
    .expect("a pool")
}

impl Env {
    /// A pool whose every connection goes through a proxy of its own, so
    /// `counted.accepted()` counts the connections it opened. The cache's
    /// sealing key is read through it first (as every new pool does once)
    /// and that connection closed, so the count starts at 0.
    async fn counted_pool(&self, cache: &ReplayCache) -> (Pool, Counted) {
        let proxy = Proxy::start(self.db.url()).await.expect("a proxy");
        let pool = pool_on(proxy.url());
        assert!(cache.prepare(&pool).await, "the sealing key is read");
        proxy.cut_all();
        let base = proxy.accepted();
        (pool, Counted { proxy, base })
    }

    async fn effects(&self, key: &str) -> i64 {
        self.client
            .query_one("SELECT count(*) FROM effects WHERE tag = $1", &[&key])
            .await
            .unwrap()
            .get(0)
    }

    async fn state(&self, key: &str) -> Option<String> {
        self.client
            .query_opt(
                "SELECT state::text FROM idem_requests WHERE key = $1",
                &[&key],
            )
            .await
            .unwrap()
            .map(|r| r.get(0))
    }
}

/// A proxy's count of the connections it accepted since a point.
struct Counted {
    proxy: Proxy,
    base: usize,
}

impl Counted {
    fn accepted(&self) -> usize {
        self.proxy.accepted() - self.base
    }
}

/// A cache on the shared Redis, under a prefix no other test uses.
fn shared_cache() -> ReplayCache {
    let url = idem_testing::redis::url().expect("a Redis");
    let prefix = idem_testing::redis::unique_prefix("cache");
    // Generous timeout: the shared machine runs other builds. The key is
    // trusted for a minute, so that no test counting connections sees the
    // background read of it (tests/cache/forged.rs tests that read).
    let config = CacheConfig::new()
        .prefix(prefix)
        .timeout(Duration::from_millis(250))
        .recheck(Duration::from_secs(60));
    ReplayCache::with_config(&url, config).expect("a cache")
}

/// A cache on `server`, with a short back-off and a 250 ms timeout: the
/// default 30 ms also bounds Redis's lazy first connect, which a loaded
/// machine can miss; the back-off would then skip Redis and fail a test
/// that counts what Redis answered.
fn cache_on(server: &idem_testing::redis::RedisServer) -> ReplayCache {
    let config = CacheConfig::new()
        .timeout(Duration::from_millis(250))
        .backoff(Duration::from_millis(500))
        .recheck(Duration::from_secs(60));
    ReplayCache::with_config(server.url(), config).expect("a cache")
}

/// What a caller sees, as bytes: the reply's JSON and whether it is a
/// replay, or the final error's JSON. Other errors are the test's failure.
fn reply_bytes(reply: &Result<idem::Idempotent<Receipt>, AppError>) -> Vec<u8> {
    match reply {
        Ok(answer) => {
            let mut bytes = serde_json::to_vec(&answer.value).unwrap();
            bytes.extend_from_slice(format!(" replayed={}", answer.replayed).as_bytes());
            bytes
        }
        Err(AppError::Declined(declined)) => serde_json::to_vec(declined).unwrap(),
        Err(other) => panic!("unexpected error: {other:?}"),
    }
}

/// Whether Redis holds the cache's entry for `key` (read with a client of
/// the test's own, not through the cache).
async fn cached_in_redis(url: &str, cache: &ReplayCache, key: &str) -> bool {
    redis_ttl_ms(url, cache, key).await > 0
}

/// The entry's PTTL in ms (-2: no entry).
async fn redis_ttl_ms(url: &str, cache: &ReplayCache, key: &str) -> i64 {
    let mut conn = raw_redis(url).await;
    redis::cmd("PTTL")
        .arg(redis_key_of(cache, 7, key))
        .query_async(&mut conn)
        .await
        .expect("PTTL")
}

/// A raw client of the test's own on `url`, not through the cache.
async fn raw_redis(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .expect("a Redis URL")
        .get_multiplexed_async_connection()
        .await
        .expect("connect to Redis")
}

/// The Redis key of the cache's entry for `tenant`'s `key`.
fn redis_key_of(cache: &ReplayCache, tenant: i64, key: &str) -> String {
    cache.redis_key(&scope_hash(&tenant).unwrap(), key)
}

async fn redis_get(conn: &mut redis::aio::MultiplexedConnection, key: &str) -> Option<Vec<u8>> {
    redis::cmd("GET")
        .arg(key)
        .query_async(conn)
        .await
        .expect("GET")
}

async fn redis_set(conn: &mut redis::aio::MultiplexedConnection, key: &str, bytes: &[u8]) {
    let () = redis::cmd("SET")
        .arg(key)
        .arg(bytes)
        .query_async(conn)
        .await
        .expect("SET");
}

/// Keeps a shared cache's URL beside it.
fn shared_url() -> String {
    idem_testing::redis::url().expect("a Redis")
}

/// Start a first call of `charge` that holds its claim until `gate` opens.
fn charge_in_background(
    pool: &Pool,
    cache: &ReplayCache,
    cmd: Cmd,
    gate: &Arc<Semaphore>,
) -> tokio::task::JoinHandle<Result<idem::Idempotent<Receipt>, AppError>> {
    let (pool, cache, gate) = (pool.clone(), cache.clone(), gate.clone());
    tokio::spawn(async move { charge(&pool, Some(&cache), &cmd, &gate).await })
}

/// Wait until the record of `key` is in `state`.
async fn wait_for_state(env: &Env, key: &str, state: &str) {
    let until = Instant::now() + Duration::from_secs(30);
    while env.state(key).await.as_deref() != Some(state) {
        assert!(Instant::now() < until, "{key} never became {state}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
