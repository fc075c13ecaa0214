//! Per-key order with several relays at once.

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

use idem::outbox::{OutboxMessage, PublishError, Published, Publisher};

use super::*;

/// The real publisher, counting what went through it: only to show that
/// every relay took part, never to judge the order.
struct Counted {
    inner: NatsPublisher,
    acked: Arc<AtomicUsize>,
}

impl Publisher for Counted {
    async fn publish(&self, message: &OutboxMessage) -> Result<Published, PublishError> {
        let published = self.inner.publish(message).await?;
        self.acked.fetch_add(1, Ordering::SeqCst);
        Ok(published)
    }
}

const KEYS: usize = 20;
const EVENTS: usize = 300;
const WRITERS: usize = 6;
const RELAYS: usize = 3;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_relays_publish_every_key_in_commit_order() {
    let env = env("order", Duration::from_secs(120)).await;
    // Small batches and a short poll, so the relays interleave on every key.
    let mut relays = Vec::new();
    let mut acked = Vec::new();
    for _ in 0..RELAYS {
        let count = Arc::new(AtomicUsize::new(0));
        acked.push(count.clone());
        let publisher = Counted {
            inner: env.publisher().await,
            acked: count,
        };
        let relay = Relay::new(env.pool.clone(), publisher)
            .batch_size(4)
            .poll_interval(Duration::from_millis(5));
        relays.push(Running::start(relay));
    }

    // Writers change the aggregates while the relays run: each change bumps
    // the aggregate's counter (whose row lock orders its writers by commit)
    // and emits the new value.
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let pool = env.pool.clone();
            tokio::spawn(async move {
                for i in (w..EVENTS).step_by(WRITERS) {
                    let key = format!("agg-{}", i % KEYS);
                    change(&pool, &key).await.expect("change");
                }
            })
        })
        .collect();
    for w in writers {
        bounded(w).await.expect("writer");
    }
    bounded(env.until(
        "SELECT count(*) FROM idem_outbox WHERE state = 'sent'",
        EVENTS as i64,
    ))
    .await;
    for r in relays {
        r.stop().await;
    }
    for (i, count) in acked.iter().enumerate() {
        assert!(
            count.load(Ordering::SeqCst) > 0,
            "relay {i} published nothing"
        );
    }

    // The database: every event sent, seqs 1..n per key, matching the
    // business counter.
    assert_eq!(
        env.scalar("SELECT count(*) FROM idem_outbox").await,
        EVENTS as i64
    );
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM idem_outbox o JOIN counters c USING (key)
             WHERE (o.payload->>'n')::bigint <> o.seq"
        )
        .await,
        0,
        "the seq of an event is its commit position in the key"
    );

    // The broker: each event stored once, and per key in commit order.
    let stored = env.stored().await;
    assert_eq!(stored.len(), EVENTS, "each event stored once");
    let keys = by_key(&stored);
    assert_eq!(keys.len(), KEYS);
    for (key, messages) in keys {
        let ns: Vec<i64> = messages.iter().map(|m| m.event.n).collect();
        let want: Vec<i64> = (1..=ns.len() as i64).collect();
        assert_eq!(ns, want, "key {key}: stored out of commit order");
        let seqs: Vec<i64> = messages.iter().map(|m| m.seq).collect();
        assert_eq!(seqs, want, "key {key}: Idem-Event-Seq");
    }
}
