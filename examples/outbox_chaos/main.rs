//! The outbox and the inbox under fire: relays are `SIGKILL`ed mid-round and
//! the consumer at random, and still every event arrives once, in order.
//!
//! `cargo run --release --features nats --example outbox_chaos [-- --orders N
//! --relays N --kills N --consumer-kills N --seconds S --deadline S]`
//! (defaults 1000 orders, 3 relays, 6 relay kills, 2 consumer kills,
//! 20 s of writing, 85 s at most in all). PostgreSQL: `DATABASE_URL`, else
//! 127.0.0.1:5432, else a throwaway cluster; the example works in a fresh
//! database of its own, dropped at the end. NATS: `NATS_URL`, else
//! 127.0.0.1:4222 if it has JetStream, else a throwaway `nats-server -js`;
//! the example's stream is deleted at the end.
//!
//! * **Producer** (this process): writers drive each order through created →
//!   paid → shipped, one transaction per step (`#[idempotent]` for the
//!   creation, which every tenth order sends twice at once; `#[retryable]`
//!   for the others), each emitting its event with `idem::outbox::emit`.
//! * **Relays** (`--relay`, separate processes of this same binary): each
//!   runs `idem::outbox::Relay` into one JetStream stream, through a
//!   publisher that can stop dead at a chosen moment of its round: after
//!   claim, after publish, or after the whole round was acked but before
//!   mark-sent. It prints where it stopped; this process then kills it with
//!   `SIGKILL` (`Child::kill`), checks in the database that the event was
//!   leased and not sent, i.e. in flight, and starts a new relay in its slot.
//! * **Consumer** (`--consumer`, a separate process too): `Inbox::run` on a
//!   durable pull consumer, applying each event to its own tables in the
//!   transaction that records the message. It is killed too: every other
//!   time just after a message committed and before its ack (it handles
//!   messages by hand with `Inbox::handle` for that, and says when it got
//!   there), so that JetStream redelivers a message the inbox must skip;
//!   the other times at a set moment, wherever it is. The consumer allows one unacked
//!   message (`max_ack_pending = 1`): a message redelivered after a crash
//!   then comes before any later one, which per-key order needs.
//!
//! At the end every figure is read back from PostgreSQL and from the stream,
//! not from what the relays or the consumer say they did. The last line:
//! `events=.. published=.. lost=0 duplicate_effects=0 order_inversions=0
//! relay_kills=..`, where `events` counts the outbox rows emitted,
//! `published` the distinct event ids stored in the stream, `lost` the
//! events never applied by the consumer, `duplicate_effects` the applied-log
//! rows beyond one per event (that log has no unique constraint: only the
//! inbox keeps a redelivered event from being applied again),
//! `order_inversions` the events applied before their order's previous step,
//! and `relay_kills` the relays this process saw die of `SIGKILL`. The
//! process exits with 1 when a figure is wrong or fewer than 3 relays died.

#[path = "../common/mod.rs"]
mod common;

mod check;
mod consumer;
mod orders;
mod relay;
mod supervise;

use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::pull, consumer::AckPolicy, stream};
use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};
use idem::pool::{build_pool_with, PoolConfig};
use idem_testing::TestDatabase;

use relay::Stall;
use supervise::{Role, Supervisor};

/// What a child process is told on its command line.
pub struct ChildArgs {
    pub database: String,
    pub nats: String,
    pub stream: String,
    /// Where to stall, and after how long since the start.
    pub stall: Option<(Stall, Duration)>,
}

struct Args {
    orders: i64,
    relays: usize,
    kills: usize,
    consumer_kills: usize,
    seconds: u64,
    deadline: u64,
}

fn usage() -> ! {
    panic!("usage: [--orders N --relays N --kills N --consumer-kills N --seconds S --deadline S]")
}

