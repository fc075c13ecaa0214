//! The transactional outbox against a real PostgreSQL and a real NATS
//! JetStream server (`NATS_URL`, else 127.0.0.1:4222, else a throwaway one): every test
//! asserts on what `idem_outbox` holds and on what the stream stored, never
//! on the relay's own report of what it did. Each test has its own database
//! and its own stream and subjects.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};
use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};
use idem::outbox::{emit, EmitError, Event, EventId, NatsPublisher, Relay};
use idem::pool::{build_pool_with, PoolConfig};
use idem::{retryable, Pool};
use idem_testing::TestDatabase;
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

mod attack_outbox;
mod attack_outbox2;
mod cleanup;
mod emitting;
mod order;
mod outage;
mod poison;
mod refusals;
mod startup;

// ---------------------------------------------------------------------------
// Fixtures
// ---------------------------------------------------------------------------

/// The event every test emits: the `n`-th change of aggregate `key`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Changed {
    key: String,
    n: i64,
}

impl Event for Changed {
    const KIND: &'static str = "changed";
    const VERSION: u32 = 3;
    fn key(&self) -> String {
        self.key.clone()
    }
    fn subject(&self) -> String {
        format!("changed.{}", self.key)
    }
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Db(#[from] diesel::result::Error),
    #[error(transparent)]
    Idem(#[from] idem::Error),
    #[error(transparent)]
    Emit(#[from] EmitError),
    #[error("the business rule refused")]
    Refused,
}

impl idem::IdempotentError for AppError {
    type Final = ();
    fn to_final(&self) -> Option<()> {
        None
    }
    fn from_final(_: ()) -> Self {
        AppError::Refused
    }
}

/// The business table: one counter per aggregate, whose row lock orders the
/// writers of an aggregate by commit, independently of the outbox.
const SCHEMA: &str = "CREATE TABLE counters (key text PRIMARY KEY, n bigint NOT NULL)";

struct Env {
    db: TestDatabase,
    pool: Pool,
    client: tokio_postgres::Client,
    js: jetstream::Context,
    /// This test's stream; it captures `<stream>.>`.
    stream: String,
}

/// `NATS_URL`, else the local server, else a throwaway `nats-server -js`
/// (the harness decides, as it does for PostgreSQL).
async fn nats_url() -> String {
    tokio::task::spawn_blocking(idem_testing::nats::url)
        .await
        .expect("no panic")
        .expect("a NATS server with JetStream")
}

/// A name no other test (nor an earlier run) uses.
fn unique(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_nanos();
    format!(
        "{prefix}_{}_{nanos}_{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

async fn env(test: &str, duplicate_window: Duration) -> Env {
    let (db, pool, client) = database().await;
    let js = jetstream::new(
        async_nats::connect(nats_url().await)
            .await
            .expect("connect to NATS"),
    );
    let stream = unique(&test.to_uppercase());
    js.create_stream(stream::Config {
        name: stream.clone(),
        subjects: vec![format!("{stream}.>")],
        duplicate_window,
        storage: stream::StorageType::Memory,
        ..Default::default()
    })
    .await
    .expect("create the stream");
    Env {
        db,
        pool,
        client,
        js,
        stream,
    }
}

/// A fresh database with idem's tables and the `counters` table, a pool on
/// it, and a plain client for the assertions.
async fn database() -> (TestDatabase, Pool, tokio_postgres::Client) {
    let db = TestDatabase::create()
        .await
        .expect("create the test database");
    let mut conn = AsyncPgConnection::establish(db.url())
        .await
        .expect("connect");
    idem::migrate(&mut conn).await.expect("migrate");
    conn.batch_execute(SCHEMA).await.expect("schema");
    drop(conn);
    let pool = build_pool_with(
        db.url(),
        &PoolConfig {
            max_size: 12,
            wait_timeout: Duration::from_secs(60),
            ..PoolConfig::default()
        },
    )
    .expect("pool");
    let client = idem_testing::connect(db.url()).await.expect("connect");
    (db, pool, client)
}

/// One message as the stream stored it.
#[derive(Debug, Clone)]
struct Stored {
    msg_id: String,
    key: String,
    seq: i64,
    subject: String,
    event: Changed,
}

impl Env {
    /// A publisher of a fresh NATS connection to this test's stream.
    async fn publisher(&self) -> NatsPublisher {
        let client = async_nats::connect(nats_url().await)
            .await
            .expect("connect to NATS");
        NatsPublisher::new(jetstream::new(client), &self.stream).subject_prefix(&self.stream)
    }

    /// [`Env::publisher`] waiting `ack` for each publish ack (the JetStream
    /// context's timeout, 5 s by default): a relay's lease must exceed it.
    async fn publisher_waiting(&self, ack: Duration) -> NatsPublisher {
        let client = async_nats::connect(nats_url().await)
            .await
            .expect("connect to NATS");
        let mut context = jetstream::new(client);
        context.set_timeout(ack);
        NatsPublisher::new(context, &self.stream).subject_prefix(&self.stream)
    }

    async fn scalar(&self, query: &str) -> i64 {
        self.client
            .query_one(query, &[])
            .await
            .unwrap_or_else(|e| panic!("{query}: {e}"))
            .get(0)
    }

    /// (id, key, seq, state, attempts) of every outbox row, by key and seq.
    async fn rows(&self) -> Vec<(String, String, i64, String, i32)> {
        self.client
            .query(
                "SELECT id::text, key, seq, state, attempts FROM idem_outbox ORDER BY key, seq",
                &[],
            )
            .await
            .expect("read idem_outbox")
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
            .collect()
    }

    /// Every message of the stream, in the order the stream stored them.
    async fn stored(&self) -> Vec<Stored> {
        let mut stream = self.js.get_stream(&self.stream).await.expect("the stream");
        let last = stream
            .info()
            .await
            .expect("stream info")
            .state
            .last_sequence;
        let mut out = Vec::new();
        for seq in 1..=last {
            let m = stream.get_raw_message(seq).await.expect("read a message");
            let header = |name: &str| {
                // The standard name is a variant of its own; a plain
                // string would look for a custom header.
                let name: async_nats::header::HeaderName = match name {
                    "Nats-Msg-Id" => async_nats::header::NATS_MESSAGE_ID,
                    other => other.parse().expect("a header name"),
                };
                m.headers
                    .get(name.clone())
                    .unwrap_or_else(|| panic!("header {name} in {:?}", m.headers))
                    .as_str()
                    .to_owned()
            };
            out.push(Stored {
                msg_id: header("Nats-Msg-Id"),
                key: header("Idem-Event-Key"),
                seq: header("Idem-Event-Seq").parse().expect("a seq"),
                subject: m.subject.to_string(),
                event: serde_json::from_slice(&m.payload).expect("a Changed"),
            });
        }
        out
    }

    /// The stream's message count, as the server reports it.
    async fn stream_count(&self) -> u64 {
        let mut stream = self.js.get_stream(&self.stream).await.expect("the stream");
        stream.info().await.expect("stream info").state.messages
    }

    /// Wait until `query` (a count) returns `want`, for at most 30 s.
    async fn until(&self, query: &str, want: i64) {
        let start = Instant::now();
        loop {
            let got = self.scalar(query).await;
            if got == want {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "{query}: {got}, waited for {want}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A relay running in the background until the guard stops it.
struct Running {
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), idem::outbox::RelayError>>,
}

impl Running {
    fn start<P: idem::outbox::Publisher>(relay: Relay<P>) -> Running {
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(relay.run(async move {
            let _ = stopped.await;
        }));
        Running {
            stop: Some(stop),
            task,
        }
    }

    async fn stop(mut self) {
        let _ = self.stop.take().expect("running").send(());
        self.task
            .await
            .expect("the relay task")
            .expect("the relay stopped cleanly");
    }
}

/// Bump the counter of `key` and emit its new value, in one attempt.
#[retryable(max = 50, deadline_ms = 60000)]
async fn change(conn: &mut AsyncPgConnection, key: &str) -> Result<EventId, AppError> {
    use diesel::sql_types::{BigInt, Text};
    use diesel_async::RunQueryDsl;

    #[derive(diesel::QueryableByName)]
    struct N {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    let row: N = diesel::sql_query(
        "INSERT INTO counters (key, n) VALUES ($1, 1)
         ON CONFLICT (key) DO UPDATE SET n = counters.n + 1 RETURNING n",
    )
    .bind::<Text, _>(key)
    .get_result(conn)
    .await?;
    Ok(emit(
        conn,
        &Changed {
            key: key.to_owned(),
            n: row.n,
        },
    )
    .await?)
}

/// Run `f` with a 60 s limit, so a stuck relay fails the test instead of
/// hanging it.
async fn bounded<F: Future>(f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(60), f)
        .await
        .expect("took more than 60 s")
}

/// Group stored messages by key, in stream order.
fn by_key(stored: &[Stored]) -> HashMap<String, Vec<&Stored>> {
    let mut keys: HashMap<String, Vec<&Stored>> = HashMap::new();
    for m in stored {
        keys.entry(m.key.clone()).or_default().push(m);
    }
    keys
}
