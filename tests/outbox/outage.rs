//! A broker that is down for a minute: with every default setting, the relay
//! waits it out without counting it against any event, no event dies, and it
//! catches up by itself when the broker is back.
//!
//! The outage is real, on a `nats-server` of this test's own (the machine's
//! shared server is never touched): first frozen (SIGSTOP: connected, no
//! answer) while events are published to it, then thawed, so the copies it
//! had unread are stored and the relay's republish under the same
//! `Nats-Msg-Id` must be deduplicated; then killed (SIGKILL) for a minute and
//! restarted on its port with its store directory kept, so clients reconnect
//! and the file-stored stream survives.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::Arc;

use idem::outbox::{Horizon, OutboxMessage, PrepareError, PublishError, Published, Publisher};
use idem_testing::nats::NatsServer;

use super::*;

/// Aggregates the writer cycles through.
const KEYS: usize = 200;
/// How long the broker stays down: the finding, with the defaults.
const OUTAGE: Duration = Duration::from_secs(60);
/// A writer's pause between two changes (about 50 events a second).
const WRITE_EVERY: Duration = Duration::from_millis(20);
/// How long the server stays frozen: past the JetStream ack timeout (5 s).
const FROZEN: Duration = Duration::from_secs(8);

/// The real publisher, counting duplicate acks and failures marked
/// unavailable: only to show which paths the outage took, never to judge
/// its outcome, which the database and the stream say.
struct Watched {
    inner: NatsPublisher,
    duplicates: Arc<AtomicUsize>,
    unavailable: Arc<AtomicUsize>,
}

impl Publisher for Watched {
    async fn publish(&self, message: &OutboxMessage) -> Result<Published, PublishError> {
        let result = self.inner.publish(message).await;
        match &result {
            Ok(published) if published.duplicate => {
                self.duplicates.fetch_add(1, Ordering::SeqCst);
            }
            Err(e) if e.is_unavailable() => {
                self.unavailable.fetch_add(1, Ordering::SeqCst);
            }
            _ => {}
        }
        result
    }

    async fn check(&self) -> Result<(), PublishError> {
        self.inner.check().await
    }

