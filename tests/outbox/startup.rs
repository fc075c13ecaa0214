//! The relay's start-up check of the stream's duplicate window, and the
//! wake-up on NOTIFY.

use idem::outbox::{PrepareError, RelayError};

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_forgets_ids_too_soon_is_refused_at_start_up() {
    let env = env("window", Duration::from_secs(10)).await;
    change(&env.pool, "a").await.expect("change");
    let relay = Relay::new(env.pool.clone(), env.publisher().await)
        .lease(Duration::from_secs(15))
        .max_attempts(3)
        .backoff(Duration::from_secs(1), Duration::from_secs(60));
    let refused = bounded(relay.run(std::future::pending())).await;
    match refused {
        Err(RelayError::Prepare(PrepareError::DedupWindowTooShort {
            stream,
            window,
            horizon,
            lease,
            retry,
        })) => {
            assert_eq!(stream, env.stream);
            assert_eq!(window, Duration::from_secs(10));
            assert_eq!(lease, Duration::from_secs(15));
            assert_eq!(
                retry,
                Duration::from_secs(3),
                "1 s + 2 s between 3 attempts"
            );
            assert_eq!(horizon, Duration::from_secs(18));
        }
        other => panic!("not refused: {other:?}"),
    }
    // Nothing was claimed nor published.
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM idem_outbox WHERE state = 'pending' AND lease_until IS NULL"
        )
        .await,
        1
    );
    assert_eq!(env.stream_count().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_wakes_an_idle_relay_through_notify() {
    let env = env("notify", Duration::from_secs(120)).await;
    // Polling once a minute: only NOTIFY can deliver within the wait below.
    let relay =
        Relay::new(env.pool.clone(), env.publisher().await).poll_interval(Duration::from_secs(60));
    let running = Running::start(relay);
    // Let it finish its first (empty) round and LISTEN.
    tokio::time::sleep(Duration::from_millis(500)).await;
    change(&env.pool, "a").await.expect("change");
    let start = Instant::now();
    while env.stream_count().await == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the relay did not wake"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        env.scalar("SELECT count(*) FROM idem_outbox WHERE state = 'sent'")
            .await,
        1
    );
    running.stop().await;
}
