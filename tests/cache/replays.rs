//! Hits, misses, mismatches, final errors, and the records never cached.

use super::*;

/// A duplicate whose entry is in Redis is answered without a connection to
/// the database (the proxy in front of its pool accepts none), with the
/// bytes a database replay gives: the stored `jsonb` form (`0.0` where the
/// body said `-0.0`), not the body's own value.
#[tokio::test]
async fn a_hit_answers_without_the_database_with_the_database_replays_bytes() {
    let env = env().await;
    let cache = shared_cache();
    let first = pay(&env.pool, Some(&cache), &cmd("hit", 10.0)).await;
    let fresh = first.as_ref().expect("the first call");
    assert!(!fresh.replayed);
    assert!(fresh.signed_zero.is_sign_negative(), "the body's own value");
    assert!(cached_in_redis(&shared_url(), &cache, "hit").await);

    let from_db = pay(&env.pool, None, &cmd("hit", 10.0)).await;
    let (counted, proxy) = env.counted_pool(&cache).await;
    for _ in 0..20 {
        let from_cache = pay(&counted, Some(&cache), &cmd("hit", 10.0)).await;
        assert_eq!(reply_bytes(&from_cache), reply_bytes(&from_db));
    }
    assert_eq!(proxy.accepted(), 0, "no connection, so no query");
    let replay = from_db.unwrap();
    assert!(replay.replayed);
    assert!(replay.signed_zero.is_sign_positive(), "as jsonb stored it");
    assert_eq!(env.effects("hit").await, 1);
}

/// A record the cache never saw (made without it) is read from the
/// database, and that replay warms the cache for the next duplicate; the
/// entry lives no longer than `max_ttl`.
#[tokio::test]
async fn a_miss_goes_to_the_database_and_warms_the_cache() {
    let env = env().await;
    let cache = shared_cache();
    let url = shared_url();
    pay(&env.pool, None, &cmd("miss", 10.0)).await.unwrap();
    assert!(!cached_in_redis(&url, &cache, "miss").await);

    let (counted, proxy) = env.counted_pool(&cache).await;
    let first = pay(&counted, Some(&cache), &cmd("miss", 10.0)).await;
    assert!(first.as_ref().unwrap().replayed);
    assert_eq!(proxy.accepted(), 1, "the miss was answered by the database");
    let ttl = redis_ttl_ms(&url, &cache, "miss").await;
    assert!(
        ttl > 0 && ttl <= cache.config().max_ttl.as_millis() as i64,
        "{ttl}"
    );

    let (counted, proxy) = env.counted_pool(&cache).await;
    let second = pay(&counted, Some(&cache), &cmd("miss", 10.0)).await;
    assert_eq!(reply_bytes(&second), reply_bytes(&first));
    assert_eq!(proxy.accepted(), 0, "warmed: answered from Redis");
}

/// The same key with another request: the cache's entry is not this
/// request's, so the database answers, and it refuses (422).
#[tokio::test]
async fn a_fingerprint_mismatch_is_still_refused_by_the_database() {
    let env = env().await;
    let cache = shared_cache();
    pay(&env.pool, Some(&cache), &cmd("mismatch", 10.0))
        .await
        .unwrap();
    assert!(cached_in_redis(&shared_url(), &cache, "mismatch").await);

    let (counted, proxy) = env.counted_pool(&cache).await;
    let other = pay(&counted, Some(&cache), &cmd("mismatch", 11.0)).await;
    assert!(
        matches!(other, Err(AppError::Idem(idem::Error::FingerprintMismatch))),
        "{other:?}"
    );
    assert_eq!(proxy.accepted(), 1, "the database decided");
    assert_eq!(env.effects("mismatch").await, 1);
}

/// A declined request's stored error is replayed from the cache as the
/// database replays it (`balance: 0.0` as stored, not the body's `-0.0`).
#[tokio::test]
async fn final_errors_are_replayed_from_the_cache_as_the_database_replays_them() {
    let env = env().await;
    let cache = shared_cache();
    let first = pay(&env.pool, Some(&cache), &cmd("declined", -5.0)).await;
    let Err(AppError::Declined(Declined::Refused { balance, .. })) = &first else {
        panic!("{first:?}");
    };
    assert!(balance.is_sign_negative(), "the body's own error");
    assert!(cached_in_redis(&shared_url(), &cache, "declined").await);

    let from_db = pay(&env.pool, None, &cmd("declined", -5.0)).await;
    let (counted, proxy) = env.counted_pool(&cache).await;
    let from_cache = pay(&counted, Some(&cache), &cmd("declined", -5.0)).await;
    assert_eq!(proxy.accepted(), 0);
    assert_eq!(reply_bytes(&from_cache), reply_bytes(&from_db));
    assert_eq!(reply_bytes(&from_cache), reply_bytes(&first).replace_zero());
}

trait ReplaceZero {
    fn replace_zero(self) -> Vec<u8>;
}

impl ReplaceZero for Vec<u8> {
    /// The bytes as jsonb would give them back: `-0.0` is `0.0`.
    fn replace_zero(self) -> Vec<u8> {
        String::from_utf8(self)
            .unwrap()
            .replace("-0.0", "0.0")
            .into_bytes()
    }
}

/// External mode: an in-progress claim and an outcome-unknown record are
/// never copied to Redis (their duplicates get 409 and "outcome unknown"
/// from the database); a completed one is, and is then replayed from it.
#[tokio::test]
async fn in_progress_and_unknown_records_are_never_cached() {
    let env = env().await;
    let cache = shared_cache();
    let url = shared_url();

    // In progress, then outcome unknown.
    let gate = Arc::new(Semaphore::new(0));
    let first = charge_in_background(&env.pool, &cache, cmd("unknown", 13.0), &gate);
    wait_for_state(&env, "unknown", "in_progress").await;
    let open = Semaphore::new(1);
    let during = charge(&env.pool, Some(&cache), &cmd("unknown", 13.0), &open).await;
    assert!(
        matches!(during, Err(AppError::Idem(idem::Error::InProgress))),
        "{during:?}"
    );
    assert!(!cached_in_redis(&url, &cache, "unknown").await);
    gate.add_permits(1);
    let outcome = first.await.unwrap();
    assert!(matches!(outcome, Err(AppError::Timeout)), "{outcome:?}");
    assert_eq!(env.state("unknown").await.as_deref(), Some("unknown"));
    let after = charge(&env.pool, Some(&cache), &cmd("unknown", 13.0), &open).await;
    assert!(
        matches!(after, Err(AppError::Idem(idem::Error::OutcomeUnknown))),
        "{after:?}"
    );
    assert!(!cached_in_redis(&url, &cache, "unknown").await);

    // Completed in external mode: copied (from its recording UPDATE), and
    // replayed from Redis.
    let done = charge(&env.pool, Some(&cache), &cmd("external", 10.0), &open).await;
    assert!(!done.as_ref().unwrap().replayed);
    assert!(cached_in_redis(&url, &cache, "external").await);
    let from_db = charge(&env.pool, None, &cmd("external", 10.0), &open).await;
    let (counted, proxy) = env.counted_pool(&cache).await;
    let from_cache = charge(&counted, Some(&cache), &cmd("external", 10.0), &open).await;
    assert_eq!(proxy.accepted(), 0);
    assert_eq!(reply_bytes(&from_cache), reply_bytes(&from_db));
    assert_eq!(env.effects("external").await, 1);
}
