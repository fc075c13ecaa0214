//! One run: the pair, the cluster, the service's clients, the relay, the
//! consumer and the chaos, then the resend of every key, the settling and
//! the count.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::pull, consumer::AckPolicy, consumer::PullConsumer};
use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};
use idem::inbox::{Inbox, InboxConfig};
use idem::outbox::{NatsPublisher, Relay};
use idem::pool::{build_pool_with, PoolConfig, Replication};
use idem::Pool;
use idem_testing::nats_cluster::NatsCluster;
use idem_testing::replica::{self, ReplicaPair};
use scoped_futures::ScopedFutureExt;
use tokio::sync::watch;

use crate::count::{self, Figures};
use crate::payments::{self, key_of, pay, AppError, PaymentCmd};

// The faults, in a file of their own: next to this one, whether the example
// or tests/failover.rs includes it.
#[path = "chaos.rs"]
mod chaos;
use chaos::*;

const DATABASE: &str = "failover";
pub const STREAM: &str = "FAILOVER";
const SUBJECTS: &str = "failover.>";
const SUBJECT_PREFIX: &str = "failover";

/// The relay's wait for a publish ack, and its lease (longer, as `Relay`
/// requires): an event whose round a failover broke goes out again after
/// the lease.
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(3);
const LEASE: Duration = Duration::from_secs(8);
/// A client sends a key again until this has passed since its first send;
/// a key still failing then is left to the final resend.
const CLIENT_BUDGET: Duration = Duration::from_secs(45);
/// The consumer's loop is started again when the consumer has messages
/// for it and it applied none for this long (its pull request may have
/// died with a server).
const CONSUMER_STALL: Duration = Duration::from_secs(8);
/// The bound of each wait on the harness.
const WAIT: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// A synchronous standby, `Replication::Synchronous` pools.
    Sync,
    /// An asynchronous standby, `Replication::Single` pools.
    // tests/failover.rs runs the synchronous pair only.
    #[allow(dead_code)]
    Async,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Sync => "sync",
            Mode::Async => "async",
        }
    }
}

pub struct Config {
    pub mode: Mode,
    /// How long the clients send new keys, over which the chaos is spread.
    pub seconds: u64,
    pub payments: usize,
    pub clients: usize,
    pub failovers: usize,
    pub leader_kills: usize,
    /// At most this long for the relay and the consumer to settle after the resend.
    pub settle: u64,
    /// Before each kill of the primary, its WAL sender is stopped this long,
    /// so the standby is this far behind when the primary dies (0: the
    /// loopback's own lag, microseconds).
    pub lag_ms: u64,
}

pub struct Report {
    pub mode: Mode,
    pub failovers: usize,
    pub leader_kills: usize,
    pub chaos_errors: Vec<String>,
    pub figures: Figures,
}

impl Report {
    /// The last line of the example.
    pub fn line(&self) -> String {
        let f = &self.figures;
        format!(
            "mode={} failovers={} nats_leader_kills={} acknowledged={} lost_acknowledged={} \
             duplicate_effects={} ghost_events={} lost_events={}",
            self.mode.name(),
            self.failovers,
            self.leader_kills,
            f.acknowledged,
            f.lost_acknowledged,
            f.duplicate_effects,
            f.ghost_events,
            f.lost_events
        )
    }
}

/// What the clients were answered, kept by the client: the database may
/// lose it.
#[derive(Default)]
struct Acks {
    /// Every payment id a call for the key returned `Ok` with (fresh or replay).
    ids: Mutex<HashMap<String, HashSet<String>>>,
    calls: AtomicU64,
    fresh: AtomicU64,
    replays: AtomicU64,
    commit_unknown: AtomicU64,
    other_errors: AtomicU64,
    gave_up: AtomicU64,
    /// A few error texts, for the log.
    samples: Mutex<Vec<String>>,
}

