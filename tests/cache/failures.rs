//! Redis stopped, frozen or flushed: every reply is the same bytes, from
//! the database, at a bounded cost. Each test has a `redis-server` of its own.

use idem_testing::redis::RedisServer;

use super::*;

/// Generous bound for one call on a busy two-core machine; a call that
/// waited on a dead Redis without a timeout would take far longer.
const BOUND: Duration = Duration::from_secs(2);

/// Redis stopped: replays fall through to the database with the bytes the
/// cache gave, and the back-off spares later calls the attempt; a new key
/// still runs once.
#[tokio::test]
async fn redis_down_falls_through_with_the_same_bytes() {
    let env = env().await;
    let server = RedisServer::start().expect("a redis-server");
    let cache = cache_on(&server);
    pay(&env.pool, Some(&cache), &cmd("down", 10.0))
        .await
        .unwrap();
    let (counted, proxy) = env.counted_pool(&cache).await;
    let up = pay(&counted, Some(&cache), &cmd("down", 10.0)).await;
    assert_eq!(proxy.accepted(), 0, "answered from Redis while it was up");

    server.stop();
    let mut slowest = Duration::ZERO;
    for _ in 0..20 {
        let started = Instant::now();
        let down = pay(&env.pool, Some(&cache), &cmd("down", 10.0)).await;
        slowest = slowest.max(started.elapsed());
        assert_eq!(reply_bytes(&down), reply_bytes(&up));
    }
    assert!(slowest < BOUND, "{slowest:?}");

    let fresh = pay(&env.pool, Some(&cache), &cmd("down-new", 10.0)).await;
    assert!(!fresh.unwrap().replayed);
    let again = pay(&env.pool, Some(&cache), &cmd("down-new", 10.0)).await;
    assert!(again.unwrap().replayed);
    assert_eq!(env.effects("down-new").await, 1, "the database decided");
}

/// Redis frozen (SIGSTOP: connected, silent): each lookup gives up after
/// the cache's timeout and the database answers with the same bytes.
#[tokio::test]
async fn a_frozen_redis_costs_at_most_its_timeout() {
    let env = env().await;
    let server = RedisServer::start().expect("a redis-server");
    let cache = cache_on(&server);
    pay(&env.pool, Some(&cache), &cmd("frozen", 10.0))
        .await
        .unwrap();
    let up = pay(&env.pool, Some(&cache), &cmd("frozen", 10.0)).await;

    server.pause();
    let started = Instant::now();
    let frozen = pay(&env.pool, Some(&cache), &cmd("frozen", 10.0)).await;
    let elapsed = started.elapsed();
    server.resume();
    assert_eq!(reply_bytes(&frozen), reply_bytes(&up));
    assert!(elapsed >= cache.config().timeout, "it did wait for Redis");
    assert!(elapsed < BOUND, "{elapsed:?}");
}

/// Redis flushed: the entry is gone, the database replays the same bytes
/// and the cache is warmed again.
#[tokio::test]
async fn a_flushed_redis_gives_the_same_bytes() {
    let env = env().await;
    let server = RedisServer::start().expect("a redis-server");
    let cache = cache_on(&server);
    pay(&env.pool, Some(&cache), &cmd("flushed", 10.0))
        .await
        .unwrap();
    let from_cache = pay(&env.pool, Some(&cache), &cmd("flushed", 10.0)).await;
    assert!(cached_in_redis(server.url(), &cache, "flushed").await);

    assert_eq!(server.command(&["FLUSHALL"]).unwrap(), "+OK");
    assert!(!cached_in_redis(server.url(), &cache, "flushed").await);
    let (counted, proxy) = env.counted_pool(&cache).await;
    let after = pay(&counted, Some(&cache), &cmd("flushed", 10.0)).await;
    assert_eq!(reply_bytes(&after), reply_bytes(&from_cache));
    assert_eq!(proxy.accepted(), 1, "the database answered");
    assert!(cached_in_redis(server.url(), &cache, "flushed").await);
    assert_eq!(env.effects("flushed").await, 1);
}
