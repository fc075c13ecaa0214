//! A hostile pass on the inbox: forged ids and headers, handlers that end
//! their transaction, panic or run slow, lost COMMIT answers, killed
//! backends, a killed broker. Everything is counted in the database.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::AtomicBool;

use futures_util::FutureExt;
use idem_testing::proxy::{Fault, Proxy};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;

/// Resolves once the consumer has nothing pending nor awaiting an ack;
/// panics after `limit`.
async fn settled(consumer: PullConsumer, limit: Duration) {
    let mut watched = consumer;
    let started = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let info = watched.info().await.expect("consumer info");
        if info.num_pending == 0 && info.num_ack_pending == 0 {
            return;
        }
        assert!(started.elapsed() < limit, "never settled: {info:?}");
    }
}

/// A durable consumer `name` (`ack_wait`) and its inbox, which parks a
/// message at delivery `max_deliveries` and asks for the next one after
/// 20 ms.
pub(crate) async fn quick_inbox(
    env: &Env,
    name: &str,
    ack_wait: Duration,
    max_deliveries: u64,
) -> (PullConsumer, Inbox) {
    let consumer = env.consumer(name, ack_wait).await;
    let config = InboxConfig::new()
        .max_deliveries(max_deliveries)
        .backoff(Duration::from_millis(20), Duration::from_millis(20));
    let inbox = Inbox::new(env.pool.clone(), name, config).expect("inbox");
    (consumer, inbox)
}

/// The one `bigint` `sql` returns (a `count(*)`), read on the test's own connection.
pub(crate) async fn count(env: &Env, sql: &str) -> i64 {
    env.client
        .query_one(sql, &[])
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .get::<_, i64>(0)
}

async fn publish_with(env: &Env, headers: async_nats::HeaderMap, body: &[u8]) {
    env.js
        .publish_with_headers(
            env.stream.subject().to_owned(),
            headers,
            body.to_vec().into(),
        )
        .await
        .expect("publish")
        .await
        .expect("stored");
}