fn parse_args(args: &[String]) -> Args {
    let mut parsed = Args {
        orders: 1000,
        relays: 3,
        kills: 6,
        consumer_kills: 2,
        seconds: 20,
        deadline: 85,
    };
    let mut it = args.iter();
    while let Some(name) = it.next() {
        let value = it.next().unwrap_or_else(|| usage());
        let number = || value.parse::<u64>().unwrap_or_else(|_| usage());
        match name.as_str() {
            "--orders" => parsed.orders = number() as i64,
            "--relays" => parsed.relays = number() as usize,
            "--kills" => parsed.kills = number() as usize,
            "--consumer-kills" => parsed.consumer_kills = number() as usize,
            "--seconds" => parsed.seconds = number(),
            "--deadline" => parsed.deadline = number(),
            _ => usage(),
        }
    }
    assert!(
        parsed.orders > 0 && parsed.relays > 0,
        "at least one order and one relay"
    );
    parsed
}

fn parse_child(args: &[String]) -> ChildArgs {
    let mut child = ChildArgs {
        database: String::new(),
        nats: String::new(),
        stream: String::new(),
        stall: None,
    };
    let (mut stall, mut after) = (None, Duration::ZERO);
    let mut it = args.iter();
    while let Some(name) = it.next() {
        let value = it.next().expect("a value").clone();
        match name.as_str() {
            "--database" => child.database = value,
            "--nats" => child.nats = value,
            "--stream" => child.stream = value,
            "--stall" => stall = Some(Stall::parse(&value).expect("claim, publish or mark")),
            "--stall-after-ms" => after = Duration::from_millis(value.parse().expect("millis")),
            other => panic!("unknown child argument {other}"),
        }
    }
    child.stall = stall.map(|s| (s, after));
    child
}

/// Resolves when stdin reaches its end: the parent closes a child's stdin
/// to stop it cleanly (and a dead parent closes it too).
pub async fn stdin_closed() {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
        let _ = tx.send(());
    });
    let _ = rx.await;
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("--relay") => relay::main(parse_child(&args[1..])).await,
        Some("--consumer") => consumer::main(parse_child(&args[1..])).await,
        _ => {
            let ok = run(parse_args(&args)).await;
            std::process::exit(if ok { 0 } else { 1 });
        }
    }
}

/// Which relay spawn stalls where, and when (since the run started): the
/// kills cycle through the three moments and are spread over the writing,
/// so each lands while events are being written and relayed.
fn stall_plan(kills: usize, span: Duration) -> Vec<(Stall, Duration)> {
    let moments = [Stall::Claim, Stall::Publish, Stall::Mark];
    let kills_u32 = u32::try_from(kills).unwrap_or(u32::MAX);
    (0..kills_u32)
        .map(|k| {
            (
                moments[k as usize % 3],
                span * (2 * k + 1) / (2 * kills_u32),
            )
        })
        .collect()
}

