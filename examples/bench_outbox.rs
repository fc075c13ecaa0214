//! What one outbox relay sustains, and how long an event waits between its
//! commit and the broker's ack.
//!
//! `cargo run --release --features nats --example bench_outbox [-- --events N
//! --keys N --rounds N --batches 100,1000 --paced N --rate N]` (defaults
//! 20 000 events over 2000 keys, 3 rounds, relay batch sizes 100 and 1000,
//! then 2000 paced events at 200/s). PostgreSQL: `DATABASE_URL`, else
//! 127.0.0.1:5432, else a throwaway cluster, in a fresh database of its own;
//! NATS: `NATS_URL`, else 127.0.0.1:4222 with JetStream, else a throwaway
//! `nats-server -js`, into a file-storage stream deleted at the end.
//!
//! * **Throughput.** `--events` events over `--keys` keys are committed
//!   first (by 4 writers, 100 per transaction, under `#[retryable]`, each
//!   with `idem::outbox::emit`), then one `Relay` publishes them all. The rate is
//!   events / (last `sent_at` in `idem_outbox` − the first publish call),
//!   so start-up and the final idle wait do not count. Each batch size of
//!   `--batches` runs once per round, the order rotating between rounds so
//!   drift on a shared machine hits all alike; the median is reported.
//! * **Latency.** With the relay at its defaults (batch 100, `LISTEN` on,
//!   poll 1 s) idle, `--paced` events are committed one per transaction at
//!   `--rate` per second over `--keys` keys. Commit time is when the
//!   `#[retryable]` call returned (the `COMMIT` was answered); ack time is
//!   when `NatsPublisher::publish` returned (JetStream's publish ack), taken
//!   by a wrapping `Publisher` in the same process and clock.
//!
//! The last line is machine-readable: `events_per_s=..
//! commit_to_ack_p50_ms=.. commit_to_ack_p99_ms=..`, where `events_per_s` is
//! the median of the batch size that did best (named on the line above).

#[path = "common/mod.rs"]
mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::{self, stream};
use diesel_async::{AsyncConnection, AsyncPgConnection};
use idem::outbox::{
    emit, EmitError, Event, EventId, NatsPublisher, OutboxMessage, PublishError, Published,
    Publisher, Relay,
};
use idem::pool::{build_pool_with, PoolConfig};
use idem::{retryable, Pool};
use idem_testing::TestDatabase;
use serde::Serialize;
use tokio::sync::oneshot;

#[derive(Debug, Serialize)]
struct Tick {
    key: i64,
    n: i64,
}

impl Event for Tick {
    const KIND: &'static str = "tick";
    const VERSION: u32 = 1;
    fn key(&self) -> String {
        format!("k{}", self.key)
    }
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] idem::Error),
    #[error(transparent)]
    Emit(#[from] EmitError),
}

/// Commit `ticks` in one transaction; returns their ids.
#[retryable(max = 8, deadline_ms = 60000)]
async fn commit(conn: &mut AsyncPgConnection, ticks: &[Tick]) -> Result<Vec<EventId>, AppError> {
    let mut ids = Vec::with_capacity(ticks.len());
    for tick in ticks {
        ids.push(emit(conn, tick).await?);
    }
    Ok(ids)
}

/// The real publisher, noting when the first publish was called and when
/// each publish was acked.
struct Timed {
    inner: NatsPublisher,
    first_call: Mutex<Option<SystemTime>>,
    acked: Arc<Mutex<HashMap<EventId, Instant>>>,
}

impl Publisher for Timed {
    async fn publish(&self, message: &OutboxMessage) -> Result<Published, PublishError> {
        self.first_call
            .lock()
            .expect("not poisoned")
            .get_or_insert_with(SystemTime::now);
        let published = self.inner.publish(message).await?;
        self.acked
            .lock()
            .expect("not poisoned")
            .insert(message.id, Instant::now());
        Ok(published)
    }

    async fn prepare(
        &self,
        horizon: idem::outbox::Horizon,
    ) -> Result<(), idem::outbox::PrepareError> {
        self.inner.prepare(horizon).await
    }
}

struct Args {
    events: i64,
    keys: i64,
    rounds: usize,
    batches: Vec<u32>,
    paced: i64,
    rate: u32,
}

fn parse_args() -> Args {
    let mut args = Args {
        events: 20_000,
        keys: 2000,
        rounds: 3,
        batches: vec![100, 1000],
        paced: 2000,
        rate: 200,
    };
    let usage = "usage: [--events N --keys N --rounds N --batches A,B,.. --paced N --rate N]";
    let mut it = std::env::args().skip(1);
    while let Some(name) = it.next() {
        let value = it.next().unwrap_or_else(|| panic!("{usage}"));
        let number = || {
            value
                .parse::<i64>()
                .ok()
                .filter(|n| *n > 0)
                .unwrap_or_else(|| panic!("{usage}"))
        };
        match name.as_str() {
            "--events" => args.events = number(),
            "--keys" => args.keys = number(),
            "--rounds" => args.rounds = number() as usize,
            "--paced" => args.paced = number(),
            "--rate" => args.rate = number() as u32,
            "--batches" => {
                args.batches = value
                    .split(',')
                    .map(|b| b.parse().unwrap_or_else(|_| panic!("{usage}")))
                    .collect();
            }
            _ => panic!("{usage}"),
        }
    }
    args
}