    async fn prepare(&self, horizon: Horizon) -> Result<(), PrepareError> {
        self.inner.prepare(horizon).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_minute_without_nats_kills_no_event_and_the_relay_catches_up() {
    let server = Arc::new(
        tokio::task::spawn_blocking(NatsServer::start)
            .await
            .expect("no panic")
            .expect("a throwaway nats-server"),
    );
    let env = outage_env(server.url()).await;
    let window = env
        .js
        .get_stream(&env.stream)
        .await
        .expect("the stream")
        .cached_info()
        .config
        .duplicate_window;
    assert_eq!(
        window,
        Duration::from_secs(120),
        "the stream has JetStream's default duplicate window"
    );
    let duplicates = Arc::new(AtomicUsize::new(0));
    let unavailable = Arc::new(AtomicUsize::new(0));
    let publisher = Watched {
        inner: NatsPublisher::new(
            jetstream::new(
                async_nats::connect(server.url())
                    .await
                    .expect("connect to NATS"),
            ),
            &env.stream,
        )
        .subject_prefix(&env.stream),
        duplicates: duplicates.clone(),
        unavailable: unavailable.clone(),
    };
    // Every relay setting at its default: that is what the promise is about.
    let running = Running::start(Relay::new(env.pool.clone(), publisher));

    // A writer that never stops for the outage: events keep being committed
    // before, during and after it.
    let writing = Arc::new(AtomicBool::new(true));
    let writer = {
        let pool = env.pool.clone();
        let writing = writing.clone();
        tokio::spawn(async move {
            let mut n = 0_usize;
            while writing.load(Ordering::SeqCst) {
                change(&pool, &format!("k{}", n % KEYS))
                    .await
                    .expect("change");
                n += 1;
                tokio::time::sleep(WRITE_EVERY).await;
            }
            n
        })
    };

    tokio::time::sleep(Duration::from_secs(3)).await;
    let sent_before = env
        .scalar("SELECT count(*) FROM idem_outbox WHERE state = 'sent'")
        .await;
    assert!(sent_before > 0, "events flowed before the outage");

    // Frozen: the relay's publishes go out and are never answered.
    let freezer = server.clone();
    tokio::task::spawn_blocking(move || freezer.freeze())
        .await
        .expect("frozen");
    tokio::time::sleep(FROZEN).await;
    let frozen = env.tally().await;
    let unavailable_frozen = unavailable.load(Ordering::SeqCst);
    let thawer = server.clone();
    tokio::task::spawn_blocking(move || thawer.thaw())
        .await
        .expect("thawed");
    // Thawed: what the server had unread is stored; the relay, back by
    // itself, publishes those events again under the same ids, and catches
    // up with what was written meanwhile.
    let thawed = Instant::now();
    let thawed_at: String = env
        .client
        .query_one("SELECT clock_timestamp()::text", &[])
        .await
        .expect("the clock")
        .get(0);
    bounded(env.until(
        &format!(
            "SELECT count(*) FROM idem_outbox
             WHERE state <> 'sent' AND created_at < '{thawed_at}'::timestamptz"
        ),
        0,
    ))
    .await;
    let thaw_caught_up = thawed.elapsed();
    let duplicates_thawed = duplicates.load(Ordering::SeqCst);

    let killer = server.clone();
    tokio::task::spawn_blocking(move || killer.kill())
        .await
        .expect("killed");
    let killed = Instant::now();

    // Down. Once the relay has met the outage, nothing it does may touch
    // idem_outbox until the broker is back: no claim-and-fail loop.
    tokio::time::sleep(Duration::from_secs(20)).await;
    let updates_at_20s = env.updates().await;
    tokio::time::sleep_until((killed + OUTAGE - Duration::from_secs(1)).into()).await;
    let updates_at_59s = env.updates().await;
    let during = env.tally().await;
    tokio::time::sleep_until((killed + OUTAGE).into()).await;
    let restarter = server.clone();
    tokio::task::spawn_blocking(move || restarter.restart())
        .await
        .expect("no panic")
        .expect("nats-server restarts");
    let down_for = killed.elapsed();
    let back = Instant::now();

    tokio::time::sleep(Duration::from_secs(2)).await;
    writing.store(false, Ordering::SeqCst);
    let written = writer.await.expect("the writer") as i64;
    let events = env.scalar("SELECT count(*) FROM idem_outbox").await;
    assert_eq!(events, written, "one event per change");

    // Back: the relay resumes by itself; nothing is requeued by hand.
    let caught_up = loop {
        let tally = env.tally().await;
        if tally.sent == events {
            break back.elapsed();
        }
        assert!(
            back.elapsed() < Duration::from_secs(60),
            "not caught up 60 s after the broker came back: {tally:?} of {events}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    running.stop().await;

    let after = env.tally().await;
    let stored = env.stored().await;
    let ids: HashSet<&str> = stored.iter().map(|m| m.msg_id.as_str()).collect();
    let db_ids: HashSet<String> = env.rows().await.into_iter().map(|r| r.0).collect();
    println!(
        "outage: frozen={:.0}s unavailable_publishes={unavailable_frozen} \
         frozen_tally: dead={} counted={} duplicate_acks_after_thaw={duplicates_thawed} \
         thaw_caught_up_after={:.1}s | killed: down_for={:.1}s events={events} \
         sent_before={sent_before} during: pending={} dead={} counted={} max_attempts={} \
         updates_while_down={} caught_up_after={:.1}s \
         after: sent={} dead={} counted={} stream={} distinct_ids={}",
        FROZEN.as_secs_f64(),
        frozen.dead,
        frozen.counted,
        thaw_caught_up.as_secs_f64(),
        down_for.as_secs_f64(),
        during.pending,
        during.dead,
        during.counted,
        during.max_attempts,
        updates_at_59s - updates_at_20s,
        caught_up.as_secs_f64(),
        after.sent,
        after.dead,
        after.counted,
        stored.len(),
        ids.len(),
    );

    // Counted in the database: no event died or was charged for the outage,
    // frozen or killed, and every one is sent.
    assert_eq!(
        (frozen.dead, frozen.counted),
        (0, 0),
        "frozen: no event dead, no attempt counted"
    );
    assert_eq!(
        (during.dead, during.counted),
        (0, 0),
        "during the outage: no event dead, no attempt counted"
    );
    assert!(during.pending > 0, "events waited out the outage");
    assert_eq!(after.dead, 0, "no event is dead");
    assert_eq!(
        after.counted, 0,
        "an unreachable broker counts toward no event's max_attempts"
    );
    assert_eq!(after.sent, events, "every event is sent");
    assert_eq!(
        updates_at_59s - updates_at_20s,
        0,
        "no row of idem_outbox changed while the relay waited for the broker"
    );
    // Counted in the stream: each event once (by Nats-Msg-Id), per key in
    // commit order, none missing.
    assert_eq!(stored.len() as i64, events, "one message per event");
    assert_eq!(ids.len(), stored.len(), "no message id twice");
    let db_ids: HashSet<&str> = db_ids.iter().map(String::as_str).collect();
    assert_eq!(ids, db_ids, "the stream holds exactly the outbox's events");
    let keys = by_key(&stored);
    assert_eq!(keys.len(), KEYS.min(written as usize));
    for (key, messages) in keys {
        let ns: Vec<i64> = messages.iter().map(|m| m.event.n).collect();
        let want: Vec<i64> = (1..=ns.len() as i64).collect();
        assert_eq!(ns, want, "key {key}: every change once, in commit order");
        assert!(messages.iter().zip(1..).all(|(m, seq)| m.seq == seq));
    }
    // The paths the outage took, as the publisher saw them: publishes to the
    // frozen server went unanswered, and the copies it stored on thawing
    // made the relay's republish a duplicate (which the stream's count above
    // shows was not stored twice).
    assert!(
        unavailable_frozen > 0,
        "the relay published to the frozen server"
    );
    assert!(
        duplicates_thawed > 0,
        "an unanswered publish was stored, and deduplicated on republish"
    );
    drop(env);
    drop(server);
}

/// The outbox's rows by state, and what the relay charged to them.
#[derive(Debug, Clone, Copy)]
struct Tally {
    pending: i64,
    sent: i64,
    dead: i64,
    /// Events with at least one failed attempt counted.
    counted: i64,
    max_attempts: i64,
}

impl Env {
    async fn tally(&self) -> Tally {
        let row = self
            .client
            .query_one(
                "SELECT count(*) FILTER (WHERE state = 'pending'),
                        count(*) FILTER (WHERE state = 'sent'),
                        count(*) FILTER (WHERE state = 'dead'),
                        count(*) FILTER (WHERE attempts > 0),
                        coalesce(max(attempts), 0)::int8
                 FROM idem_outbox",
                &[],
            )
            .await
            .expect("tally idem_outbox");
        Tally {
            pending: row.get(0),
            sent: row.get(1),
            dead: row.get(2),
            counted: row.get(3),
            max_attempts: row.get(4),
        }
    }

    /// Rows of idem_outbox updated so far, as PostgreSQL's statistics count
    /// them (claims, marks and releases all update).
    async fn updates(&self) -> i64 {
        self.scalar("SELECT n_tup_upd FROM pg_stat_user_tables WHERE relname = 'idem_outbox'")
            .await
    }
}

/// A database and a file-stored stream (so it survives the server's
/// restart) on the throwaway server at `url`, with the server's default
/// duplicate window.
async fn outage_env(url: &str) -> Env {
    let (db, pool, client) = database().await;
    let js = jetstream::new(async_nats::connect(url).await.expect("connect to NATS"));
    let stream = unique("OUTAGE");
    js.create_stream(stream::Config {
        name: stream.clone(),
        subjects: vec![format!("{stream}.>")],
        storage: stream::StorageType::File,
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
