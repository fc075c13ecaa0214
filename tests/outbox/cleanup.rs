//! Sent events are deleted after the retention, in batches; others stay.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sent_events_past_the_retention_are_deleted_in_batches() {
    let env = env("cleanup", Duration::from_secs(120)).await;
    for _ in 0..7 {
        change(&env.pool, "a").await.expect("change");
    }
    let relay = Relay::new(env.pool.clone(), env.publisher().await)
        .retention(Duration::from_secs(3600))
        .cleanup(Duration::from_secs(60), 2);
    // Seqs 1..=6 are published; 7 stays pending.
    env.client
        .batch_execute(
            "UPDATE idem_outbox SET next_attempt_at = now() + interval '1 hour' WHERE seq = 7",
        )
        .await
        .expect("hold back seq 7");
    while bounded(relay.run_once()).await.expect("round").claimed > 0 {}
    assert_eq!(
        env.scalar("SELECT count(*) FROM idem_outbox WHERE state = 'sent'")
            .await,
        6
    );
    // Five of them were sent two hours ago.
    env.client
        .batch_execute("UPDATE idem_outbox SET sent_at = now() - interval '2 hours' WHERE seq <= 5")
        .await
        .expect("age");

    let deleted = bounded(relay.clean()).await.expect("clean");
    assert_eq!(deleted, 5);
    let left: Vec<(i64, String)> = env.rows().await.into_iter().map(|r| (r.2, r.3)).collect();
    assert_eq!(
        left,
        vec![(6, "sent".to_owned()), (7, "pending".to_owned())]
    );
    // The stream keeps what was published.
    assert_eq!(env.stream_count().await, 6);
    // The next event of the key still gets the next seq.
    change(&env.pool, "a").await.expect("change");
    assert_eq!(env.scalar("SELECT max(seq) FROM idem_outbox").await, 8);
}