struct Bench {
    pool: Pool,
    client: tokio_postgres::Client,
    js: jetstream::Context,
    stream: String,
}

impl Bench {
    fn publisher(&self, acked: Arc<Mutex<HashMap<EventId, Instant>>>) -> Timed {
        Timed {
            inner: NatsPublisher::new(self.js.clone(), &self.stream).subject_prefix(&self.stream),
            first_call: Mutex::new(None),
            acked,
        }
    }

    /// An empty outbox and stream.
    async fn reset(&self) {
        self.client
            .batch_execute("TRUNCATE idem_outbox, idem_outbox_keys")
            .await
            .expect("truncate the outbox");
        self.js
            .get_stream(&self.stream)
            .await
            .expect("the stream")
            .purge()
            .await
            .expect("purge the stream");
    }

    async fn scalar_f64(&self, query: &str) -> f64 {
        self.client
            .query_one(query, &[])
            .await
            .unwrap_or_else(|e| panic!("{query}: {e}"))
            .get(0)
    }

    async fn unsent(&self) -> i64 {
        self.client
            .query_one(
                "SELECT count(*) FROM idem_outbox WHERE state <> 'sent'",
                &[],
            )
            .await
            .expect("count unsent")
            .get(0)
    }

    async fn stored(&self) -> u64 {
        let mut stream = self.js.get_stream(&self.stream).await.expect("the stream");
        stream.info().await.expect("stream info").state.messages
    }

    /// Commit `events` events over `keys` keys, 100 per transaction.
    async fn fill(&self, events: i64, keys: i64) -> Duration {
        let started = Instant::now();
        // Writers at once, each with keys of its own: they never wait on
        // one another's key locks, and each key's events commit in order.
        const WRITERS: i64 = 4;
        let writers: Vec<_> = (0..WRITERS)
            .map(|w| {
                let pool = self.pool.clone();
                tokio::spawn(async move {
                    let ticks: Vec<Tick> = (0..events)
                        .filter(|n| (n % keys) % WRITERS == w)
                        .map(|n| Tick { key: n % keys, n })
                        .collect();
                    for chunk in ticks.chunks(100) {
                        commit(&pool, chunk)
                            .await
                            .expect("commit a batch of events");
                    }
                })
            })
            .collect();
        for writer in writers {
            writer.await.expect("no panic");
        }
        // The planner sees the table as it is now, as autovacuum would
        // have it after a while, not as the empty table it truncated.
        self.client
            .batch_execute("ANALYZE idem_outbox, idem_outbox_keys")
            .await
            .expect("analyze");
        started.elapsed()
    }

