//! Purging old `done` records in batches; dead letters stay.

use super::*;

#[tokio::test]
async fn purge_deletes_old_done_records_in_batches_and_keeps_dead_letters() {
    let env = env().await;
    let config = InboxConfig::new().max_deliveries(1);
    let inbox = Inbox::new(env.pool.clone(), "retained", config).expect("inbox");
    let other = Inbox::new(env.pool.clone(), "other", config).expect("inbox");
    for id in ["m1", "m2", "m3", "m4", "m5"] {
        let outcome = inbox
            .handle(id, id.as_bytes(), 1, record_body)
            .await
            .expect("handled");
        assert!(matches!(outcome, Outcome::Done(())), "{outcome:?}");
    }
    let outcome = other
        .handle("m1", b"m1", 1, record_body)
        .await
        .expect("handled");
    assert!(matches!(outcome, Outcome::Done(())));
    let parked = inbox
        .handle("dead", b"dead", 1, refuse)
        .await
        .expect("handled");
    assert!(matches!(parked, Outcome::Parked { .. }), "{parked:?}");
    env.client
        .batch_execute(
            "UPDATE idem_inbox SET updated_at = now() - interval '2 hours' \
             WHERE msg_id IN ('m1', 'm2', 'm3', 'dead')",
        )
        .await
        .expect("age some records");

    let deleted = inbox
        .purge(Duration::from_secs(3600), 2)
        .await
        .expect("purge");
    assert_eq!(deleted, 3, "m1..m3 of this consumer, in batches of 2");
    let left: Vec<(String, String)> = env
        .client
        .query(
            "SELECT consumer, msg_id FROM idem_inbox ORDER BY consumer, msg_id",
            &[],
        )
        .await
        .expect("records")
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    let expected = [
        ("other", "m1"),
        ("retained", "dead"),
        ("retained", "m4"),
        ("retained", "m5"),
    ];
    assert_eq!(left, expected.map(|(c, m)| (c.to_owned(), m.to_owned())));

    // A purged id is new again: this is why retention must outlast redelivery.
    let again = inbox
        .handle("m1", b"m1", 1, record_body)
        .await
        .expect("handled");
    assert!(matches!(again, Outcome::Done(())));
    let deleted = inbox.purge(Duration::ZERO, 100).await.expect("purge");
    assert_eq!(deleted, 3, "m1, m4, m5; the dead letter stays");
    assert_eq!(inbox.dead_letters(10).await.expect("dead").len(), 1);
}