/// Publish raw bytes as a core NATS `HPUB`: headers the client library
/// would not let us build. The stream captures it.
async fn raw_hpub(subject: &str, header: &[u8], payload: &[u8]) {
    let url = idem_testing::nats::url().expect("nats url");
    let addr = url.trim_start_matches("nats://");
    let mut sock = tokio::net::TcpStream::connect(addr).await.expect("tcp");
    let mut buf = vec![0_u8; 8192];
    let _ = sock.read(&mut buf).await.expect("INFO");
    let mut out = Vec::new();
    out.extend_from_slice(b"CONNECT {\"verbose\":false,\"pedantic\":false,\"headers\":true}\r\n");
    out.extend_from_slice(
        format!(
            "HPUB {subject} {} {}\r\n",
            header.len(),
            header.len() + payload.len()
        )
        .as_bytes(),
    );
    out.extend_from_slice(header);
    out.extend_from_slice(payload);
    out.extend_from_slice(b"\r\nPING\r\n");
    sock.write_all(&out).await.expect("send");
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("PONG") {
        let n = sock.read(&mut buf).await.expect("read");
        assert!(n > 0, "closed: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    assert!(
        !String::from_utf8_lossy(&seen).contains("-ERR"),
        "{}",
        String::from_utf8_lossy(&seen)
    );
}

/// A message with a header value that is not UTF-8 (any header) breaks
/// the client's connection at every delivery (async-nats 0.46 refuses the
/// header block and drops the connection): the inbox never sees it, so it
/// is never handled nor parked, and the messages delivered with it are lost
/// with the connection each time. Not fixable in idem; documented in
/// docs/messaging.md with the way out, which this pins: the message has no
/// record, and once an operator deletes it from the stream the messages
/// behind it apply, once each.
#[tokio::test]
async fn attack_an_unparseable_header_stalls_until_the_message_is_deleted() {
    let env = env().await;
    let (consumer, inbox) = quick_inbox(&env, "utf8", Duration::from_secs(1), 2).await;
    env.publish("good-1", "good-1").await;
    raw_hpub(
        env.stream.subject(),
        b"NATS/1.0\r\nNats-Msg-Id: poison-utf8\r\nX-Junk: \xff\xfe\r\n\r\n",
        b"poison",
    )
    .await;
    env.publish("good-2", "good-2").await;
    let stalled = inbox
        .run(
            &consumer,
            tokio::time::sleep(Duration::from_secs(4)),
            record_body,
        )
        .await;
    println!(
        "stalled: {stalled:?}, effects {:?}",
        env.effect_bodies().await
    );
    assert_eq!(env.record("utf8", "poison-utf8").await, None);
    assert_eq!(
        count(&env, "SELECT count(*) FROM effects WHERE body = 'poison'").await,
        0
    );
    // The way out: the operator deletes it by its stream sequence (2).
    let deleted = env
        .stream
        .stream()
        .clone()
        .delete_message(2)
        .await
        .expect("delete the message");
    assert!(deleted);
    let report = env.run_until_settled(&inbox, &consumer, record_body).await;
    assert_eq!(
        env.effect_bodies().await,
        ["good-1", "good-2"],
        "each good message once ({report:?})"
    );
}

/// Found: a message id PostgreSQL cannot store (a NUL) failed every
/// delivery, and the park too, so the message was nak'd for ever (124
/// deliveries in 3 s) instead of parked. Such an id is now recorded by its
/// digest (`sha256:`), like an over-long one, and applies once; given to
/// `Inbox::handle` directly, it is refused as `InvalidId` with nothing
/// written.
#[tokio::test]
async fn found_a_nul_in_the_message_id_is_never_parked() {
    let env = env().await;
    let (consumer, inbox) = quick_inbox(&env, "nul", Duration::from_secs(30), 2).await;
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", "nul\0id");
    let derived = idem::inbox::message_id(Some(&headers), 1);
    assert!(derived.starts_with("sha256:"), "{derived}");
    publish_with(&env, headers, b"nul").await;
    let report = env.run_until_settled(&inbox, &consumer, record_body).await;
    assert_eq!((report.done, report.errors), (1, 0), "{report:?}");
    assert_eq!(env.effect_bodies().await, ["nul"]);
    assert_eq!(env.record("nul", &derived).await, Some(("done".into(), 1)));
    let refused = inbox.handle("nul\0id", b"x", 1, record_body).await;
    assert!(
        matches!(
            refused,
            Err(InboxError::InvalidId {
                what: "message id",
                ..
            })
        ),
        "{refused:?}"
    );
    assert_eq!(env.effect_bodies().await, ["nul"], "nothing written");
    assert_eq!(
        count(
            &env,
            "SELECT count(*) FROM idem_inbox WHERE consumer = 'nul'"
        )
        .await,
        1
    );
}

/// Found: distinct messages shared a record. An anonymous message is
/// recorded as `seq:N` and a long id as `sha256:HEX`; a producer's
/// `Nats-Msg-Id` of that form took the same record, and the other message
/// was skipped as a duplicate: its effect never applied. A producer's id in
/// a derived form is now recorded by its digest.
#[tokio::test]
async fn found_forged_ids_collide_with_derived_ids() {
    let env = env().await;
    let consumer = env.consumer("forged", Duration::from_secs(30)).await;
    let inbox = Inbox::new(env.pool.clone(), "forged", InboxConfig::new()).expect("inbox");
    env.js
        .publish(env.stream.subject().to_owned(), "anonymous".into())
        .await
        .expect("publish")
        .await
        .expect("stored");
    env.publish("seq:1", "forged-seq").await;
    let long = "L".repeat(300);
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", long.as_str());
    let derived = idem::inbox::message_id(Some(&headers), 0);
    assert!(derived.starts_with("sha256:"), "{derived}");
    publish_with(&env, headers, b"long-id").await;
    env.publish(&derived, "forged-sha").await;
    let report = env.run_until_settled(&inbox, &consumer, record_body).await;
    println!("{report:?}");
    assert_eq!(
        env.effect_bodies().await,
        ["anonymous", "forged-seq", "forged-sha", "long-id"],
        "four distinct messages, four effects ({report:?})"
    );
}

/// Found: the retryable docs say a body that ends the transaction by hand
/// gets `TransactionEnded` and "is never replayed: what it committed by
/// hand would be written again". The inbox nak'd it, and each redelivery
/// ran it again: `ROLLBACK; INSERT` committed the effect without its
/// record, once per delivery (3 rows), then parked the message as if
/// nothing had applied. It is now parked at the first delivery, with the
/// error, and termed: never run again but by an operator's requeue.
#[tokio::test]
async fn found_an_effect_that_rolls_back_by_hand_applies_on_every_delivery() {
    let env = env().await;
    let (consumer, inbox) = quick_inbox(&env, "by-hand", Duration::from_secs(30), 3).await;
    env.publish("rb-1", "rb-1").await;
    let rolls_back = effect(|conn, _payload| {
        async move {
            conn.batch_execute("ROLLBACK; INSERT INTO effects (body) VALUES ('rb-1')")
                .await?;
            Ok(())
        }
        .scope_boxed()
    });
    let report = env.run_until_settled(&inbox, &consumer, rolls_back).await;
    let record = env.record("by-hand", "rb-1").await;
    println!("{report:?} {record:?}");
    assert_eq!(record, Some(("dead".into(), 1)), "{report:?}");
    assert_eq!((report.parked, report.retried), (1, 0), "{report:?}");
    let letters = inbox.dead_letters(10).await.expect("dead letters");
    assert!(
        letters[0]
            .last_error
            .contains("some of what it wrote was committed"),
        "{letters:?}"
    );
    assert_eq!(
        env.effect_bodies().await,
        ["rb-1"],
        "one message, its effect once ({report:?}, record {record:?})"
    );
}

/// A body that commits by hand: its record committed with it, so the
/// redelivery after the nak is skipped. Once.
#[tokio::test]
async fn attack_an_effect_that_commits_by_hand_applies_once() {
    let env = env().await;
    let (consumer, inbox) = quick_inbox(&env, "commits", Duration::from_secs(30), 3).await;
    env.publish("c-1", "c-1").await;
    let commits = effect(|conn, payload| {
        let body = String::from_utf8_lossy(payload).into_owned();
        async move {
            diesel::sql_query("INSERT INTO effects (body) VALUES ($1)")
                .bind::<Text, _>(body)
                .execute(conn)
                .await?;
            conn.batch_execute("COMMIT").await?;
            Ok(())
        }
        .scope_boxed()
    });
    let report = env.run_until_settled(&inbox, &consumer, commits).await;
    println!("{report:?}");
    assert_eq!(env.effect_bodies().await, ["c-1"]);
    // Acked at the first delivery: the record came with the effect's COMMIT.
    assert_eq!((report.duplicates, report.retried), (1, 0), "{report:?}");
    assert_eq!(
        env.record("commits", "c-1").await.map(|r| r.0),
        Some("done".into())
    );
}

/// Two instances on one durable consumer, an effect slower than `ack_wait`:
/// every message is redelivered to the other instance while the first
/// still runs it. Each applies once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_two_instances_and_a_slow_effect_apply_each_message_once() {
    let env = env().await;
    let consumer = env.consumer("slow", Duration::from_secs(1)).await;
    let config = InboxConfig::new()
        .max_deliveries(4)
        .backoff(Duration::from_millis(100), Duration::from_millis(200));
    let a = Inbox::new(env.pool.clone(), "slow", config).expect("inbox");
    let b = a.clone();
    for i in 0..4 {
        env.publish(&format!("s-{i}"), &format!("s-{i}")).await;
    }
    let slow = || {
        effect(|conn, payload| {
            let body = String::from_utf8_lossy(payload).into_owned();
            async move {
                diesel::sql_query("INSERT INTO effects (body) VALUES ($1)")
                    .bind::<Text, _>(body)
                    .execute(conn)
                    .await?;
                tokio::time::sleep(Duration::from_millis(1300)).await;
                Ok(())
            }
            .scope_boxed()
        })
    };
    let limit = Duration::from_secs(40);
    let (ra, rb) = tokio::join!(
        a.run(&consumer, settled(consumer.clone(), limit), slow()),
        b.run(&consumer, settled(consumer.clone(), limit), slow()),
    );
    println!("{ra:?}\n{rb:?}");
    assert_eq!(env.effect_bodies().await, ["s-0", "s-1", "s-2", "s-3"]);
    assert_eq!(
        count(
            &env,
            "SELECT count(*) FROM idem_inbox WHERE consumer = 'slow' AND state = 'done'"
        )
        .await,
        4
    );
}

