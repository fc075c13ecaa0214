//! The hostile pass on the outbox, part 2: relays cut off from PostgreSQL
//! and killed between publish and mark-sent while writers interleave on
//! shared keys and a cleanup deletes sent rows at once; dead events
//! requeued and discarded, by real and forged ids.

use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::Arc;

use idem::outbox::{OutboxMessage, PublishError, Published, Publisher};
use idem_testing::proxy::{Fault, Proxy};

use super::poison::FailFor;
use super::*;

/// The real publisher, except that the `crash_at`-th publish panics after
/// the broker acked it: a relay that dies between publish and mark-sent.
struct CrashAfterAck {
    inner: NatsPublisher,
    count: AtomicUsize,
    crash_at: usize,
}

impl Publisher for CrashAfterAck {
    async fn publish(&self, message: &OutboxMessage) -> Result<Published, PublishError> {
        let r = self.inner.publish(message).await;
        if self.count.fetch_add(1, Ordering::SeqCst) + 1 == self.crash_at {
            panic!("relay killed after the ack of {}", message.id);
        }
        r
    }
    async fn check(&self) -> Result<(), PublishError> {
        self.inner.check().await
    }
}

/// Four writers interleave 240 commits on three keys while three relays
/// run: one through a proxy that loses the answer of a claim and of a
/// mark-sent, and keeps another mark-sent from the server; one that dies
/// after an ack; one that deletes sent rows as soon as they are sent. Read
/// back: every committed change is in the stream once, each key in commit
/// order.
#[tokio::test(flavor = "multi_thread", worker_threads = 6)]
async fn attack_relays_cut_and_killed_mid_round_lose_nothing_and_keep_order() {
    let env = env("atk_faults", Duration::from_secs(120)).await;
    let proxy = Proxy::start(env.db.url()).await.expect("proxy");
    let proxied = build_pool_with(
        proxy.url(),
        &PoolConfig {
            max_size: 4,
            wait_timeout: Duration::from_secs(60),
            ..PoolConfig::default()
        },
    )
    .expect("pool");
    proxy.arm_nth("FOR UPDATE OF o SKIP LOCKED", 3, Fault::CutAfter);
    proxy.arm_nth("SET state = 'sent'", 2, Fault::CutAfter);
    proxy.arm_nth("SET state = 'sent'", 4, Fault::CutBefore);
    proxy.arm_nth(
        "SET state = 'sent'",
        6,
        Fault::HoldAnswer(Duration::from_millis(1500)),
    );
    // The acks awaited 500 ms: a lease must exceed the publisher's wait.
    let (lease, ack) = (Duration::from_millis(700), Duration::from_millis(500));
    let cut = Running::start(
        Relay::new(proxied.clone(), env.publisher_waiting(ack).await)
            .lease(lease)
            .batch_size(2)
            .poll_interval(Duration::from_millis(20)),
    );
    let (stop_crash, crash_stopped) = oneshot::channel::<()>();
    let crashing = tokio::spawn(
        Relay::new(
            env.pool.clone(),
            CrashAfterAck {
                inner: env.publisher_waiting(ack).await,
                count: AtomicUsize::new(0),
                crash_at: 7,
            },
        )
        .lease(lease)
        .batch_size(1)
        .poll_interval(Duration::from_millis(20))
        .run(async move {
            let _ = crash_stopped.await;
        }),
    );
    let cleaner = Running::start(
        Relay::new(env.pool.clone(), env.publisher_waiting(ack).await)
            .lease(lease)
            .batch_size(3)
            .retention(Duration::ZERO)
            .cleanup(Duration::ZERO, 1)
            .poll_interval(Duration::from_millis(20)),
    );

    let keys = ["a", "b", "c"];
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let pool = env.pool.clone();
            tokio::spawn(async move {
                for i in 0..60 {
                    change(&pool, keys[(i + w) % 3]).await.expect("change");
                    if i % 7 == 0 {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
            })
        })
        .collect();
    for w in writers {
        w.await.expect("writer");
    }
    bounded(env.until("SELECT count(*) FROM idem_outbox WHERE state <> 'sent'", 0)).await;
    cut.stop().await;
    cleaner.stop().await;
    let _ = stop_crash.send(());
    let crashed = crashing.await;
    println!(
        "proxy faults fired: {}, crashing relay: {}",
        proxy.fired(),
        if crashed.is_err() {
            "panicked"
        } else {
            "stopped"
        }
    );
    assert!(crashed.is_err(), "the crashing relay died after an ack");
    assert_eq!(proxy.fired(), 4, "every armed fault fired");

    let counters: HashMap<String, i64> = env
        .client
        .query("SELECT key, n FROM counters", &[])
        .await
        .expect("counters")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(counters.values().sum::<i64>(), 240);
    let stored = env.stored().await;
    assert_eq!(stored.len(), 240, "each committed change stored once");
    let ids: std::collections::HashSet<&str> = stored.iter().map(|m| m.msg_id.as_str()).collect();
    assert_eq!(ids.len(), 240, "no id stored twice");
    for (key, msgs) in by_key(&stored) {
        let seqs: Vec<i64> = msgs.iter().map(|m| m.seq).collect();
        let ns: Vec<i64> = msgs.iter().map(|m| m.event.n).collect();
        let want: Vec<i64> = (1..=counters[&key]).collect();
        assert_eq!(seqs, want, "key {key}: seqs in stream order");
        assert_eq!(ns, want, "key {key}: the counter's values in commit order");
    }
}

