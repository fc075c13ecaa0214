//! `#[idempotent]` against a real PostgreSQL: every promise of issue 4 is shown
//! by real outcomes (business rows, `idem_requests` records, commits counted by
//! the server), never by the library's own report of what it did. Sleeps only
//! widen races or let a lease or a retention run out; no assertion depends on
//! the machine being fast.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idem::http::HttpStatus;
use idem::idempotency::{current_key, purge_expired, settle, Settlement, OUTCOME_UNKNOWN_MESSAGE};
use idem::pool::{build_pool_with, PoolConfig, Pooler};
use idem::{idempotent, retryable, Deferred, IdempotentError, Pool, VersionedError};
use idem_testing::TestDatabase;
use serde::{Deserialize, Serialize};
use tokio::sync::{Barrier, Semaphore};

#[path = "../support/pool.rs"]
mod test_pool;

mod attack;
mod attack_body;
mod attack_drop;
mod attack_dropped;
mod attack_ext;
mod attack_handoff;
mod attack_hold;
mod attack_prepared;
mod attack_savepoint;
mod attack_seal;
mod attack_session;
mod attack_session38;
mod attack_session39;
mod attack_session40;
mod attack_session41;
mod attack_session42;
mod attack_session43;
mod attack_session44;
mod attack_session45;
mod attack_session46;
mod attack_session47;
mod attack_session48;
mod attack_session49;
mod attack_session50;
mod attack_session51;
mod attack_session52;
mod attack_swap;
mod attack_sync_standby;
mod attack_third;
mod attack_unanswered;
mod attack_wire;
mod closing;
mod derived_keys;
mod dropped_savepoint;
mod external;
mod hand_commit;
mod held_commit;
mod hostile;
mod kit;
mod literals;
mod local;
mod malformed;
mod one_write;
mod prepared;
mod queued_commit;
mod retention;
mod stacking;
mod stored;

// ---------------------------------------------------------------------------
// Fixtures
// ---------------------------------------------------------------------------

