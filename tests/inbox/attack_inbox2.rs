//! A hostile pass on the inbox, part two: a killed broker, reused ids,
//! odd payloads and ids, requeue races, a consumer's own delivery limit.

use async_nats::jetstream::stream;
use idem_testing::proxy::{Fault, Proxy};

use super::attack_inbox::{count, quick_inbox};
use super::*;

/// The consumer commits, the broker is SIGKILLed before the ack and comes
/// back with its file store: the redelivery is skipped.
#[tokio::test]
async fn attack_broker_killed_between_commit_and_ack() {
    let env = env().await;
    let server = idem_testing::nats::NatsServer::start().expect("nats-server");
    let connect =
        || async { jetstream::new(async_nats::connect(server.url()).await.expect("connect")) };
    let js = connect().await;
    js.create_stream(stream::Config {
        name: "KILLED".into(),
        subjects: vec!["killed.>".into()],
        storage: stream::StorageType::File,
        ..Default::default()
    })
    .await
    .expect("stream");
    let config = pull::Config {
        durable_name: Some("killed".into()),
        ack_policy: AckPolicy::Explicit,
        ack_wait: Duration::from_secs(1),
        ..Default::default()
    };
    let consumer = js
        .get_stream("KILLED")
        .await
        .expect("stream")
        .create_consumer(config.clone())
        .await
        .expect("consumer");
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", "kb-1");
    js.publish_with_headers("killed.a", headers, "kb-1".into())
        .await
        .expect("publish")
        .await
        .expect("stored");
    let inbox = Inbox::new(env.pool.clone(), "killed", InboxConfig::new()).expect("inbox");
    let first = fetch_one(&consumer).await;
    let outcome = inbox
        .handle("kb-1", &first.payload, delivered(&first), record_body)
        .await
        .expect("handled");
    assert!(matches!(outcome, Outcome::Done(())), "{outcome:?}");
    server.restart().expect("restart");
    drop(first);
    let js = connect().await;
    let consumer: PullConsumer = loop {
        // The stream's leader is elected again after the restart.
        match js.get_stream("KILLED").await {
            Ok(s) => break s.get_consumer("killed").await.expect("consumer"),
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };
    let report = env.run_until_settled(&inbox, &consumer, record_body).await;
    assert_eq!(report.duplicates, 1, "{report:?}");
    assert_eq!(env.effect_bodies().await, ["kb-1"]);
    assert_eq!(env.record("killed", "kb-1").await, Some(("done".into(), 1)));
}

/// An id reused with another body: the inbox has no fingerprint, the second
/// body is skipped as the first one's duplicate (by the broker within its
/// window, by the record beyond it).
#[tokio::test]
async fn attack_a_reused_id_with_another_payload_is_skipped() {
    let env = env().await;
    let consumer = env.consumer("reused", Duration::from_secs(30)).await;
    let inbox = Inbox::new(env.pool.clone(), "reused", InboxConfig::new()).expect("inbox");
    env.publish("r-1", "first").await;
    env.publish("r-1", "second").await;
    env.run_until_settled(&inbox, &consumer, record_body).await;
    let again = inbox
        .handle("r-1", b"third", 1, record_body)
        .await
        .expect("handled");
    assert!(matches!(again, Outcome::Duplicate), "{again:?}");
    assert_eq!(env.effect_bodies().await, ["first"]);
    assert_eq!(env.record("reused", "r-1").await, Some(("done".into(), 1)));
}

/// An empty payload runs and is recorded; a 900 kB poison body is parked
/// whole; ids empty or past 255 bytes are refused with nothing recorded.
#[tokio::test]
async fn attack_empty_huge_payloads_and_invalid_ids() {
    let env = env().await;
    let (consumer, inbox) = quick_inbox(&env, "sizes", Duration::from_secs(30), 2).await;
    env.publish("empty", "").await;
    let huge = "h".repeat(900_000);
    env.publish("huge", &huge).await;
    let refuse_huge = effect(|conn, payload| {
        let body = String::from_utf8_lossy(payload).into_owned();
        async move {
            if body.len() > 1000 {
                return Err(AppError::Refused("too big".into()));
            }
            diesel::sql_query("INSERT INTO effects (body) VALUES ($1)")
                .bind::<Text, _>(body)
                .execute(conn)
                .await?;
            Ok(())
        }
        .scope_boxed()
    });
    let report = env.run_until_settled(&inbox, &consumer, refuse_huge).await;
    assert_eq!((report.done, report.parked), (1, 1), "{report:?}");
    assert_eq!(env.effect_bodies().await, [""]);
    assert_eq!(
        count(
            &env,
            "SELECT octet_length(payload)::bigint FROM idem_inbox WHERE msg_id = 'huge' AND state = 'dead'"
        )
        .await,
        900_000
    );
    for bad in [String::new(), "x".repeat(256)] {
        let refused = inbox.handle(&bad, b"x", 1, record_body).await;
        assert!(refused.is_err(), "{bad:?} refused");
    }
    assert_eq!(count(&env, "SELECT count(*) FROM idem_inbox").await, 2);
    assert_eq!(env.effect_bodies().await.len(), 1);
}

/// Two requeues of one dead letter at once: the effect runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_concurrent_requeues_run_a_letter_once() {
    let env = env().await;
    let inbox = Inbox::new(
        env.pool.clone(),
        "requeued",
        InboxConfig::new().max_deliveries(1),
    )
    .expect("inbox");
    let parked = inbox
        .handle("q-1", b"q-1", 1, refuse)
        .await
        .expect("handled");
    assert!(matches!(parked, Outcome::Parked { .. }), "{parked:?}");
    let slow = || {
        effect(|conn, payload| {
            let body = String::from_utf8_lossy(payload).into_owned();
            async move {
                diesel::sql_query("INSERT INTO effects (body) VALUES ($1)")
                    .bind::<Text, _>(body)
                    .execute(conn)
                    .await?;
                tokio::time::sleep(Duration::from_millis(200)).await;
                Ok(())
            }
            .scope_boxed()
        })
    };
    let (a, b) = tokio::join!(inbox.requeue("q-1", slow()), inbox.requeue("q-1", slow()));
    let ran = [a.expect("a"), b.expect("b")];
    assert_eq!(ran.iter().filter(|r| r.is_some()).count(), 1, "{ran:?}");
    assert_eq!(env.effect_bodies().await, ["q-1"]);
    assert_eq!(
        env.record("requeued", "q-1").await,
        Some(("done".into(), 2))
    );
}

