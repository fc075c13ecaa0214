//! What a healthy broker refuses still counts toward `max_attempts`: an
//! event no stream captures ("no responders" while the stream answers), one
//! larger than the stream takes (its error answer), one larger than the
//! server's `max_payload` (refused before it is sent, which keeps the
//! connection up). Each is parked as dead, blocking only its key.

use idem::outbox::EventId;
use serde::Serialize;

use super::*;

/// An event with a payload of a chosen size.
#[derive(Debug, Clone, Serialize)]
struct Blob {
    key: String,
    bytes: String,
}

impl Event for Blob {
    const KIND: &'static str = "blob";
    const VERSION: u32 = 1;
    fn key(&self) -> String {
        self.key.clone()
    }
    fn subject(&self) -> String {
        // The subject of a Changed of the same key: one stream filter each.
        format!("changed.{}", self.key)
    }
}

#[retryable(max = 5, deadline_ms = 60000)]
async fn emit_blob(
    conn: &mut AsyncPgConnection,
    key: &str,
    size: usize,
) -> Result<EventId, AppError> {
    let blob = Blob {
        key: key.to_owned(),
        bytes: "x".repeat(size),
    };
    Ok(emit(conn, &blob).await?)
}

/// The stream's largest message.
const MAX_MESSAGE: usize = 1024;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_of_a_reachable_broker_count_and_park_the_event() {
    let (db, pool, client) = database().await;
    let js = jetstream::new(
        async_nats::connect(nats_url().await)
            .await
            .expect("connect to NATS"),
    );
    let max_payload = js.client().server_info().max_payload;
    let stream = unique("REFUSE");
    // "good", "big" and "huge" are captured; "lost" is not.
    js.create_stream(stream::Config {
        name: stream.clone(),
        subjects: ["good", "big", "huge"]
            .iter()
            .map(|key| format!("{stream}.changed.{key}"))
            .collect(),
        max_message_size: MAX_MESSAGE as i32,
        duplicate_window: Duration::from_secs(120),
        storage: stream::StorageType::Memory,
        ..Default::default()
    })
    .await
    .expect("create the stream");
    let env = Env {
        db,
        pool,
        client,
        js,
        stream,
    };

    for _ in 0..2 {
        change(&env.pool, "good").await.expect("change");
        change(&env.pool, "lost").await.expect("change");
    }
    emit_blob(&env.pool, "big", 2 * MAX_MESSAGE)
        .await
        .expect("emit");
    change(&env.pool, "big").await.expect("change");
    emit_blob(&env.pool, "huge", max_payload + 1)
        .await
        .expect("emit");

    let relay = Relay::new(env.pool.clone(), env.publisher().await)
        .max_attempts(3)
        .backoff(Duration::from_millis(10), Duration::from_millis(20))
        .poll_interval(Duration::from_millis(5));
    let running = Running::start(relay);
    bounded(env.until("SELECT count(*) FROM idem_outbox WHERE state = 'dead'", 3)).await;
    bounded(env.until("SELECT count(*) FROM idem_outbox WHERE state = 'sent'", 2)).await;
    // The relay's connection survived the huge event (never sent): a new
    // event goes through at once.
    change(&env.pool, "good").await.expect("change");
    let start = Instant::now();
    env.until("SELECT count(*) FROM idem_outbox WHERE state = 'sent'", 3)
        .await;
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "the next event waited {:?}",
        start.elapsed()
    );
    running.stop().await;

    let rows: Vec<(String, i64, String, i32)> = env
        .rows()
        .await
        .into_iter()
        .map(|(_, key, seq, state, attempts)| (key, seq, state, attempts))
        .collect();
    let row = |key: &str, seq: i64, state: &str, attempts: i32| {
        (key.to_owned(), seq, state.to_owned(), attempts)
    };
    assert_eq!(
        rows,
        vec![
            row("big", 1, "dead", 3),
            row("big", 2, "pending", 0),
            row("good", 1, "sent", 0),
            row("good", 2, "sent", 0),
            row("good", 3, "sent", 0),
            row("huge", 1, "dead", 3),
            row("lost", 1, "dead", 3),
            row("lost", 2, "pending", 0),
        ],
        "each refused head failed max_attempts times and is dead; its key waits"
    );
    let stored = env.stored().await;
    let keys: Vec<(&str, i64)> = stored.iter().map(|m| (m.key.as_str(), m.seq)).collect();
    assert_eq!(keys, vec![("good", 1), ("good", 2), ("good", 3)]);
}

/// A stream that stores other events but refuses one (its subject is at
/// the stream's per-subject limit; JetStream answers 503, as it does when it
/// has no leader) is not down: the refused event is charged and parked as
/// dead after `max_attempts`, blocking only its key, and every other key's
/// events go out at full speed meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_event_a_working_stream_cannot_store_is_charged_and_holds_back_no_other_key() {
    let (db, pool, client) = database().await;
    let js = jetstream::new(
        async_nats::connect(nats_url().await)
            .await
            .expect("connect to NATS"),
    );
    let stream = unique("PERSUBJECT");
    js.create_stream(stream::Config {
        name: stream.clone(),
        subjects: vec![format!("{stream}.>")],
        max_messages_per_subject: 1,
        discard: stream::DiscardPolicy::New,
        discard_new_per_subject: true,
        duplicate_window: Duration::from_secs(120),
        storage: stream::StorageType::Memory,
        ..Default::default()
    })
    .await
    .expect("create the stream");
    let env = Env {
        db,
        pool,
        client,
        js,
        stream,
    };
    // "hot" twice: its subject holds one message, so the second is refused.
    change(&env.pool, "hot").await.expect("change");
    change(&env.pool, "hot").await.expect("change");
    const OTHERS: i64 = 300;
    for i in 0..OTHERS {
        change(&env.pool, &format!("good-{i}"))
            .await
            .expect("change");
    }

    let relay = Relay::new(env.pool.clone(), env.publisher().await)
        .max_attempts(3)
        .backoff(Duration::from_millis(10), Duration::from_millis(20))
        .poll_interval(Duration::from_millis(5));
    let running = Running::start(relay);
    bounded(env.until("SELECT count(*) FROM idem_outbox WHERE state = 'dead'", 1)).await;
    bounded(env.until(
        "SELECT count(*) FROM idem_outbox WHERE state = 'sent'",
        OTHERS + 1,
    ))
    .await;
    running.stop().await;

    let hot: Vec<(i64, String, i32)> = env
        .rows()
        .await
        .into_iter()
        .filter(|row| row.1 == "hot")
        .map(|(_, _, seq, state, attempts)| (seq, state, attempts))
        .collect();
    assert_eq!(
        hot,
        vec![(1, "sent".to_owned(), 0), (2, "dead".to_owned(), 3)],
        "the refused event was charged, and parked"
    );
    assert_eq!(env.stream_count().await, OTHERS as u64 + 1);
}
