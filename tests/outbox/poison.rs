//! A poison event: retried with backoff, parked as dead, blocking only its
//! key; requeued, it flows.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use idem::outbox::{requeue_key, OutboxMessage, PublishError, Published, Publisher};

use super::*;

/// The real publisher, except that events of `key` fail while `failing`.
pub(crate) struct FailFor {
    pub(crate) inner: NatsPublisher,
    pub(crate) key: String,
    pub(crate) failing: Arc<AtomicBool>,
}

impl Publisher for FailFor {
    async fn publish(&self, message: &OutboxMessage) -> Result<Published, PublishError> {
        if message.key == self.key && self.failing.load(Ordering::SeqCst) {
            return Err(PublishError::new("the broker refused this one"));
        }
        self.inner.publish(message).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_poison_event_blocks_only_its_key_until_requeued() {
    let env = env("poison", Duration::from_secs(120)).await;
    for _ in 0..3 {
        for key in ["bad", "good-1", "good-2"] {
            change(&env.pool, key).await.expect("change");
        }
    }
    let failing = Arc::new(AtomicBool::new(true));
    let relay = Relay::new(
        env.pool.clone(),
        FailFor {
            inner: env.publisher().await,
            key: "bad".into(),
            failing: failing.clone(),
        },
    )
    .max_attempts(3)
    .backoff(Duration::from_millis(20), Duration::from_millis(40))
    .poll_interval(Duration::from_millis(5));
    let running = Running::start(relay);

    bounded(env.until("SELECT count(*) FROM idem_outbox WHERE state = 'dead'", 1)).await;
    bounded(env.until("SELECT count(*) FROM idem_outbox WHERE state = 'sent'", 6)).await;
    // Give the relay time to (wrongly) go past the dead head.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let bad: Vec<_> = env
        .rows()
        .await
        .into_iter()
        .filter(|r| r.1 == "bad")
        .collect();
    let states: Vec<(i64, &str, i32)> = bad.iter().map(|r| (r.2, r.3.as_str(), r.4)).collect();
    assert_eq!(
        states,
        vec![(1, "dead", 3), (2, "pending", 0), (3, "pending", 0)],
        "the head failed 3 times and is dead; the rest of its key waits untried"
    );
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM idem_outbox WHERE state = 'dead' AND last_error LIKE '%refused%'"
        )
        .await,
        1
    );
    let stored = env.stored().await;
    assert_eq!(stored.len(), 6);
    assert!(
        stored.iter().all(|m| m.key != "bad"),
        "nothing of the bad key reached the stream"
    );
    let stats = idem::outbox::stats(&mut env.pool.get().await.expect("conn"))
        .await
        .expect("stats");
    assert_eq!((stats.pending, stats.dead), (2, 1));

    // Fixed, and requeued: the key flows, in order.
    failing.store(false, Ordering::SeqCst);
    let mut conn = env.pool.get().await.expect("conn");
    assert_eq!(requeue_key(&mut conn, "bad").await.expect("requeue"), 1);
    drop(conn);
    bounded(env.until("SELECT count(*) FROM idem_outbox WHERE state = 'sent'", 9)).await;
    running.stop().await;
    let stored = env.stored().await;
    let bad: Vec<i64> = by_key(&stored)["bad"].iter().map(|m| m.event.n).collect();
    assert_eq!(bad, vec![1, 2, 3]);
}