/// `purge` (one row per batch, an hour's retention) in a loop beside a live
/// consumer: records of messages settled meanwhile are not touched, each
/// message applies once.
#[tokio::test]
async fn attack_purge_beside_a_live_consumer() {
    let env = env().await;
    let consumer = env.consumer("purged", Duration::from_secs(30)).await;
    let inbox = Inbox::new(env.pool.clone(), "purged", InboxConfig::new()).expect("inbox");
    for i in 0..20 {
        env.publish(&format!("u-{i}"), &format!("u-{i:02}")).await;
    }
    let purger = inbox.clone();
    let purging = async {
        let mut deleted = 0;
        for _ in 0..30 {
            deleted += purger
                .purge(Duration::from_secs(3600), 1)
                .await
                .expect("purge");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        deleted
    };
    let (report, deleted) = tokio::join!(
        env.run_until_settled(&inbox, &consumer, record_body),
        purging
    );
    assert_eq!(report.done, 20, "{report:?}");
    assert_eq!(deleted, 0, "nothing older than an hour");
    assert_eq!(env.effect_bodies().await.len(), 20);
    assert_eq!(
        count(&env, "SELECT count(*) FROM idem_inbox WHERE state = 'done'").await,
        20
    );
}

/// Found: a consumer whose own `max_deliver` is below the inbox's
/// `max_deliveries` (default 5) stopped delivering a failing message before
/// the inbox parked it: no effect, no dead letter, gone (`retried: 2`, then
/// nothing). The run loop now refuses such a consumer before pulling
/// anything, with a typed error naming both numbers; the message stays in
/// the stream, and a consumer that can reach the park parks it.
#[tokio::test]
async fn found_a_consumer_max_deliver_below_max_deliveries_loses_the_message() {
    let env = env().await;
    let limited = |name: &str, max_deliver: i64| pull::Config {
        durable_name: Some(name.into()),
        ack_policy: AckPolicy::Explicit,
        ack_wait: Duration::from_secs(30),
        max_deliver,
        ..Default::default()
    };
    let stream = env.stream.stream();
    let consumer = stream
        .create_consumer(limited("limited", 2))
        .await
        .expect("consumer");
    let config = InboxConfig::new().backoff(Duration::from_millis(20), Duration::from_millis(20));
    let inbox = Inbox::new(env.pool.clone(), "limited", config).expect("inbox");
    env.publish("lim-1", "lim-1").await;
    let refused = inbox
        .run(
            &consumer,
            tokio::time::sleep(Duration::from_secs(2)),
            refuse,
        )
        .await;
    let message = match refused {
        Err(
            err @ RunError::MaxDeliverBelowInbox {
                max_deliver: 2,
                max_deliveries: 5,
            },
        ) => err.to_string(),
        other => panic!("expected MaxDeliverBelowInbox {{ 2, 5 }}, got {other:?}"),
    };
    assert!(message.contains("max_deliver"), "{message}");
    let info = consumer.clone().info().await.expect("info").clone();
    assert_eq!(
        (info.delivered.stream_sequence, info.num_pending),
        (0, 1),
        "nothing pulled, the message still to come"
    );
    // At the limit itself, the park is reached: the message is parked.
    let at_limit = stream
        .create_consumer(limited("at-limit", 5))
        .await
        .expect("consumer");
    let inbox = Inbox::new(env.pool.clone(), "at-limit", config).expect("inbox");
    let report = env.run_until_settled(&inbox, &at_limit, refuse).await;
    assert_eq!((report.retried, report.parked), (4, 1), "{report:?}");
    assert_eq!(
        env.record("at-limit", "lim-1").await,
        Some(("dead".into(), 5))
    );
    assert_eq!(
        count(
            &env,
            "SELECT count(*) FROM idem_inbox WHERE consumer = 'limited'"
        )
        .await,
        0
    );
}

/// Two deliveries of one message at once, the first failing after its write
/// and the lock wait, under read committed and serializable: the second runs
/// it once, after the first rolled back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_concurrent_deliveries_first_failing_apply_once() {
    let env = env().await;
    for (name, isolation) in [
        ("rc", idem::Isolation::ReadCommitted),
        ("ser", idem::Isolation::Serializable),
    ] {
        let policy = idem::RetryPolicy::new()
            .isolation(isolation)
            .deadline(Duration::from_secs(5));
        let inbox =
            Inbox::new(env.pool.clone(), name, InboxConfig::new().policy(policy)).expect("inbox");
        let failing = effect(|conn, payload| {
            let body = String::from_utf8_lossy(payload).into_owned();
            async move {
                diesel::sql_query("INSERT INTO effects (body) VALUES ($1)")
                    .bind::<Text, _>(body)
                    .execute(conn)
                    .await?;
                tokio::time::sleep(Duration::from_millis(400)).await;
                Err::<(), _>(AppError::Refused("late failure".into()))
            }
            .scope_boxed()
        });
        let second = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            inbox.handle("same", name.as_bytes(), 2, record_body).await
        };
        let (a, b) = tokio::join!(inbox.handle("same", b"failed", 1, failing), second);
        assert!(matches!(a, Ok(Outcome::Retry { .. })), "{a:?}");
        assert!(matches!(b, Ok(Outcome::Done(()))), "{b:?}");
        assert_eq!(env.record(name, "same").await, Some(("done".into(), 2)));
    }
    assert_eq!(env.effect_bodies().await, ["rc", "ser"]);
}