    /// Fill, then let one relay with `batch` publish everything: events/s
    /// from the first publish call to the last mark-sent.
    async fn throughput(&self, events: i64, keys: i64, batch: u32) -> (f64, Duration) {
        self.reset().await;
        let filled = self.fill(events, keys).await;
        let publisher = Arc::new(self.publisher(Arc::default()));
        let running = Running::start(
            Relay::new(self.pool.clone(), SharedPublisher(Arc::clone(&publisher)))
                .batch_size(batch),
        );
        let started = Instant::now();
        while self.unsent().await > 0 {
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "the relay stalled"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        running.stop().await;
        assert_eq!(self.stored().await, events as u64, "each event stored once");
        let first = publisher
            .first_call
            .lock()
            .expect("not poisoned")
            .expect("something was published")
            .duration_since(UNIX_EPOCH)
            .expect("clock")
            .as_secs_f64();
        let last = self
            .scalar_f64("SELECT extract(epoch FROM max(sent_at))::float8 FROM idem_outbox")
            .await;
        (events as f64 / (last - first), filled)
    }

    /// Commit `paced` events one per transaction at `rate`/s while an idle
    /// relay at its defaults publishes them; commit→ack in ms, sorted.
    async fn latency(&self, paced: i64, keys: i64, rate: u32) -> Vec<f64> {
        self.reset().await;
        let acked: Arc<Mutex<HashMap<EventId, Instant>>> = Arc::default();
        let running = Running::start(Relay::new(
            self.pool.clone(),
            SharedPublisher(Arc::new(self.publisher(Arc::clone(&acked)))),
        ));
        // The relay checks the stream and starts listening before the first
        // commit, as a long-running relay would have.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let mut pace = tokio::time::interval(Duration::from_secs(1) / rate);
        pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut committed = Vec::with_capacity(paced as usize);
        for n in 0..paced {
            pace.tick().await;
            let ids = commit(&self.pool, &[Tick { key: n % keys, n }])
                .await
                .expect("commit");
            committed.push((ids[0], Instant::now()));
        }
        let started = Instant::now();
        while self.unsent().await > 0 {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "the relay stalled"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        running.stop().await;
        let acked = acked.lock().expect("not poisoned");
        let mut ms: Vec<f64> = committed
            .iter()
            .map(|(id, at)| {
                let ack = acked.get(id).expect("every event acked");
                // The relay can be woken by the NOTIFY and publish before
                // the writer has read the COMMIT's answer: negative then.
                match ack.checked_duration_since(*at) {
                    Some(d) => d.as_secs_f64() * 1e3,
                    None => -(at.duration_since(*ack).as_secs_f64() * 1e3),
                }
            })
            .collect();
        ms.sort_by(f64::total_cmp);
        ms
    }
}

/// `Relay::new` takes the publisher by value; the bench reads its clocks
/// afterwards through this shared handle.
struct SharedPublisher(Arc<Timed>);

impl Publisher for SharedPublisher {
    async fn publish(&self, message: &OutboxMessage) -> Result<Published, PublishError> {
        self.0.publish(message).await
    }
    async fn prepare(
        &self,
        horizon: idem::outbox::Horizon,
    ) -> Result<(), idem::outbox::PrepareError> {
        self.0.prepare(horizon).await
    }
}

/// A relay running in the background until stopped.
struct Running {
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), idem::outbox::RelayError>>,
}

impl Running {
    fn start<P: Publisher>(relay: Relay<P>) -> Running {
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(relay.run(async move {
            let _ = stopped.await;
        }));
        Running { stop, task }
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.expect("no panic").expect("the relay ran");
    }
}

/// Nearest-rank percentile of sorted samples.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

#[tokio::main]
async fn main() {
    let args = parse_args();
    let admin = common::database_url().await;
    let db = TestDatabase::create_on(&admin)
        .await
        .expect("a fresh database");
    let mut conn = AsyncPgConnection::establish(db.url())
        .await
        .expect("connect");
    idem::migrate(&mut conn).await.expect("migrate");
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
    let nats = tokio::task::spawn_blocking(idem_testing::nats::url)
        .await
        .expect("no panic")
        .expect("a NATS server with JetStream");
    let js = jetstream::new(async_nats::connect(&nats).await.expect("connect to NATS"));
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_nanos();
    let stream = format!("BENCH_OUTBOX_{}_{nanos}", std::process::id());
    js.create_stream(stream::Config {
        name: stream.clone(),
        subjects: vec![format!("{stream}.>")],
        storage: stream::StorageType::File,
        ..Default::default()
    })
    .await
    .expect("create the stream");
    let bench = Bench {
        pool,
        client,
        js,
        stream,
    };

    println!(
        "throughput: {} events over {} keys, committed first; one relay; {} rounds, batch sizes interleaved",
        args.events, args.keys, args.rounds
    );
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); args.batches.len()];
    for round in 0..args.rounds {
        for slot in 0..args.batches.len() {
            let which = (round + slot) % args.batches.len();
            let (rate, filled) = bench
                .throughput(args.events, args.keys, args.batches[which])
                .await;
            println!(
                "  round {} batch {:>5}: {rate:>8.0} events/s (committing the events took {:.1} s)",
                round + 1,
                args.batches[which],
                filled.as_secs_f64()
            );
            rates[which].push(rate);
        }
    }
    let mut best = (0, 0.0);
    for (which, samples) in rates.iter_mut().enumerate() {
        samples.sort_by(f64::total_cmp);
        let median = percentile(samples, 0.5);
        println!(
            "batch {:>5}: median {median:.0} events/s",
            args.batches[which]
        );
        if median > best.1 {
            best = (which, median);
        }
    }

    println!(
        "latency: {} events at {}/s, one per transaction, relay at its defaults (batch 100, LISTEN, poll 1 s)",
        args.paced, args.rate
    );
    let ms = bench.latency(args.paced, args.keys, args.rate).await;
    let (p50, p90, p99) = (
        percentile(&ms, 0.5),
        percentile(&ms, 0.9),
        percentile(&ms, 0.99),
    );
    println!(
        "commit→ack ms: min {:.2} p50 {p50:.2} p90 {p90:.2} p99 {p99:.2} max {:.2}",
        ms[0],
        ms[ms.len() - 1]
    );
    let _ = bench.js.delete_stream(&bench.stream).await;
    drop(bench);
    drop(db);
    println!(
        "events_per_s below is batch {}'s median; the relay's default batch is 100",
        args.batches[best.0]
    );
    println!(
        "events_per_s={:.0} commit_to_ack_p50_ms={p50:.2} commit_to_ack_p99_ms={p99:.2}",
        best.1
    );
}
