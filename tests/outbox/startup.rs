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
    // Let it finish its first (empty) round and LISTEN (had it not yet,
    // its round after `LISTEN` sends the event: see the next test).
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

/// Found by an audit of the suite's timing: an event committed after the
/// relay's round claimed and before its `LISTEN` took effect notified no
/// one, and waited for the next poll (a minute here). The proxy holds the
/// `LISTEN` 1 s, and the event is committed meanwhile: the relay, which
/// now looks once more when it starts listening, sends it at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_committed_before_listen_takes_effect_is_sent_at_once() {
    use idem_testing::proxy::{Fault, Proxy};
    let env = env("prelisten", Duration::from_secs(120)).await;
    let proxy = Proxy::start(env.db.url()).await.expect("a proxy");
    let pool = build_pool_with(
        proxy.url(),
        &PoolConfig {
            max_size: 4,
            wait_timeout: Duration::from_secs(10),
            ..PoolConfig::default()
        },
    )
    .expect("a pool");
    proxy.arm(
        "LISTEN idem_outbox",
        Fault::HoldRequest(Duration::from_secs(1)),
    );
    let relay = Relay::new(pool, env.publisher().await).poll_interval(Duration::from_secs(60));
    let running = Running::start(relay);
    let start = Instant::now();
    while proxy.fired() == 0 {
        assert!(start.elapsed() < Duration::from_secs(10), "never listened");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    change(&env.pool, "a").await.expect("change");
    let start = Instant::now();
    while env.stream_count().await == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the event waited for the next poll"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    running.stop().await;
}

/// A lease that does not exceed the publisher's wait for one ack (the
/// JetStream context's timeout) is refused at start-up, before any claim:
/// another relay would claim an event still being published, and publish
/// it again. At the bound too; past it, the relay runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_within_the_publish_timeout_is_refused_at_start_up() {
    let env = env("leaseshort", Duration::from_secs(120)).await;
    change(&env.pool, "a").await.expect("change");
    let publisher = || async {
        let client = async_nats::connect(nats_url().await).await.expect("NATS");
        let mut context = jetstream::new(client);
        context.set_timeout(Duration::from_secs(20));
        NatsPublisher::new(context, &env.stream).subject_prefix(&env.stream)
    };
    for lease in [None, Some(Duration::from_secs(20))] {
        let relay = Relay::new(env.pool.clone(), publisher().await);
        let relay = match lease {
            Some(lease) => relay.lease(lease),
            None => relay,
        };
        match bounded(relay.run(std::future::pending())).await {
            Err(RelayError::Prepare(PrepareError::LeaseTooShort {
                lease: got,
                publish_timeout,
            })) => {
                let want = lease.unwrap_or(Duration::from_secs(15));
                assert_eq!((got, publish_timeout), (want, Duration::from_secs(20)));
            }
            other => panic!("lease {lease:?}: not refused: {other:?}"),
        }
    }
    let unclaimed =
        "SELECT count(*) FROM idem_outbox WHERE state = 'pending' AND lease_until IS NULL";
    assert_eq!(env.scalar(unclaimed).await, 1);
    assert_eq!(env.stream_count().await, 0);
    let relay = Relay::new(env.pool.clone(), publisher().await).lease(Duration::from_secs(21));
    let running = Running::start(relay);
    let start = Instant::now();
    while env.stream_count().await == 0 {
        assert!(start.elapsed() < Duration::from_secs(10), "not published");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    running.stop().await;
}