impl Acks {
    fn note_error(&self, e: &AppError) {
        if matches!(e, AppError::Idem(idem::Error::CommitUnknown { .. })) {
            self.commit_unknown.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.other_errors.fetch_add(1, Ordering::Relaxed);
        let text = e.to_string();
        let head: String = text.chars().take(60).collect();
        let mut samples = self.samples.lock().expect("not poisoned");
        if samples.len() < 8 && !samples.iter().any(|s| s.starts_with(&head)) {
            samples.push(text.chars().take(200).collect());
        }
    }
}

/// Sends payment `n` until a call returns `Ok` (recorded) or `budget`
/// runs out, with the same key each time and a bounded backoff, as a
/// client of a service answering 503 would. Returns whether the `Ok` was a
/// replay.
async fn send(pool: &Pool, acks: &Acks, n: usize, budget: Duration) -> Option<bool> {
    let cmd = PaymentCmd::new(n);
    let start = Instant::now();
    let mut pause = Duration::from_millis(50);
    loop {
        acks.calls.fetch_add(1, Ordering::Relaxed);
        match pay(pool, &cmd).await {
            Ok(done) => {
                let counter = if done.replayed {
                    &acks.replays
                } else {
                    &acks.fresh
                };
                counter.fetch_add(1, Ordering::Relaxed);
                acks.ids
                    .lock()
                    .expect("not poisoned")
                    .entry(cmd.key)
                    .or_default()
                    .insert(done.value);
                return Some(done.replayed);
            }
            Err(e) => {
                acks.note_error(&e);
                if start.elapsed() >= budget {
                    acks.gave_up.fetch_add(1, Ordering::Relaxed);
                    return None;
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(1));
            }
        }
    }
}

/// Client `c` of `clients`: its share of the keys, paced by `tick`; every
/// fourth key is sent twice at once, and every fifth key is sent again
/// five keys later. No new key is started after `until`.
async fn client(
    pool: Pool,
    acks: Arc<Acks>,
    c: usize,
    clients: usize,
    payments: usize,
    tick: Duration,
    until: Instant,
) {
    let mut pace = tokio::time::interval(tick);
    pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    for (i, n) in (c..payments).step_by(clients).enumerate() {
        pace.tick().await;
        if Instant::now() >= until {
            return;
        }
        if n % 4 == 0 {
            tokio::join!(
                send(&pool, &acks, n, CLIENT_BUDGET),
                send(&pool, &acks, n, CLIENT_BUDGET)
            );
        } else {
            send(&pool, &acks, n, CLIENT_BUDGET).await;
        }
        if i >= 5 && i % 5 == 0 {
            send(&pool, &acks, n - 5 * clients, CLIENT_BUDGET).await;
        }
    }
}

async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// The relay, restarted if it stops at start-up (the stream unreachable).
async fn relay(pool: Pool, urls: Vec<String>, stop: watch::Receiver<bool>) {
    let client = async_nats::connect(urls)
        .await
        .expect("the relay connects to NATS");
    loop {
        let js = jetstream::context::ContextBuilder::new()
            .timeout(PUBLISH_TIMEOUT)
            .build(client.clone());
        let publisher = NatsPublisher::new(js, STREAM).subject_prefix(SUBJECT_PREFIX);
        let ran = Relay::new(pool.clone(), publisher)
            .poll_interval(Duration::from_millis(200))
            .lease(LEASE)
            .run(stopped(stop.clone()))
            .await;
        match ran {
            Ok(()) => return,
            Err(e) => {
                eprintln!("relay: {e}; starting it again");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

/// The consumer: `Inbox::run` on the durable consumer, started again when
/// it stops with an error or stalls; returns how many times it was.
async fn consume(pool: Pool, urls: Vec<String>, stop: watch::Receiver<bool>) -> u64 {
    let js = jetstream::new(
        async_nats::connect(urls)
            .await
            .expect("the consumer connects to NATS"),
    );
    let inbox = Inbox::new(pool, payments::CONSUMER, InboxConfig::new()).expect("an inbox");
    let progress = Arc::new(AtomicU64::new(0));
    let mut restarts = 0;
    while !*stop.borrow() {
        let consumer: PullConsumer = match js.get_stream(STREAM).await {
            Ok(stream) => match stream
                .get_consumer::<pull::Config>(payments::CONSUMER)
                .await
            {
                Ok(consumer) => consumer,
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    continue;
                }
            },
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        let seen = Arc::clone(&progress);
        let until = async {
            tokio::select! {
                () = stopped(stop.clone()) => {}
                () = stalled(&consumer, &progress) => eprintln!("consumer: stalled; pulling again"),
            }
        };
        let ran = inbox
            .run(&consumer, until, move |conn, payload| {
                seen.fetch_add(1, Ordering::Relaxed);
                payments::apply(conn, payload).scope_boxed()
            })
            .await;
        if *stop.borrow() {
            break;
        }
        restarts += 1;
        if let Err(e) = ran {
            eprintln!("consumer: {e}; pulling again");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    restarts
}

/// Resolves once the consumer has messages waiting (or unacked) and
/// `progress` has not moved for [`CONSUMER_STALL`].
async fn stalled(consumer: &PullConsumer, progress: &AtomicU64) {
    let mut consumer = consumer.clone();
    let mut last = (progress.load(Ordering::Relaxed), Instant::now());
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = progress.load(Ordering::Relaxed);
        if now != last.0 {
            last = (now, Instant::now());
            continue;
        }
        if last.1.elapsed() < CONSUMER_STALL {
            continue;
        }
        if let Ok(info) = consumer.info().await {
            if info.num_pending > 0 || info.num_ack_pending > 0 {
                return;
            }
        }
    }
}

fn pool(url: &str, max_size: usize, mode: Mode) -> Pool {
    build_pool_with(
        url,
        &PoolConfig {
            max_size,
            wait_timeout: Duration::from_secs(5),
            replication: match mode {
                Mode::Sync => Replication::Synchronous,
                Mode::Async => Replication::Single,
            },
            ..PoolConfig::default()
        },
    )
    .expect("a pool")
}

/// Counts the payments without an applied effect and the events not sent,
/// on the primary.
async fn backlog(url: &str) -> Option<(i64, i64)> {
    let client = idem_testing::connect(url).await.ok()?;
    let row = client
        .query_one(
            "SELECT (SELECT count(*) FROM failover_payments p WHERE NOT EXISTS
                        (SELECT 1 FROM failover_effects e WHERE e.payment_id = p.payment_id)),
                    (SELECT count(*) FROM idem_outbox WHERE state <> 'sent')",
            &[],
        )
        .await
        .ok()?;
    Some((row.get(0), row.get(1)))
}

pub async fn run(cfg: &Config) -> Report {
    let started = Instant::now();
    let pair = Arc::new(
        ReplicaPair::start(match cfg.mode {
            Mode::Sync => replica::Replication::Sync,
            Mode::Async => replica::Replication::Async,
        })
        .await
        .expect("a primary and a standby"),
    );
    let url = pair.create_database(DATABASE).await.expect("the database");
    let mut conn = AsyncPgConnection::establish(&pair.primary_url_for(DATABASE))
        .await
        .expect("connect to the primary");
    idem::migrate(&mut conn).await.expect("migrate");
    conn.batch_execute(payments::SCHEMA).await.expect("schema");
    drop(conn);
    pair.wait_caught_up(WAIT)
        .await
        .expect("the standby caught up");

    let cluster = Arc::new(NatsCluster::start().await.expect("a NATS cluster"));
    let js = jetstream::new(
        async_nats::connect(cluster.urls())
            .await
            .expect("connect to NATS"),
    );
    let stream = cluster
        .create_r3_stream(&js, STREAM, &[SUBJECTS])
        .await
        .expect("the R3 stream");
    stream
        .create_consumer(pull::Config {
            durable_name: Some(payments::CONSUMER.to_owned()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(5),
            ..Default::default()
        })
        .await
        .expect("the durable consumer");
    println!(
        "mode={} payments={} clients={} seconds={} failovers={} leader_kills={} lag_ms={} ready \
         after {:.1} s (primary {}, stream leader {})",
        cfg.mode.name(),
        cfg.payments,
        cfg.clients,
        cfg.seconds,
        cfg.failovers,
        cfg.leader_kills,
        cfg.lag_ms,
        started.elapsed().as_secs_f64(),
        pair.primary_name(),
        cluster
            .stream_leader(STREAM)
            .await
            .ok()
            .flatten()
            .unwrap_or_default()
    );

    let (stop_tx, stop) = watch::channel(false);
    let relay = tokio::spawn(relay(pool(&url, 3, cfg.mode), cluster.urls(), stop.clone()));
    let consumer = tokio::spawn(consume(pool(&url, 2, cfg.mode), cluster.urls(), stop));

    let pool = pool(&url, cfg.clients * 2, cfg.mode);
    let acks = Arc::new(Acks::default());
    let span = Duration::from_secs(cfg.seconds);
    let start = Instant::now();
    let per_client = cfg.payments.div_ceil(cfg.clients.max(1)).max(1);
    let tick = span / u32::try_from(per_client).unwrap_or(u32::MAX);
    let until = start + span * 2 + CLIENT_BUDGET;
    let clients: Vec<_> = (0..cfg.clients)
        .map(|c| {
            tokio::spawn(client(
                pool.clone(),
                Arc::clone(&acks),
                c,
                cfg.clients,
                cfg.payments,
                tick,
                until,
            ))
        })
        .collect();
    let chaos = tokio::spawn(chaos(
        Arc::clone(&pair),
        Arc::clone(&cluster),
        plan(cfg.failovers, cfg.leader_kills),
        span,
        Duration::from_millis(cfg.lag_ms),
        start,
    ));
    for c in clients {
        c.await.expect("a client panicked");
    }
    let chaos = chaos.await.expect("the chaos panicked");
    println!(
        "clients done after {:.1} s: calls={} ok_fresh={} ok_replayed={} commit_unknown={} \
         other_errors={} keys_given_up={}",
        start.elapsed().as_secs_f64(),
        acks.calls.load(Ordering::Relaxed),
        acks.fresh.load(Ordering::Relaxed),
        acks.replays.load(Ordering::Relaxed),
        acks.commit_unknown.load(Ordering::Relaxed),
        acks.other_errors.load(Ordering::Relaxed),
        acks.gave_up.load(Ordering::Relaxed),
    );
    for sample in acks.samples.lock().expect("not poisoned").iter() {
        println!("  error seen: {sample}");
    }

    // The resend: every key once more, now that the pair is whole again.
    if let Err(e) = pair.wait_caught_up(WAIT).await {
        eprintln!("the standby did not catch up: {e}");
    }
    let acked_before: HashMap<String, HashSet<String>> =
        acks.ids.lock().expect("not poisoned").clone();
    let resent = Arc::new(Mutex::new((0usize, 0usize, 0usize, 0usize)));
    let resenders: Vec<_> = (0..cfg.clients)
        .map(|c| {
            let (pool, acks, resent) = (pool.clone(), Arc::clone(&acks), Arc::clone(&resent));
            let acked_before: HashSet<String> = acked_before.keys().cloned().collect();
            let (clients, payments) = (cfg.clients, cfg.payments);
            tokio::spawn(async move {
                for n in (c..payments).step_by(clients) {
                    let outcome = send(&pool, &acks, n, CLIENT_BUDGET).await;
                    let mut r = resent.lock().expect("not poisoned");
                    match outcome {
                        Some(true) => r.0 += 1,
                        Some(false) if acked_before.contains(&key_of(n)) => r.2 += 1,
                        Some(false) => r.1 += 1,
                        None => r.3 += 1,
                    }
                }
            })
        })
        .collect();
    for r in resenders {
        r.await.expect("a resender panicked");
    }
    let (replayed, ran_once, ran_again, failed) = *resent.lock().expect("not poisoned");
    println!(
        "resend of every key: replayed={replayed} ran_once={ran_once} \
         ran_again_after_an_ack={ran_again} failed={failed}"
    );

    // Settling: every event sent and applied, or nothing moving any more.
    let settle_start = Instant::now();
    let mut last = (None, Instant::now());
    loop {
        let seen = backlog(&url).await;
        if seen == Some((0, 0)) {
            println!(
                "settled after {:.1} s",
                settle_start.elapsed().as_secs_f64()
            );
            break;
        }
        if seen != last.0 {
            last = (seen, Instant::now());
        } else if matches!(seen, Some((_, 0))) && last.1.elapsed() > Duration::from_secs(15) {
            println!(
                "nothing moved for 15 s: {seen:?} (payments without an effect, unsent events)"
            );
            break;
        }
        if settle_start.elapsed() > Duration::from_secs(cfg.settle) {
            println!(
                "not settled after {} s: {seen:?} (payments without an effect, unsent events)",
                cfg.settle
            );
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let _ = stop_tx.send(true);
    let _ = tokio::time::timeout(WAIT, relay).await;
    let consumer_restarts = tokio::time::timeout(WAIT, consumer)
        .await
        .ok()
        .and_then(Result::ok)
        .unwrap_or_default();
    println!("consumer loop restarts: {consumer_restarts}");

    let db = idem_testing::connect(&pair.primary_url_for(DATABASE))
        .await
        .expect("connect to the final primary");
    let acked = acks.ids.lock().expect("not poisoned").clone();
    let figures = count::read(&db, &js, STREAM, &acked).await;
    figures.print();
    Report {
        mode: cfg.mode,
        failovers: chaos.failovers,
        leader_kills: chaos.leader_kills,
        chaos_errors: chaos.errors,
        figures,
    }
}