/// A final error: stored under the key and replayed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
enum Declined {
    InsufficientFunds {
        needed: i64,
    },
    /// Echoes the caller's input, as validation errors often do.
    Rejected {
        input: serde_json::Value,
    },
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Db(#[from] diesel::result::Error),
    #[error(transparent)]
    Idem(#[from] idem::Error),
    #[error(transparent)]
    Versioned(#[from] VersionedError),
    #[error("declined: {0:?}")]
    Declined(Declined),
    /// The target did not answer: it may have done it.
    #[error("the target timed out")]
    Timeout,
    /// Refused before anything was sent.
    #[error("invalid request, nothing sent")]
    Invalid,
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
    fn nothing_sent(&self) -> bool {
        matches!(self, AppError::Invalid)
    }
}

const SCHEMA: &str = "
    CREATE TABLE payments (
        id bigint PRIMARY KEY,
        tenant bigint NOT NULL,
        amount bigint NOT NULL,
        currency text NOT NULL
    );
    CREATE TABLE effects (id bigserial PRIMARY KEY, tag text NOT NULL, n bigint NOT NULL);
";

struct Env {
    client: tokio_postgres::Client,
    pool: Pool,
    db: TestDatabase,
}

async fn env(pool_size: usize) -> Env {
    let db = TestDatabase::create()
        .await
        .expect("create the test database");
    env_in(db, pool_size).await
}

/// [`env`] in `db` (a database of a server of the test's own, say).
async fn env_in(db: TestDatabase, pool_size: usize) -> Env {
    assert!(pool_size <= 20, "tests run in parallel: keep pools small");
    let mut conn = AsyncPgConnection::establish(db.url())
        .await
        .expect("connect");
    idem::migrate(&mut conn).await.expect("migrate");
    conn.batch_execute(SCHEMA).await.expect("schema");
    drop(conn);
    let client = side_connection(db.url()).await;
    let pool = pool_of(&db, pool_size);
    Env { client, pool, db }
}

/// The code under test's pool: through PgBouncer under `IDEM_TEST_VIA=pgbouncer`.
fn pool_of(db: &TestDatabase, size: usize) -> Pool {
    test_pool::test_pool(db, size, Duration::from_secs(60))
}

async fn side_connection(url: &str) -> tokio_postgres::Client {
    idem_testing::connect(url).await.expect("connect")
}

impl Env {
    async fn scalar(&self, query: &str) -> i64 {
        self.client
            .query_one(query, &[])
            .await
            .unwrap_or_else(|e| panic!("{query}: {e}"))
            .get(0)
    }

    async fn records(&self) -> i64 {
        self.scalar("SELECT count(*) FROM idem_requests").await
    }

    async fn payments(&self) -> i64 {
        self.scalar("SELECT count(*) FROM payments").await
    }

    async fn effects(&self, tag: &str) -> i64 {
        self.client
            .query_one("SELECT count(*) FROM effects WHERE tag = $1", &[&tag])
            .await
            .unwrap()
            .get(0)
    }

    /// `(state, outcome, response as text)` of the record of `key`, if any.
    async fn record(&self, key: &str) -> Option<(String, Option<String>, Option<String>)> {
        self.client
            .query_opt(
                "SELECT state::text, outcome::text, response::text FROM idem_requests WHERE key = $1",
                &[&key],
            )
            .await
            .unwrap()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
    }

    async fn state(&self, key: &str) -> Option<String> {
        self.record(key).await.map(|r| r.0)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Payment {
    id: i64,
    tenant: i64,
    amount: i64,
    currency: String,
}

#[derive(Debug, Clone)]
struct Ctx {
    tenant: i64,
    user: i64,
}

#[derive(Debug, Clone)]
struct PayCmd {
    key: String,
    amount: i64,
    currency: String,
    merchant: String,
}

fn cmd(key: &str, amount: i64) -> PayCmd {
    PayCmd {
        key: key.to_owned(),
        amount,
        currency: "CNY".to_owned(),
        merchant: "demo".to_owned(),
    }
}

const CTX: Ctx = Ctx { tenant: 1, user: 7 };

async fn insert_payment(
    conn: &mut AsyncPgConnection,
    id: i64,
    tenant: i64,
    cmd: &PayCmd,
) -> Result<Payment, AppError> {
    diesel::sql_query(
        "INSERT INTO payments (id, tenant, amount, currency) VALUES ($1, $2, $3, $4)",
    )
    .bind::<BigInt, _>(id)
    .bind::<BigInt, _>(tenant)
    .bind::<BigInt, _>(cmd.amount)
    .bind::<Text, _>(&cmd.currency)
    .execute(conn)
    .await?;
    Ok(Payment {
        id,
        tenant,
        amount: cmd.amount,
        currency: cmd.currency.clone(),
    })
}

/// The payment of seed 000: each caller proposes its own payment id; the key
/// is the arbiter.
#[idempotent(key = cmd.key, scope = (ctx.tenant, ctx.user), fingerprint(cmd.amount, cmd.currency, cmd.merchant))]
#[retryable(max = 4, deadline_ms = 30000)]
async fn pay(
    conn: &mut AsyncPgConnection,
    ctx: &Ctx,
    cmd: &PayCmd,
    proposed_id: i64,
) -> Result<Payment, AppError> {
    insert_payment(conn, proposed_id, ctx.tenant, cmd).await
}

/// Another operation (its default name is its own path) with the same
/// attribute: the same key is a different request.
#[idempotent(key = cmd.key, scope = (ctx.tenant, ctx.user), fingerprint(cmd.amount, cmd.currency, cmd.merchant))]
#[retryable(max = 4, deadline_ms = 30000)]
async fn refund(
    conn: &mut AsyncPgConnection,
    ctx: &Ctx,
    cmd: &PayCmd,
    proposed_id: i64,
) -> Result<Payment, AppError> {
    insert_payment(conn, proposed_id, ctx.tenant, cmd).await
}

async fn insert_effect(conn: &mut AsyncPgConnection, tag: &str, n: i64) -> Result<i64, AppError> {
    #[derive(QueryableByName)]
    struct Id {
        #[diesel(sql_type = BigInt)]
        id: i64,
    }
    let row: Id = diesel::sql_query("INSERT INTO effects (tag, n) VALUES ($1, $2) RETURNING id")
        .bind::<Text, _>(tag)
        .bind::<BigInt, _>(n)
        .get_result(conn)
        .await?;
    Ok(row.id)
}

fn calls(c: &AtomicU32) -> u32 {
    c.load(Ordering::SeqCst)
}

fn matches_idem(result: &Result<impl std::fmt::Debug, AppError>, expected: &str) -> bool {
    match result {
        Err(AppError::Idem(e)) => format!("{e:?}").starts_with(expected),
        _ => false,
    }
}

// ---------------------------------------------------------------------------
// A scripted body: the errors its next runs fail with
// ---------------------------------------------------------------------------

/// What the next runs of a body do, in order; then they succeed.
#[derive(Default)]
struct Script {
    calls: AtomicU32,
    steps: Mutex<VecDeque<Step>>,
    keys: Mutex<Vec<Option<String>>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Declined,
    Timeout,
    Invalid,
    SerializationFailure,
    Stale,
}

impl Script {
    fn new(steps: &[Step]) -> Script {
        Script {
            steps: Mutex::new(steps.iter().copied().collect()),
            ..Script::default()
        }
    }

    fn push(&self, step: Step) {
        self.steps.lock().unwrap().push_back(step);
    }

    /// One run of a body, after its writes: count it, note the key, and fail
    /// as scripted.
    async fn run(&self, conn: &mut AsyncPgConnection) -> Result<(), AppError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.keys.lock().unwrap().push(current_key());
        let step = self.steps.lock().unwrap().pop_front();
        match step {
            None => Ok(()),
            Some(Step::Declined) => Err(AppError::Declined(Declined::InsufficientFunds {
                needed: 42,
            })),
            Some(Step::Timeout) => Err(AppError::Timeout),
            Some(Step::Invalid) => Err(AppError::Invalid),
            Some(Step::SerializationFailure) => {
                conn.batch_execute(
                    "DO $$ BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = 'serialization_failure'; END $$",
                )
                .await?;
                unreachable!("the statement fails")
            }
            Some(Step::Stale) => {
                // A hand-written check that lost a race says so.
                idem::attempt::lost_race();
                Err(AppError::Versioned(VersionedError::Stale {
                    expected: 1,
                    actual: 2,
                }))
            }
        }
    }

    fn calls(&self) -> u32 {
        calls(&self.calls)
    }
}

/// Whether `what` became true within `within`, polled.
async fn eventually<F, Fut>(within: Duration, mut what: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let until = Instant::now() + within;
    while !what().await {
        if Instant::now() >= until {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}

/// idem's log, as text.
#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Log {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Log {
    /// The lines naming `key` and containing `with` (" ERROR ", say).
    fn lines(&self, key: &str, with: &str) -> Vec<String> {
        let text = String::from_utf8(self.0.lock().unwrap().clone()).unwrap();
        let lines = text.lines().filter(|l| l.contains(key) && l.contains(with));
        lines.map(str::to_owned).collect()
    }

    /// A subscriber writing to this log.
    fn subscriber(&self) -> impl tracing::Subscriber + Send + Sync {
        let log = self.clone();
        let fmt = tracing_subscriber::fmt().with_ansi(false);
        fmt.with_writer(move || log.clone()).finish()
    }
}