/// A dead head requeued (through the operator API) while later events of
/// its key wait: the key goes out in order. Forged ids change nothing:
/// requeue and discard of pending or sent events, of unknown ids, of
/// non-UUIDs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn attack_requeue_and_discard_by_real_and_forged_ids() {
    let env = env("atk_requeue", Duration::from_secs(120)).await;
    let failing = Arc::new(AtomicBool::new(true));
    let relay = Relay::new(
        env.pool.clone(),
        FailFor {
            inner: env.publisher().await,
            key: "p".into(),
            failing: failing.clone(),
        },
    )
    .listen(false)
    .max_attempts(2)
    .backoff(Duration::from_millis(5), Duration::from_millis(10));
    let p1 = change(&env.pool, "p").await.expect("p1");
    let q1 = change(&env.pool, "q").await.expect("q1");
    for _ in 0..4 {
        let _ = bounded(relay.run_once()).await.expect("round");
        tokio::time::sleep(Duration::from_millis(15)).await;
    }
    let state = |id: EventId| {
        let client = &env.client;
        async move {
            client
                .query_one(
                    "SELECT coalesce((SELECT state FROM idem_outbox WHERE id = $1::text::uuid), 'gone')",
                    &[&id.to_string()],
                )
                .await
                .expect("state")
                .get::<_, String>(0)
        }
    };
    assert_eq!(state(p1).await, "dead");
    assert_eq!(state(q1).await, "sent");
    let p2 = change(&env.pool, "p").await.expect("p2");
    let p3 = change(&env.pool, "p").await.expect("p3");

    // Forged ids.
    use idem::operate::{discard_event, requeue_event};
    let unknown = uuid_of("00000000-0000-0000-0000-000000000000");
    for (id, what) in [(p2, "pending"), (q1, "sent"), (unknown, "unknown")] {
        assert!(
            !requeue_event(&env.pool, &id.to_string())
                .await
                .expect("requeue"),
            "{what}"
        );
        assert!(
            !discard_event(&env.pool, &id.to_string())
                .await
                .expect("discard"),
            "{what}"
        );
    }
    for bad in ["", "abc", "'; DELETE FROM idem_outbox; --", "\0"] {
        assert!(requeue_event(&env.pool, bad).await.is_err(), "{bad:?}");
        assert!(discard_event(&env.pool, bad).await.is_err(), "{bad:?}");
    }
    assert_eq!(
        idem::outbox::requeue_key(&mut env.pool.get().await.expect("conn"), "q")
            .await
            .expect("requeue_key"),
        0,
        "no dead event of q"
    );
    assert_eq!(state(p2).await, "pending");
    assert_eq!(state(q1).await, "sent");
    assert_eq!(state(p1).await, "dead");
    // The key waits behind its dead head.
    let _ = bounded(relay.run_once()).await.expect("round");
    assert_eq!(state(p2).await, "pending");

    // Requeued by its id in upper case braces (a UUID all the same).
    failing.store(false, Ordering::SeqCst);
    let braced = format!("{{{}}}", p1.to_string().to_uppercase());
    assert!(requeue_event(&env.pool, &braced).await.expect("requeue"));
    while bounded(relay.run_once()).await.expect("round").claimed > 0 {}
    let stored = env.stored().await;
    let p: Vec<(i64, String)> = stored
        .iter()
        .filter(|m| m.key == "p")
        .map(|m| (m.seq, m.msg_id.clone()))
        .collect();
    assert_eq!(
        p,
        vec![
            (1, p1.to_string()),
            (2, p2.to_string()),
            (3, p3.to_string())
        ]
    );

    // A dead head discarded: never published; the next one goes.
    failing.store(true, Ordering::SeqCst);
    let p4 = change(&env.pool, "p").await.expect("p4");
    for _ in 0..4 {
        let _ = bounded(relay.run_once()).await.expect("round");
        tokio::time::sleep(Duration::from_millis(15)).await;
    }
    assert_eq!(state(p4).await, "dead");
    let p5 = change(&env.pool, "p").await.expect("p5");
    failing.store(false, Ordering::SeqCst);
    assert!(discard_event(&env.pool, &p4.to_string())
        .await
        .expect("discard"));
    assert!(!discard_event(&env.pool, &p4.to_string())
        .await
        .expect("discard twice"));
    while bounded(relay.run_once()).await.expect("round").claimed > 0 {}
    assert_eq!(state(p4).await, "gone");
    assert_eq!(state(p5).await, "sent");
    let ids: Vec<String> = env
        .stored()
        .await
        .iter()
        .filter(|m| m.key == "p")
        .map(|m| m.msg_id.clone())
        .collect();
    assert_eq!(ids.len(), 4);
    assert!(!ids.contains(&p4.to_string()));
    assert_eq!(ids[3], p5.to_string());
}