/// The broker is SIGKILLed and restarted (file store) while `run` is
/// consuming: every message applies once and the loop carries on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_broker_restarted_under_a_running_loop() {
    let env = env().await;
    let server = std::sync::Arc::new(idem_testing::nats::NatsServer::start().expect("server"));
    let js = jetstream::new(async_nats::connect(server.url()).await.expect("connect"));
    js.create_stream(stream::Config {
        name: "RESTART".into(),
        subjects: vec!["restart.>".into()],
        storage: stream::StorageType::File,
        ..Default::default()
    })
    .await
    .expect("stream");
    let consumer = js
        .get_stream("RESTART")
        .await
        .expect("stream")
        .create_consumer(pull::Config {
            durable_name: Some("restart".into()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(2),
            ..Default::default()
        })
        .await
        .expect("consumer");
    for i in 0..30 {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", format!("rs-{i:02}").as_str());
        js.publish_with_headers("restart.a", headers, format!("rs-{i:02}").into())
            .await
            .expect("publish")
            .await
            .expect("stored");
    }
    let config = InboxConfig::new().backoff(Duration::from_millis(100), Duration::from_millis(500));
    let inbox = Inbox::new(env.pool.clone(), "restart", config).expect("inbox");
    let slow = effect(|conn, payload| {
        let body = String::from_utf8_lossy(payload).into_owned();
        async move {
            diesel::sql_query("INSERT INTO effects (body) VALUES ($1)")
                .bind::<Text, _>(body)
                .execute(conn)
                .await?;
            tokio::time::sleep(Duration::from_millis(100)).await;
            Ok(())
        }
        .scope_boxed()
    });
    let killer = std::sync::Arc::clone(&server);
    let restart = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(1200)).await;
        tokio::task::spawn_blocking(move || killer.restart().expect("restart"))
            .await
            .expect("restarted");
    });
    let done = async {
        let client = idem_testing::connect(env._db.url()).await.expect("side");
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(45) {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let n: i64 = client
                .query_one(
                    "SELECT count(*) FROM idem_inbox WHERE consumer = 'restart'",
                    &[],
                )
                .await
                .expect("count")
                .get(0);
            if n == 30 {
                // Leave time for redeliveries of messages whose ack was lost.
                tokio::time::sleep(Duration::from_secs(3)).await;
                return;
            }
        }
    };
    let ran = inbox.run(&consumer, done, slow).await;
    restart.await.expect("restart task");
    println!("{ran:?}");
    let bodies = env.effect_bodies().await;
    let expected: Vec<String> = (0..30).map(|i| format!("rs-{i:02}")).collect();
    assert_eq!(bodies, expected, "each once; run {ran:?}");
    assert!(ran.is_ok(), "{ran:?}");
}

