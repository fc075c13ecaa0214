//! A message whose effect always fails is parked after the allowed
//! deliveries while the others flow; a requeue runs it again.

use super::*;

#[tokio::test]
async fn a_poison_message_is_parked_others_flow_and_requeue_runs_it() {
    let env = env().await;
    let consumer = env.consumer("poison", Duration::from_secs(30)).await;
    let config = InboxConfig::new()
        .max_deliveries(3)
        .backoff(Duration::from_millis(20), Duration::from_millis(80));
    let inbox = Inbox::new(env.pool.clone(), "poison", config).expect("inbox");
    env.publish("ok-1", "ok-1").await;
    env.publish("bad", "bad").await;
    env.publish("ok-2", "ok-2").await;

    let calls = Arc::new(AtomicU32::new(0));
    let seen = Arc::clone(&calls);
    let refuses_bad = effect(move |conn, payload| {
        seen.fetch_add(1, Ordering::SeqCst);
        let body = String::from_utf8_lossy(payload).into_owned();
        async move {
            if body == "bad" {
                return Err(AppError::Refused(format!("cannot apply {body}")));
            }
            diesel::sql_query("INSERT INTO effects (body) VALUES ($1)")
                .bind::<Text, _>(body)
                .execute(conn)
                .await?;
            Ok(())
        }
        .scope_boxed()
    });
    let report = env.run_until_settled(&inbox, &consumer, refuses_bad).await;
    assert_eq!(
        (report.done, report.retried, report.parked),
        (2, 2, 1),
        "{report:?}"
    );
    assert_eq!(
        AtomicU32::load(&calls, Ordering::SeqCst),
        5,
        "2 good + 3 deliveries of the bad one"
    );
    assert_eq!(env.effect_bodies().await, ["ok-1", "ok-2"]);
    assert_eq!(env.record("poison", "bad").await, Some(("dead".into(), 3)));

    let letters = inbox.dead_letters(10).await.expect("dead letters");
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].msg_id, "bad");
    assert_eq!(letters[0].deliveries, 3);
    assert_eq!(letters[0].last_error, "refused: cannot apply bad");
    assert_eq!(letters[0].payload, b"bad");

    // A requeue whose effect fails again leaves the letter as it was.
    let failed = inbox.requeue("bad", refuse).await;
    assert!(matches!(failed, Err(AppError::Refused(_))));
    assert_eq!(env.record("poison", "bad").await, Some(("dead".into(), 3)));

    // Fixed: the requeue runs it on the stored body, and records it done.
    let ran = inbox.requeue("bad", record_body).await.expect("requeued");
    assert_eq!(ran, Some(()));
    assert_eq!(env.effect_bodies().await, ["bad", "ok-1", "ok-2"]);
    assert_eq!(env.record("poison", "bad").await, Some(("done".into(), 4)));
    assert!(inbox
        .dead_letters(10)
        .await
        .expect("dead letters")
        .is_empty());
    assert_eq!(
        inbox.requeue("bad", record_body).await.expect("no-op"),
        None,
        "requeued once"
    );
}

/// An effect that swaps its connection (writing through one of its own,
/// which commits at once) is parked at its first delivery, not delivered
/// again: each delivery would swap again and write again (it was answered
/// `Retry` up to the last delivery, its write committed each time).
#[tokio::test]
async fn an_effect_that_swaps_its_connection_is_parked_at_once() {
    let env = env().await;
    let inbox = Inbox::new(
        env.pool.clone(),
        "swap",
        InboxConfig::new().max_deliveries(5),
    )
    .expect("inbox");
    let url = env._db.url().to_owned();
    let swaps = effect(move |conn, payload| {
        let (url, body) = (url.clone(), String::from_utf8_lossy(payload).into_owned());
        async move {
            let mut own = AsyncPgConnection::establish(&url).await.expect("connect");
            diesel::sql_query("INSERT INTO effects (body) VALUES ($1)")
                .bind::<Text, _>(body)
                .execute(&mut own)
                .await?;
            std::mem::swap(conn, &mut own);
            Ok(())
        }
        .scope_boxed()
    });
    let mut swaps = swaps;
    let outcome = inbox
        .handle("swap-1", b"swapped", 1, &mut swaps)
        .await
        .expect("handled");
    match &outcome {
        Outcome::Parked {
            error: AppError::Idem(idem::Error::ConnectionReplaced),
        } => {}
        other => panic!("not parked at once: {other:?}"),
    }
    assert_eq!(env.record("swap", "swap-1").await, Some(("dead".into(), 1)));
    let again = inbox
        .handle("swap-1", b"swapped", 2, &mut swaps)
        .await
        .expect("handled");
    assert!(matches!(again, Outcome::Dead), "{again:?}");
    assert_eq!(env.effect_bodies().await, ["swapped"], "written once");
}