async fn run(args: Args) -> bool {
    let admin = common::database_url().await;
    let db = TestDatabase::create_on(&admin)
        .await
        .expect("a fresh database");
    let mut conn = AsyncPgConnection::establish(db.url())
        .await
        .expect("connect");
    idem::migrate(&mut conn).await.expect("migrate");
    conn.batch_execute(orders::SCHEMA).await.expect("schema");
    drop(conn);
    let client = idem_testing::connect(db.url())
        .await
        .expect("side connection");

    let nats = tokio::task::spawn_blocking(idem_testing::nats::url)
        .await
        .expect("no panic")
        .expect("a NATS server with JetStream");
    let js = jetstream::new(async_nats::connect(&nats).await.expect("connect to NATS"));
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_nanos();
    let stream = format!("OUTBOX_CHAOS_{}_{nanos}", std::process::id());
    js.create_stream(stream::Config {
        name: stream.clone(),
        subjects: vec![format!("{stream}.>")],
        // Longer than the relays' horizon (lease + backoff), which their
        // publisher checks at start-up.
        duplicate_window: Duration::from_secs(120),
        storage: stream::StorageType::Memory,
        ..Default::default()
    })
    .await
    .expect("create the stream");
    js.get_stream(&stream)
        .await
        .expect("the stream")
        .create_consumer(pull::Config {
            durable_name: Some(consumer::NAME.to_owned()),
            ack_policy: AckPolicy::Explicit,
            // A killed consumer's message comes back after this.
            ack_wait: Duration::from_secs(2),
            max_ack_pending: 1,
            ..Default::default()
        })
        .await
        .expect("the durable consumer");

    println!(
        "orders={} events_expected={} relays={} writers=8 writing_for={}s lease={:?} stream={stream}",
        args.orders,
        args.orders * orders::STEPS.len() as i64,
        args.relays,
        args.seconds,
        relay::LEASE
    );
    let span = Duration::from_secs(args.seconds);
    let consumer_kills = u32::try_from(args.consumer_kills).unwrap_or(u32::MAX);
    let consumer_kill_times: Vec<Duration> = (1..=consumer_kills)
        .map(|k| span * k / (consumer_kills + 1))
        .collect();
    let mut sup = Supervisor::new(
        ChildArgs {
            database: db.url().to_owned(),
            nats: nats.clone(),
            stream: stream.clone(),
            stall: None,
        },
        stall_plan(args.kills, span),
        consumer_kill_times,
    );
    sup.spawn(Role::Consumer, 0);
    for slot in 0..args.relays {
        sup.spawn(Role::Relay, slot);
    }

    let pool = build_pool_with(
        db.url(),
        &PoolConfig {
            max_size: 8,
            wait_timeout: Duration::from_secs(30),
            ..PoolConfig::default()
        },
    )
    .expect("producer pool");
    let mut producer = Some(tokio::spawn(orders::produce(pool, args.orders, 8, span)));
    let expected = args.orders * orders::STEPS.len() as i64;
    let start = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    let mut producer_ok = true;
    loop {
        tokio::select! {
            Some(line) = sup.lines.recv() => sup.on_line(line, &client).await,
            _ = tick.tick() => {
                if sup.timed_consumer_kill_due() {
                    sup.kill_consumer(None, false);
                }
                sup.respawn_exited();
                if producer.as_ref().is_some_and(|p| p.is_finished()) {
                    let result = producer.take().expect("running").await.expect("no panic");
                    if let Err(e) = result {
                        eprintln!("a writer failed: {e}");
                        producer_ok = false;
                    }
                    println!("writers done after {:.1} s", start.elapsed().as_secs_f64());
                }
                // Done when every event is applied and marked sent: an event
                // a relay published but died before marking is applied long
                // before its lease lets another relay mark it.
                let progress = client
                    .query_one(
                        "SELECT (SELECT count(DISTINCT (order_id, step)) FROM chaos_applied),
                                (SELECT count(*) FROM idem_outbox WHERE state <> 'sent')",
                        &[],
                    )
                    .await
                    .expect("count applied and unsent");
                let (applied, unsent): (i64, i64) = (progress.get(0), progress.get(1));
                if producer.is_none() && applied >= expected && unsent == 0 {
                    println!("all events applied and marked sent after {:.1} s", start.elapsed().as_secs_f64());
                    break;
                }
                if start.elapsed() > Duration::from_secs(args.deadline) {
                    println!("deadline of {} s reached with {applied} of {expected} events applied", args.deadline);
                    break;
                }
            }
        }
    }
    if let Some(p) = producer {
        p.abort();
    }
    sup.stop_all();

    let figures = check::read(&client, &js, &stream, expected).await;
    let kills_ok = sup.report_kills(&client, &figures).await;
    let ok = figures.print() && kills_ok && producer_ok && sup.unexpected_exits == 0;
    println!(
        "events={} published={} lost={} duplicate_effects={} order_inversions={} relay_kills={}",
        figures.events,
        figures.published,
        figures.lost,
        figures.duplicate_effects,
        figures.order_inversions,
        sup.relay_kills.len()
    );
    let _ = js.delete_stream(&stream).await;
    drop(client);
    drop(db);
    ok && sup.relay_kills.len() >= 3
}