/// Found: `purge(older_than)` deletes the records settled more than
/// `older_than` ago and returns how many: with a retention reaching before
/// the calendar PostgreSQL keeps (10 000 years; the CLI's parser lets up
/// to about 292 million through as `--older-than`), there are none to
/// delete, but the purge failed with "timestamp out of range". A retention
/// past a thousand years now counts as a thousand.
#[tokio::test]
async fn found_purge_with_a_retention_past_the_calendar_fails() {
    let env = env().await;
    let inbox = Inbox::new(env.pool.clone(), "ancient", InboxConfig::new()).expect("inbox");
    let outcome = inbox
        .handle("a-1", b"a-1", 1, record_body)
        .await
        .expect("handled");
    assert!(matches!(outcome, Outcome::Done(())), "{outcome:?}");
    let purged = inbox
        .purge(Duration::from_secs(10_000 * 365 * 86_400), 100)
        .await;
    assert_eq!(env.record("ancient", "a-1").await, Some(("done".into(), 1)));
    assert!(matches!(purged, Ok(0)), "nothing that old: {purged:?}");
}

/// JetStream deduplicates by the `Nats-Msg-Id` as sent: `t-1` and `t-1 `
/// (a trailing space) are two messages, both stored. The client trims
/// header values as it parses them, so the inbox sees both as `t-1`, and
/// the second one's effect is skipped as a duplicate. Not fixable in idem
/// (it never sees the untrimmed value): documented with
/// `inbox::message_id`, and pinned here so that a client that stops
/// trimming shows up.
#[tokio::test]
async fn attack_ids_that_differ_in_end_spaces_are_one_id() {
    let env = env().await;
    let consumer = env.consumer("spaces", Duration::from_secs(30)).await;
    let inbox = Inbox::new(env.pool.clone(), "spaces", InboxConfig::new()).expect("inbox");
    env.publish("t-1", "plain").await;
    env.publish("t-1 ", "spaced").await;
    let stored = env
        .stream
        .stream()
        .clone()
        .info()
        .await
        .expect("info")
        .state
        .messages;
    let report = env.run_until_settled(&inbox, &consumer, record_body).await;
    assert_eq!(stored, 2, "the broker took them for two messages");
    assert_eq!((report.done, report.duplicates), (1, 1), "{report:?}");
    assert_eq!(
        env.effect_bodies().await,
        ["plain"],
        "the second taken for the first ({report:?})"
    );
}

/// A COMMIT held on its way to the server past `commit_timeout` (the
/// transaction and its record's lock stay open meanwhile), on the last
/// delivery allowed: the outcome is unknown, the park waits for the lock,
/// and the message ends applied once or parked with nothing applied,
/// never both, never twice.
#[tokio::test]
async fn attack_a_commit_held_past_its_timeout_on_the_last_delivery() {
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
    let policy = idem::RetryPolicy::new().commit_timeout(Duration::from_millis(300));
    let config = InboxConfig::new().max_deliveries(1).policy(policy);
    let inbox = Inbox::new(pool, "held", config).expect("inbox");
    // Connections set up first: their setup's statements match no rule.
    let warm = inbox.handle("warm", b"warm", 1, record_body).await;
    assert!(matches!(warm, Ok(Outcome::Done(()))), "{warm:?}");
    proxy.arm("COMMIT\0", Fault::HoldRequest(Duration::from_secs(2)));
    let started = Instant::now();
    let outcome = inbox.handle("h-1", b"h-1", 1, record_body).await;
    println!("{outcome:?} after {:?}", started.elapsed());
    assert_eq!(proxy.fired(), 1);
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let record = env.record("held", "h-1").await;
    let effects = env.effect_bodies().await;
    match record.as_ref().map(|r| r.0.as_str()) {
        Some("done") => assert_eq!(effects, ["h-1", "warm"], "{outcome:?}"),
        Some("dead") => assert_eq!(effects, ["warm"], "{outcome:?}"),
        _ => panic!("settled neither way: {record:?} {effects:?} {outcome:?}"),
    }
    let again = inbox.handle("h-1", b"h-1", 2, record_body).await;
    assert!(
        matches!(again, Ok(Outcome::Duplicate | Outcome::Dead)),
        "{again:?}"
    );
    assert!(env.effect_bodies().await.len() <= 2);
}
