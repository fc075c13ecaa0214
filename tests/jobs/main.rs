//! The compensation queue against a real PostgreSQL: what happened is read
//! from the database (effect rows written by handlers, `idem_jobs` rows),
//! never from the worker's own report. Each test has its own database; the
//! multi-process tests run this very binary again as worker processes.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use diesel::sql_types::{BigInt, Text};
// Not RunQueryDsl: its by-value `execute` would shadow tokio_postgres's
// `Client::execute` in every module; the functions that run diesel queries
// import it themselves.
use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};
use idem::jobs::{enqueue, EnqueueError, Enqueued, Job, Ladder, Worker};
use idem::pool::{build_pool_with, PoolConfig};
use idem::{retryable, Pool};
use idem_testing::TestDatabase;
use scoped_futures::ScopedFutureExt;
use serde::{Deserialize, Serialize};

mod attack_jobs;
mod attack_jobs2;
mod attack_jobs3;
mod attack_jobs4;
mod attack_jobs5;
mod collapsing;
mod enqueuing;
mod ladder;
mod processes;
mod running;

/// The job every test enqueues: compensate aggregate `key`. A handler
/// writes one `effects` row per run that commits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Compensate {
    key: String,
    /// The worker processes' handler blocks on an advisory lock the test
    /// holds, after writing its effect, when this is set.
    #[serde(default)]
    block: bool,
}

impl Compensate {
    fn new(key: &str) -> Self {
        Compensate {
            key: key.to_owned(),
            block: false,
        }
    }
}

impl Job for Compensate {
    const KIND: &'static str = "compensate";
    fn key(&self) -> String {
        self.key.clone()
    }
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Db(#[from] diesel::result::Error),
    #[error(transparent)]
    Idem(#[from] idem::Error),
    #[error(transparent)]
    Enqueue(#[from] EnqueueError),
    #[error("refused: {0}")]
    Refused(String),
}

/// `effects`: no unique constraint, so a run applied twice shows as two rows.
const SCHEMA: &str = "
CREATE TABLE effects (
    key    text        NOT NULL,
    worker text        NOT NULL DEFAULT '',
    at     timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE workers_ready (worker text NOT NULL)";

struct Env {
    db: TestDatabase,
    pool: Pool,
    client: tokio_postgres::Client,
}

async fn env() -> Env {
    let db = TestDatabase::create()
        .await
        .expect("create the test database");
    let mut conn = AsyncPgConnection::establish(db.url())
        .await
        .expect("connect");
    idem::migrate(&mut conn).await.expect("migrate");
    conn.batch_execute(SCHEMA).await.expect("schema");
    drop(conn);
    let pool = pool(db.url());
    let client = idem_testing::connect(db.url()).await.expect("connect");
    Env { db, pool, client }
}

fn pool(url: &str) -> Pool {
    build_pool_with(
        url,
        &PoolConfig {
            max_size: 8,
            wait_timeout: Duration::from_secs(30),
            ..PoolConfig::default()
        },
    )
    .expect("pool")
}

impl Env {
    async fn scalar(&self, query: &str) -> i64 {
        self.client
            .query_one(query, &[])
            .await
            .unwrap_or_else(|e| panic!("{query}: {e}"))
            .get(0)
    }

    /// Committed effects of `key`.
    async fn effects(&self, key: &str) -> i64 {
        self.client
            .query_one("SELECT count(*) FROM effects WHERE key = $1", &[&key])
            .await
            .expect("count effects")
            .get(0)
    }

    /// `(state, attempts, last_error)` of the jobs of `key`, oldest first.
    async fn jobs(&self, key: &str) -> Vec<(String, i32, Option<String>)> {
        self.client
            .query(
                "SELECT state, attempts, last_error FROM idem_jobs WHERE key = $1 ORDER BY id",
                &[&key],
            )
            .await
            .expect("read idem_jobs")
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect()
    }

    /// Make every due job due now: the honest stand-in for waiting out a
    /// ladder step, after the step itself was checked.
    async fn make_due_now(&self) {
        self.client
            .execute(
                "UPDATE idem_jobs SET run_at = now() WHERE state = 'due'",
                &[],
            )
            .await
            .expect("make due");
    }

    /// Wait until `query` (a count) returns `want`, for at most 60 s.
    async fn until(&self, query: &str, want: i64) {
        let start = Instant::now();
        loop {
            let got = self.scalar(query).await;
            if got == want {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "{query}: {got}, waited for {want}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The decision to compensate: enqueue in a retried transaction.
#[retryable(max = 4, deadline_ms = 30000)]
async fn decide(conn: &mut AsyncPgConnection, job: &Compensate) -> Result<Enqueued, AppError> {
    Ok(enqueue(conn, job).await?)
}

/// Decide to compensate `key`, which has no unfinished job.
async fn enqueue_new(env: &Env, key: &str) -> idem::jobs::JobId {
    let enqueued = decide(&env.pool, &Compensate::new(key))
        .await
        .expect("enqueue");
    assert!(enqueued.is_new(), "{key}: {enqueued:?}");
    enqueued.id()
}

/// A worker polling fast, whose handler of [`Compensate`] writes its
/// effect and then fails while `fail` says so.
fn worker<F>(pool: &Pool, fail: F) -> Worker
where
    F: Fn(&Compensate) -> Option<String> + Send + Sync + 'static,
{
    Worker::new(pool.clone())
        .poll_interval(Duration::from_millis(20))
        .handle(move |conn, job: &Compensate| {
            let refused = fail(job);
            async move {
                record_effect(conn, &job.key, "").await?;
                match refused {
                    Some(why) => Err(AppError::Refused(why)),
                    None => Ok(()),
                }
            }
            .scope_boxed()
        })
}

async fn record_effect(
    conn: &mut AsyncPgConnection,
    key: &str,
    worker: &str,
) -> Result<(), diesel::result::Error> {
    use diesel_async::RunQueryDsl;
    diesel::sql_query("INSERT INTO effects (key, worker) VALUES ($1, $2)")
        .bind::<Text, _>(key)
        .bind::<Text, _>(worker)
        .execute(conn)
        .await
        .map(drop)
}

/// Counts the calls of a handler (failed runs leave no effect row).
#[derive(Clone, Default)]
struct Calls(Arc<AtomicU32>);

impl Calls {
    fn tick(&self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
    fn get(&self) -> u32 {
        self.0.load(Ordering::SeqCst)
    }
}

/// `run_at - failed_at` of the job of `key`, in milliseconds.
async fn step_waited(env: &Env, key: &str) -> i64 {
    env.client
        .query_one(
            "SELECT (extract(epoch FROM run_at - failed_at) * 1000)::bigint
             FROM idem_jobs WHERE key = $1",
            &[&key],
        )
        .await
        .expect("one job")
        .get(0)
}
