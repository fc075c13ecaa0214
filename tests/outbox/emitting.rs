//! Emitting: in the business transaction or not at all; deterministic ids
//! inside an idempotent call; the broker drops a republished event.

use std::sync::Mutex;

use idem::attempt::{current_attempt, lost_race};
use idem::idempotent;

use super::*;

#[retryable(max = 4, deadline_ms = 30000)]
async fn change_then_refuse(conn: &mut AsyncPgConnection, key: &str) -> Result<(), AppError> {
    emit(
        conn,
        &Changed {
            key: key.to_owned(),
            n: 1,
        },
    )
    .await?;
    Err(AppError::Refused)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_commits_and_rolls_back_with_its_transaction() {
    let env = env("emit_tx", Duration::from_secs(120)).await;

    let refused = change_then_refuse(&env.pool, "a").await;
    assert!(matches!(refused, Err(AppError::Refused)), "{refused:?}");
    assert_eq!(env.scalar("SELECT count(*) FROM idem_outbox").await, 0);
    assert_eq!(env.scalar("SELECT count(*) FROM idem_outbox_keys").await, 0);

    let id = change(&env.pool, "a").await.expect("commit");
    let row = env
        .client
        .query_one(
            "SELECT id::text, key, seq, subject, kind, version, payload::text, state
             FROM idem_outbox",
            &[],
        )
        .await
        .expect("one row");
    assert_eq!(row.get::<_, String>(0), id.to_string());
    assert_eq!(row.get::<_, String>(1), "a");
    assert_eq!(row.get::<_, i64>(2), 1, "the rolled-back event took no seq");
    assert_eq!(row.get::<_, String>(3), "changed.a");
    assert_eq!(row.get::<_, String>(4), "changed");
    assert_eq!(row.get::<_, i64>(5), 3);
    let payload: Changed = serde_json::from_str(&row.get::<_, String>(6)).expect("json");
    assert_eq!(
        payload,
        Changed {
            key: "a".into(),
            n: 1
        }
    );
    assert_eq!(row.get::<_, String>(7), "pending");
    assert_eq!(
        id.as_uuid().get_version_num(),
        7,
        "outside an idempotent call: UUIDv7"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emitting_outside_an_attempt_is_refused_and_writes_nothing() {
    let env = env("emit_outside", Duration::from_secs(120)).await;
    let mut conn = AsyncPgConnection::establish(env.db.url())
        .await
        .expect("connect");
    // Even inside a transaction of its own: only an attempt's counts.
    let refused = conn
        .transaction::<_, AppError, _>(async |conn| {
            Ok(emit(
                conn,
                &Changed {
                    key: "a".into(),
                    n: 1,
                },
            )
            .await?)
        })
        .await;
    assert!(
        matches!(refused, Err(AppError::Emit(EmitError::OutsideAttempt))),
        "{refused:?}"
    );
    let bare = emit(
        &mut conn,
        &Changed {
            key: "a".into(),
            n: 1,
        },
    )
    .await;
    assert!(matches!(bare, Err(EmitError::OutsideAttempt)), "{bare:?}");
    assert_eq!(env.scalar("SELECT count(*) FROM idem_outbox").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_event_is_refused_before_anything_is_written() {
    let env = env("emit_invalid", Duration::from_secs(120)).await;
    for key in ["", "a b.*"] {
        let refused = change(&env.pool, key).await;
        assert!(
            matches!(refused, Err(AppError::Emit(EmitError::Invalid(_)))),
            "{key:?}: {refused:?}"
        );
    }
    assert_eq!(env.scalar("SELECT count(*) FROM idem_outbox").await, 0);
    assert_eq!(env.scalar("SELECT count(*) FROM counters").await, 0);
}

/// Emits two events; fails after them on the first `fail_runs` calls, and
/// loses a race on the first attempt of every call, so each call runs its
/// body twice.
#[idempotent(key = key, scope = tenant, fingerprint(tenant))]
#[retryable(max = 4, deadline_ms = 30000)]
async fn order(
    conn: &mut AsyncPgConnection,
    tenant: &i64,
    key: &str,
    seen: &Mutex<Vec<Vec<EventId>>>,
    fail: &std::sync::atomic::AtomicBool,
) -> Result<(), AppError> {
    let a = emit(
        conn,
        &Changed {
            key: format!("order-{tenant}"),
            n: 1,
        },
    )
    .await?;
    let b = emit(
        conn,
        &Changed {
            key: format!("order-{tenant}"),
            n: 2,
        },
    )
    .await?;
    seen.lock().unwrap().push(vec![a, b]);
    if current_attempt() == Some(1) {
        lost_race();
        return Err(AppError::Refused);
    }
    if fail.load(Ordering::SeqCst) {
        return Err(AppError::Refused);
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_run_again_emits_the_same_ids_and_the_broker_drops_the_copies() {
    let env = env("emit_rerun", Duration::from_secs(120)).await;
    let seen = Mutex::new(Vec::new());
    let fail = std::sync::atomic::AtomicBool::new(true);

    // The first request fails after emitting (replayed once, then refused):
    // nothing of it stays.
    let first = order(&env.pool, &7, "req-1", &seen, &fail).await;
    assert!(matches!(first, Err(AppError::Refused)), "{first:?}");
    assert_eq!(env.scalar("SELECT count(*) FROM idem_outbox").await, 0);
    // The same key again succeeds.
    fail.store(false, Ordering::SeqCst);
    order(&env.pool, &7, "req-1", &seen, &fail)
        .await
        .expect("second request");
    // Another scope with the same key is another request.
    order(&env.pool, &8, "req-1", &seen, &fail)
        .await
        .expect("other tenant");

    let seen = seen.into_inner().unwrap();
    assert_eq!(seen.len(), 6, "two attempts for each of three calls");
    // The attempts of one request emit the same ids; the second request
    // with the key (the first committed nothing) is another request, and
    // emits its own.
    assert_eq!(seen[0], seen[1], "the attempts of the first request");
    assert_eq!(seen[2], seen[3], "the attempts of the second request");
    assert_ne!(seen[0][0], seen[2][0], "two requests share no id");
    let ids = &seen[2];
    assert_eq!(ids[0].as_uuid().get_version_num(), 5);
    assert_ne!(ids[0], ids[1]);
    assert_ne!(seen[4][0], ids[0], "another scope shares no id");
    assert_eq!(seen[4], seen[5]);

    let stored_ids: Vec<String> = env
        .rows()
        .await
        .into_iter()
        .filter(|r| r.1 == "order-7")
        .map(|r| r.0)
        .collect();
    assert_eq!(stored_ids, vec![ids[0].to_string(), ids[1].to_string()]);

    // Publish; then act out a relay that published and died before marking
    // them sent: the next relay publishes them again.
    let relay = Relay::new(env.pool.clone(), env.publisher().await).listen(false);
    // One event per key and round: two rounds, and one that finds nothing.
    while bounded(relay.run_once()).await.expect("round").claimed > 0 {}
    assert_eq!(
        env.scalar("SELECT count(*) FROM idem_outbox WHERE state = 'sent'")
            .await,
        4
    );
    assert_eq!(env.stream_count().await, 4);
    env.client
        .batch_execute("UPDATE idem_outbox SET state = 'pending', sent_at = NULL")
        .await
        .expect("unmark");
    while bounded(relay.run_once()).await.expect("round").claimed > 0 {}
    assert_eq!(
        env.scalar("SELECT count(*) FROM idem_outbox WHERE state = 'sent'")
            .await,
        4
    );
    assert_eq!(
        env.stream_count().await,
        4,
        "the stream stored each event once"
    );
    let stored = env.stored().await;
    let msg_ids: Vec<&str> = stored
        .iter()
        .filter(|m| m.key == "order-7")
        .map(|m| m.msg_id.as_str())
        .collect();
    assert_eq!(msg_ids, vec![ids[0].to_string(), ids[1].to_string()]);
    assert_eq!(stored[0].subject, format!("{}.changed.order-7", env.stream));

    // The broker's own word on a copy: the ack says duplicate.
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", ids[0].to_string().as_str());
    let ack = env
        .js
        .publish_with_headers(
            format!("{}.changed.order-7", env.stream),
            headers,
            "{}".into(),
        )
        .await
        .expect("publish")
        .await
        .expect("ack");
    assert!(ack.duplicate);
    assert_eq!(env.stream_count().await, 4);
}
