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

async fn count(env: &Env, sql: &str) -> i64 {
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

/// Docs: "the delivery that reaches `max_deliveries` parks it as a dead
/// letter". A message with one non-UTF-8 header value (any header) breaks
/// the client's connection at every delivery: it is never handled, never
/// parked, redelivered for ever, and the message published after it, lost
/// with the same connection each time, is never applied either.
#[tokio::test]
async fn found_a_non_utf8_header_is_never_parked() {
    let env = env().await;
    let consumer = env.consumer("utf8", Duration::from_secs(1)).await;
    let config = InboxConfig::new()
        .max_deliveries(2)
        .backoff(Duration::from_millis(20), Duration::from_millis(20));
    let inbox = Inbox::new(env.pool.clone(), "utf8", config).expect("inbox");
    env.publish("good-1", "good-1").await;
    raw_hpub(
        env.stream.subject(),
        b"NATS/1.0\r\nNats-Msg-Id: poison-utf8\r\nX-Junk: \xff\xfe\r\n\r\n",
        b"poison",
    )
    .await;
    env.publish("good-2", "good-2").await;
    let ran = inbox
        .run(
            &consumer,
            tokio::time::sleep(Duration::from_secs(6)),
            record_body,
        )
        .await;
    let info = consumer.clone().info().await.expect("info").clone();
    let effects = env.effect_bodies().await;
    println!("run: {ran:?}\neffects: {effects:?}\nconsumer: {info:?}");
    assert_eq!(
        (env.record("utf8", "poison-utf8").await, effects.clone()),
        (
            Some(("dead".into(), 2)),
            vec!["good-1".to_owned(), "good-2".to_owned()]
        ),
        "the poison parked at max_deliveries and the message behind it applied \
         (redelivered {}, ack pending {}, run {ran:?})",
        info.num_redelivered,
        info.num_ack_pending
    );
}

/// The same promise, with a message id PostgreSQL cannot store (a NUL):
/// every delivery fails, the park fails too, and the message is nak'd for
/// ever instead of parked.
#[tokio::test]
async fn found_a_nul_in_the_message_id_is_never_parked() {
    let env = env().await;
    let consumer = env.consumer("nul", Duration::from_secs(30)).await;
    let config = InboxConfig::new()
        .max_deliveries(2)
        .backoff(Duration::from_millis(20), Duration::from_millis(20));
    let inbox = Inbox::new(env.pool.clone(), "nul", config).expect("inbox");
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", "nul\0id");
    publish_with(&env, headers, b"nul").await;
    let report = inbox
        .run(
            &consumer,
            tokio::time::sleep(Duration::from_secs(3)),
            record_body,
        )
        .await
        .expect("run");
    let info = consumer.clone().info().await.expect("info").clone();
    println!("{report:?}\n{info:?}");
    assert_eq!(
        count(
            &env,
            "SELECT count(*) FROM idem_inbox WHERE consumer = 'nul' AND state = 'dead'"
        )
        .await,
        1,
        "parked after 2 deliveries; instead {report:?}, redelivered {}",
        info.num_redelivered
    );
}

/// Distinct messages must not share a record. An anonymous message is
/// recorded as `seq:N` and a long id as `sha256:HEX`; a producer's
/// `Nats-Msg-Id` of that form takes the same record, and the other message
/// is skipped as a duplicate: its effect never applies.
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

/// The retryable docs: a body that ends the transaction by hand gets
/// `TransactionEnded` and "is never replayed: what it committed by hand
/// would be written again". The inbox naks it, and each redelivery runs it
/// again: `ROLLBACK; INSERT` commits the effect without its record, once
/// per delivery, and then parks the message as if nothing had applied.
#[tokio::test]
async fn found_an_effect_that_rolls_back_by_hand_applies_on_every_delivery() {
    let env = env().await;
    let consumer = env.consumer("by-hand", Duration::from_secs(30)).await;
    let config = InboxConfig::new()
        .max_deliveries(3)
        .backoff(Duration::from_millis(20), Duration::from_millis(20));
    let inbox = Inbox::new(env.pool.clone(), "by-hand", config).expect("inbox");
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
    let consumer = env.consumer("commits", Duration::from_secs(30)).await;
    let config = InboxConfig::new()
        .max_deliveries(3)
        .backoff(Duration::from_millis(20), Duration::from_millis(20));
    let inbox = Inbox::new(env.pool.clone(), "commits", config).expect("inbox");
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