fn uuid_of(s: &str) -> EventId {
    EventId::from(uuid::Uuid::parse_str(s).expect("uuid"))
}

/// Found: "at start-up the relay refuses a stream whose window is shorter
/// than its lease plus retry horizon" held for the stream the publisher is
/// named for only: a prefix routed every event to another stream, whose
/// window was never checked (a warning at each ack), and a relay that died
/// after an ack had its event stored twice and marked sent once. Every
/// publish now names the stream it must land in (`Nats-Expected-Stream`),
/// as the rustdoc says it must ("the stream must capture it"): the server
/// refuses an event another stream captures, which is not stored anywhere
/// and is charged (dead after the relay's attempts), whatever that
/// stream's window; requeued with the prefix dropped, it is published
/// once, into the named stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn found_events_routed_to_another_stream_skip_the_window_check() {
    let env = env("atk_route", Duration::from_secs(120)).await;
    let make_stream = |window: Duration| {
        let name = unique("ATK_OTHER");
        let js = env.js.clone();
        async move {
            js.create_stream(stream::Config {
                name: name.clone(),
                subjects: vec![format!("{name}.>")],
                duplicate_window: window,
                storage: stream::StorageType::Memory,
                ..Default::default()
            })
            .await
            .expect("the other stream");
            name
        }
    };
    let short = make_stream(Duration::from_millis(200)).await;
    let long = make_stream(Duration::from_secs(600)).await;
    let run = |prefix: Option<String>| {
        let pool = env.pool.clone();
        let stream = env.stream.clone();
        async move {
            let client = async_nats::connect(nats_url().await)
                .await
                .expect("connect");
            let mut context = jetstream::new(client);
            context.set_timeout(Duration::from_millis(200)); // under the lease
            let publisher = NatsPublisher::new(context, stream.clone());
            let publisher = match prefix {
                Some(prefix) => publisher.subject_prefix(prefix),
                // The named stream captures `<stream>.>`.
                None => publisher.subject_prefix(stream),
            };
            let relay = Relay::new(pool, publisher.clone())
                .lease(Duration::from_millis(300))
                .max_attempts(2)
                .backoff(Duration::from_millis(10), Duration::from_millis(20))
                .listen(false);
            // What `run` does first; the named stream's window passes.
            publisher
                .prepare(relay.horizon())
                .await
                .expect("the named stream's window covers the horizon");
            for _ in 0..20 {
                let round = bounded(relay.run_once()).await.expect("round");
                if round.claimed == 0 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(30)).await;
            }
        }
    };
    change(&env.pool, "w").await.expect("change");
    for other in [&short, &long] {
        run(Some(other.clone())).await;
        let mut stream = env.js.get_stream(other).await.expect("other");
        assert_eq!(stream.info().await.expect("info").state.messages, 0);
        let rows = env.rows().await;
        assert_eq!(
            env.scalar(
                "SELECT count(*) FROM idem_outbox WHERE state = 'dead' \
                 AND last_error ILIKE '%expected stream%'"
            )
            .await,
            1,
            "refused by the server, stored nowhere: {rows:?}"
        );
        env.client
            .execute(
                "UPDATE idem_outbox SET state = 'pending', attempts = 0",
                &[],
            )
            .await
            .expect("requeue by hand");
    }
    run(None).await;
    assert_eq!(env.stream_count().await, 1);
    assert_eq!(
        env.scalar("SELECT count(*) FROM idem_outbox WHERE state = 'sent'")
            .await,
        1
    );
}

/// An `#[idempotent]` call answered from its record runs no body and emits
/// nothing more; the stream holds the first run's events once.
#[idem::idempotent(key = key, scope = tenant, fingerprint(tenant))]
#[retryable(max = 4, deadline_ms = 30000)]
async fn pay(conn: &mut AsyncPgConnection, tenant: &i64, key: &str) -> Result<i64, AppError> {
    emit(
        conn,
        &Changed {
            key: format!("pay-{tenant}"),
            n: 1,
        },
    )
    .await?;
    Ok(1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn attack_an_idempotent_call_replayed_from_its_record_emits_nothing() {
    let env = env("atk_replay", Duration::from_secs(120)).await;
    for _ in 0..3 {
        pay(&env.pool, &1, "req-1").await.expect("pay");
    }
    let relay = Relay::new(env.pool.clone(), env.publisher().await).listen(false);
    while bounded(relay.run_once()).await.expect("round").claimed > 0 {}
    assert_eq!(env.scalar("SELECT count(*) FROM idem_outbox").await, 1);
    assert_eq!(env.stream_count().await, 1);
}