/// An effect that panics after writing: nothing commits, no backend is left
/// idle in a transaction, and the redelivery runs it once.
#[tokio::test]
async fn attack_a_panicking_effect_leaves_nothing_and_runs_once() {
    let env = env().await;
    let consumer = env.consumer("panics", Duration::from_secs(1)).await;
    let inbox = Inbox::new(env.pool.clone(), "panics", InboxConfig::new()).expect("inbox");
    env.publish("p-1", "p-1").await;
    let armed = Arc::new(AtomicBool::new(true));
    let fuse = Arc::clone(&armed);
    let panics = effect(move |conn, payload| {
        let body = String::from_utf8_lossy(payload).into_owned();
        let fire = fuse.swap(false, Ordering::SeqCst);
        async move {
            diesel::sql_query("INSERT INTO effects (body) VALUES ($1)")
                .bind::<Text, _>(body)
                .execute(conn)
                .await?;
            assert!(!fire, "the handler panics");
            Ok(())
        }
        .scope_boxed()
    });
    let caught = AssertUnwindSafe(inbox.run(
        &consumer,
        tokio::time::sleep(Duration::from_secs(20)),
        panics,
    ))
    .catch_unwind()
    .await;
    assert!(caught.is_err(), "the run panicked");
    assert!(env.effect_bodies().await.is_empty());
    assert_eq!(env.record("panics", "p-1").await, None);
    let idle_sql = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                    AND state LIKE 'idle in transaction%'";
    let started = Instant::now();
    while count(&env, idle_sql).await > 0 && started.elapsed() < Duration::from_secs(3) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(count(&env, idle_sql).await, 0, "no transaction left open");
    let report = env.run_until_settled(&inbox, &consumer, record_body).await;
    assert_eq!(report.done, 1, "{report:?}");
    assert_eq!(env.effect_bodies().await, ["p-1"]);
    assert_eq!(env.record("panics", "p-1").await, Some(("done".into(), 2)));
}

