//! The inbox against a real PostgreSQL and a real JetStream: what happened is
//! read from the database (effect rows, `idem_inbox` records) and from the
//! broker (the consumer's pending counts), never from the inbox's report
//! alone.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::{pull, AckPolicy, PullConsumer};
use async_nats::jetstream::{self, AckKind};
use diesel::sql_types::Text;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use futures_util::StreamExt;
use idem::inbox::{Inbox, InboxConfig, InboxError, Outcome, RunError, RunReport};
use idem::pool::{build_pool_with, PoolConfig};
use idem::Pool;
use idem_testing::nats::TestStream;
use idem_testing::TestDatabase;
use scoped_futures::{ScopedBoxFuture, ScopedFutureExt};

mod attack_inbox;
mod attack_inbox2;
mod poison;
mod redelivery;
mod retention;
mod reused_key;

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] idem::Error),
    #[error(transparent)]
    Db(#[from] diesel::result::Error),
    #[error("refused: {0}")]
    Refused(String),
}

const SCHEMA: &str = "CREATE TABLE effects (body text NOT NULL)";

struct Env {
    pool: Pool,
    client: tokio_postgres::Client,
    js: jetstream::Context,
    stream: TestStream,
    _db: TestDatabase,
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
    let pool = build_pool_with(
        db.url(),
        &PoolConfig {
            max_size: 4,
            wait_timeout: Duration::from_secs(30),
            ..PoolConfig::default()
        },
    )
    .expect("pool");
    let client = idem_testing::connect(db.url())
        .await
        .expect("side connection");
    let js = idem_testing::nats::jetstream().await.expect("jetstream");
    let stream = TestStream::create(&js, "inbox").await.expect("stream");
    Env {
        pool,
        client,
        js,
        stream,
        _db: db,
    }
}

impl Env {
    /// A durable pull consumer of the test's stream, explicit acks, whose
    /// unacknowledged deliveries come back after `ack_wait`.
    async fn consumer(&self, name: &str, ack_wait: Duration) -> PullConsumer {
        self.stream
            .stream()
            .create_consumer(pull::Config {
                durable_name: Some(name.to_owned()),
                ack_policy: AckPolicy::Explicit,
                ack_wait,
                ..Default::default()
            })
            .await
            .expect("consumer")
    }

    async fn publish(&self, msg_id: &str, body: &str) {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", msg_id);
        self.js
            .publish_with_headers(
                self.stream.subject().to_owned(),
                headers,
                body.to_owned().into(),
            )
            .await
            .expect("publish")
            .await
            .expect("stored by the stream");
    }

    async fn effect_bodies(&self) -> Vec<String> {
        self.client
            .query("SELECT body FROM effects ORDER BY body", &[])
            .await
            .expect("effects")
            .iter()
            .map(|row| row.get(0))
            .collect()
    }

    /// `(state, deliveries)` of a message's record, if any.
    async fn record(&self, consumer: &str, msg_id: &str) -> Option<(String, i64)> {
        self.client
            .query_opt(
                "SELECT state, deliveries FROM idem_inbox WHERE consumer = $1 AND msg_id = $2",
                &[&consumer, &msg_id],
            )
            .await
            .expect("record")
            .map(|row| (row.get(0), row.get(1)))
    }

    /// Run the inbox's loop until the broker says every message of the
    /// consumer is settled (none pending, none awaiting an ack).
    async fn run_until_settled<F>(
        &self,
        inbox: &Inbox,
        consumer: &PullConsumer,
        effect: F,
    ) -> RunReport
    where
        F: for<'c> FnMut(
                &'c mut AsyncPgConnection,
                &'c [u8],
            ) -> ScopedBoxFuture<'static, 'c, Result<(), AppError>>
            + Send,
    {
        let mut watched = consumer.clone();
        let settled = async move {
            let started = Instant::now();
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let info = watched.info().await.expect("consumer info");
                if info.num_pending == 0 && info.num_ack_pending == 0 {
                    return;
                }
                assert!(
                    started.elapsed() < Duration::from_secs(30),
                    "consumer never settled: {info:?}"
                );
            }
        };
        inbox.run(consumer, settled, effect).await.expect("run")
    }
}

/// Record the payload in `effects`.
fn record_body<'c>(
    conn: &'c mut AsyncPgConnection,
    payload: &'c [u8],
) -> ScopedBoxFuture<'static, 'c, Result<(), AppError>> {
    async move {
        let body = String::from_utf8_lossy(payload).into_owned();
        diesel::sql_query("INSERT INTO effects (body) VALUES ($1)")
            .bind::<Text, _>(body)
            .execute(conn)
            .await?;
        Ok(())
    }
    .scope_boxed()
}

/// Pull one delivery by hand, as a consumer that crashes would have it.
async fn fetch_one(consumer: &PullConsumer) -> jetstream::Message {
    let mut batch = consumer
        .fetch()
        .max_messages(1)
        .expires(Duration::from_secs(5))
        .messages()
        .await
        .expect("fetch");
    batch.next().await.expect("a message").expect("delivered")
}

fn delivered(message: &jetstream::Message) -> u64 {
    message.info().expect("jetstream metadata").delivered as u64
}

/// Pins a closure to the effect's signature, which inference does not find
/// by itself for a closure taking two borrowed arguments.
fn effect<F>(f: F) -> F
where
    F: for<'c> FnMut(
            &'c mut AsyncPgConnection,
            &'c [u8],
        ) -> ScopedBoxFuture<'static, 'c, Result<(), AppError>>
        + Send,
{
    f
}

/// An effect that always fails with `Refused`.
fn refuse<'c>(
    _conn: &'c mut AsyncPgConnection,
    _payload: &'c [u8],
) -> ScopedBoxFuture<'static, 'c, Result<(), AppError>> {
    async move { Err(AppError::Refused("no".into())) }.scope_boxed()
}
