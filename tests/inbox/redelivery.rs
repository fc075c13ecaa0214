//! A message that comes back after its effect committed is skipped; one
//! whose effect failed comes back unrecorded and runs once.

use super::*;

/// The consumer committed the effect and died before acking: JetStream
/// redelivers after `ack_wait`, the loop finds the record and acks without
/// running the effect again.
#[tokio::test]
async fn redelivery_after_commit_before_ack_runs_the_effect_once() {
    let env = env().await;
    let consumer = env
        .consumer("crash-before-ack", Duration::from_secs(1))
        .await;
    let inbox =
        Inbox::new(env.pool.clone(), "crash-before-ack", InboxConfig::new()).expect("inbox");
    env.publish("order-1", "order-1").await;

    let first = fetch_one(&consumer).await;
    assert_eq!(delivered(&first), 1);
    let outcome = inbox
        .handle("order-1", &first.payload, delivered(&first), record_body)
        .await
        .expect("handled");
    assert!(matches!(outcome, Outcome::Done(())), "{outcome:?}");
    // The crash: no ack. The broker still holds the message.
    drop(first);
    assert_eq!(env.effect_bodies().await, ["order-1"]);

    let report = env.run_until_settled(&inbox, &consumer, record_body).await;
    assert_eq!(report.duplicates, 1, "{report:?}");
    assert_eq!(report.done, 0, "{report:?}");
    assert_eq!(
        env.effect_bodies().await,
        ["order-1"],
        "the effect ran once"
    );
    assert_eq!(
        env.record("crash-before-ack", "order-1").await,
        Some(("done".into(), 1))
    );
}

/// The effect writes, then fails: its write and the message's record roll
/// back together; the redelivery runs it once and records it.
#[tokio::test]
async fn a_failed_effect_rolls_back_with_its_record_and_runs_once_on_redelivery() {
    let env = env().await;
    let consumer = env.consumer("fails-once", Duration::from_secs(30)).await;
    let config = InboxConfig::new().backoff(Duration::from_millis(50), Duration::from_millis(50));
    let inbox = Inbox::new(env.pool.clone(), "fails-once", config).expect("inbox");
    env.publish("order-2", "order-2").await;

    let failing = effect(|conn, payload| {
        let body = String::from_utf8_lossy(payload).into_owned();
        async move {
            diesel::sql_query("INSERT INTO effects (body) VALUES ($1)")
                .bind::<Text, _>(body)
                .execute(conn)
                .await?;
            Err::<(), _>(AppError::Refused("not yet".into()))
        }
        .scope_boxed()
    });
    let first = fetch_one(&consumer).await;
    let outcome = inbox
        .handle("order-2", &first.payload, delivered(&first), failing)
        .await
        .expect("handled");
    let Outcome::Retry { error, after } = outcome else {
        panic!("expected a retry, got {outcome:?}");
    };
    assert!(matches!(error, AppError::Refused(_)));
    assert_eq!(after, Duration::from_millis(50));
    assert!(
        env.effect_bodies().await.is_empty(),
        "the effect's write rolled back"
    );
    assert_eq!(
        env.record("fails-once", "order-2").await,
        None,
        "nothing recorded"
    );
    first
        .ack_with(AckKind::Nak(Some(after)))
        .await
        .expect("nak");

    let report = env.run_until_settled(&inbox, &consumer, record_body).await;
    assert_eq!(report.done, 1, "{report:?}");
    assert_eq!(env.effect_bodies().await, ["order-2"]);
    assert_eq!(
        env.record("fails-once", "order-2").await,
        Some(("done".into(), 2))
    );
}

/// Without a `Nats-Msg-Id`, a message is recorded under its stream sequence.
#[tokio::test]
async fn a_message_without_an_id_is_recorded_under_its_sequence() {
    let env = env().await;
    let consumer = env.consumer("no-id", Duration::from_secs(30)).await;
    let inbox = Inbox::new(env.pool.clone(), "no-id", InboxConfig::new()).expect("inbox");
    env.js
        .publish(env.stream.subject().to_owned(), "anonymous".into())
        .await
        .expect("publish")
        .await
        .expect("stored");
    let report = env.run_until_settled(&inbox, &consumer, record_body).await;
    assert_eq!(report.done, 1, "{report:?}");
    assert_eq!(env.record("no-id", "seq:1").await, Some(("done".into(), 1)));
}