/// COMMIT's answer lost (committed), COMMIT never reaching the server, and
/// a lost answer on the last delivery allowed (which parks unless the
/// record is found): each message's effect applies once, none is dead.
#[tokio::test]
async fn attack_lost_commit_answers_apply_each_message_once() {
    let env = env().await;
    let proxy = Proxy::start(env._db.url()).await.expect("proxy");
    let pool = build_pool_with(
        proxy.url(),
        &PoolConfig {
            max_size: 2,
            wait_timeout: Duration::from_secs(10),
            ..PoolConfig::default()
        },
    )
    .expect("pool");
    let consumer = env.consumer("lost", Duration::from_secs(30)).await;
    let config = InboxConfig::new()
        .max_deliveries(5)
        .backoff(Duration::from_millis(50), Duration::from_millis(50));
    let inbox = Inbox::new(pool.clone(), "lost", config).expect("inbox");
    let last = Inbox::new(pool.clone(), "lost", config.max_deliveries(1)).expect("inbox");

    proxy.arm("COMMIT\0", Fault::CutAfter);
    env.publish("after", "after").await;
    let r1 = env.run_until_settled(&inbox, &consumer, record_body).await;
    proxy.arm("COMMIT\0", Fault::CutBefore);
    env.publish("before", "before").await;
    let r2 = env.run_until_settled(&inbox, &consumer, record_body).await;
    proxy.arm("COMMIT\0", Fault::CutAfter);
    env.publish("last", "last").await;
    let r3 = env.run_until_settled(&last, &consumer, record_body).await;
    println!("{r1:?}\n{r2:?}\n{r3:?}");
    assert_eq!(proxy.fired(), 3);
    assert_eq!(env.effect_bodies().await, ["after", "before", "last"]);
    assert_eq!(
        count(
            &env,
            "SELECT count(*) FROM idem_inbox WHERE consumer = 'lost' AND state = 'done'"
        )
        .await,
        3
    );
}

/// The effect's backend is terminated mid-transaction: nothing of it
/// commits, and it applies once.
#[tokio::test]
async fn attack_a_backend_terminated_in_the_effect_applies_once() {
    let env = env().await;
    let consumer = env.consumer("killed", Duration::from_secs(30)).await;
    let config = InboxConfig::new().backoff(Duration::from_millis(50), Duration::from_millis(50));
    let inbox = Inbox::new(env.pool.clone(), "killed", config).expect("inbox");
    env.publish("k-1", "k-1").await;
    let armed = Arc::new(AtomicBool::new(true));
    let fuse = Arc::clone(&armed);
    let kills = effect(move |conn, payload| {
        let body = String::from_utf8_lossy(payload).into_owned();
        let fire = fuse.swap(false, Ordering::SeqCst);
        async move {
            diesel::sql_query("INSERT INTO effects (body) VALUES ($1)")
                .bind::<Text, _>(body)
                .execute(conn)
                .await?;
            if fire {
                conn.batch_execute("SELECT pg_terminate_backend(pg_backend_pid())")
                    .await?;
            }
            Ok(())
        }
        .scope_boxed()
    });
    let report = env.run_until_settled(&inbox, &consumer, kills).await;
    println!("{report:?}");
    assert!(
        !AtomicBool::load(&armed, Ordering::SeqCst),
        "the backend was killed"
    );
    assert_eq!(env.effect_bodies().await, ["k-1"]);
    assert_eq!(
        env.record("killed", "k-1").await.map(|r| r.0),
        Some("done".into())
    );
}
