//! The cache answers only what the database would answer for that scope
//! and key. Entries are written into Redis by hand here, as anyone who can
//! write to it could: altered, copied under another tenant's key, kept past
//! their time, or made by a database that has since been restored, or
//! before its secret was rotated. Each is refused, and what the database
//! holds (effects, records) and the connections it was asked on show who
//! answered.

use super::*;

/// The receipt's `id`: the effect row the request made.
fn receipt_id(reply: &Result<idem::Idempotent<Receipt>, AppError>) -> i64 {
    reply.as_ref().expect("a receipt").id
}

/// A's entry with its response replaced (`id` 999999) is refused: A's
/// duplicate gets the database's replay, `id` 1, as `idem_requests` holds.
#[tokio::test]
async fn an_altered_entry_is_refused_and_the_database_replays() {
    let env = env().await;
    let cache = shared_cache();
    let first = pay(&env.pool, Some(&cache), &cmd("altered", 10.0)).await;
    let id = receipt_id(&first);
    let mut redis = raw_redis(&shared_url()).await;
    let at = redis_key_of(&cache, 7, "altered");
    let entry = redis_get(&mut redis, &at).await.expect("an entry");
    let needle = format!("\"id\":{id},").into_bytes();
    let pos = entry
        .windows(needle.len())
        .position(|w| w == needle)
        .expect("the stored response in the entry");
    let mut forged = entry[..pos].to_vec();
    forged.extend_from_slice(b"\"id\":999999,");
    forged.extend_from_slice(&entry[pos + needle.len()..]);
    redis_set(&mut redis, &at, &forged).await;

    let (counted, proxy) = env.counted_pool(&cache).await;
    let duplicate = pay(&counted, Some(&cache), &cmd("altered", 10.0)).await;
    assert!(duplicate.as_ref().unwrap().replayed);
    assert_eq!(
        receipt_id(&duplicate),
        id,
        "the database's record, not Redis's"
    );
    assert_eq!(proxy.accepted(), 1, "the database answered");
    let stored: i64 = env
        .client
        .query_one(
            "SELECT (response->>'id')::int8 FROM idem_requests WHERE key = 'altered'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(stored, id);
    assert_eq!(env.effects("altered").await, 1);
}

/// A's entry copied under tenant C's key, for a key C never sent, is
/// refused: C's request runs its own body and keeps its own record, and C
/// never sees A's response.
#[tokio::test]
async fn an_entry_copied_to_another_tenant_is_refused_and_that_tenants_request_runs() {
    let env = env().await;
    let cache = shared_cache();
    let a = pay(&env.pool, Some(&cache), &cmd("tenant-a", 10.0)).await;
    let mut redis = raw_redis(&shared_url()).await;
    let entry = redis_get(&mut redis, &redis_key_of(&cache, 7, "tenant-a"))
        .await
        .expect("an entry");
    redis_set(&mut redis, &redis_key_of(&cache, 9, "tenant-c"), &entry).await;
    // And under A's own tenant for another key: the key is sealed too.
    redis_set(&mut redis, &redis_key_of(&cache, 7, "other-key"), &entry).await;

    for (tenant, key) in [(9, "tenant-c"), (7, "other-key")] {
        let request = Cmd {
            tenant,
            key: key.to_owned(),
            amount: 10.0,
        };
        let reply = pay(&env.pool, Some(&cache), &request).await;
        let reply = reply.expect("the request's own answer");
        assert!(!reply.replayed, "{key}: ran as a new request");
        assert_ne!(reply.id, receipt_id(&a), "{key}: not A's response");
        assert_eq!(env.effects(key).await, 1, "{key}: its effect exists");
        assert_eq!(
            env.state(key).await.as_deref(),
            Some("completed"),
            "{key}: its record exists"
        );
    }
}

/// An entry whose TTL was removed in Redis is not served past the time
/// sealed in it.
#[tokio::test]
async fn an_entry_kept_past_its_time_is_refused() {
    let env = env().await;
    let url = shared_url();
    let cache = ReplayCache::with_config(
        &url,
        CacheConfig::new()
            .prefix(idem_testing::redis::unique_prefix("cache"))
            .timeout(Duration::from_millis(250))
            .recheck(Duration::from_secs(60))
            .max_ttl(Duration::from_millis(300)),
    )
    .expect("a cache");
    pay(&env.pool, Some(&cache), &cmd("persisted", 10.0))
        .await
        .unwrap();
    let mut redis = raw_redis(&url).await;
    let kept: i64 = redis::cmd("PERSIST")
        .arg(redis_key_of(&cache, 7, "persisted"))
        .query_async(&mut redis)
        .await
        .expect("PERSIST");
    assert_eq!(kept, 1, "the entry was there, and now has no TTL");
    tokio::time::sleep(Duration::from_millis(500)).await;

    let (counted, proxy) = env.counted_pool(&cache).await;
    let late = pay(&counted, Some(&cache), &cmd("persisted", 10.0)).await;
    assert!(late.unwrap().replayed);
    assert_eq!(proxy.accepted(), 1, "the database answered");
}

/// A database restored to a point before a request (here: a copy made
/// from it before the request, which holds the same secret) while Redis
/// kept the request's entry: the entry is refused, and the request, which
/// the restored database has never seen, runs there. A new process refuses
/// it at once; a running one once its key is older than `recheck`.
#[tokio::test]
async fn entries_made_before_a_restore_are_refused() {
    let db = migrated_database().await;
    // The backup, taken before the request.
    let admin = admin().await;
    let restored = format!("{}_restored", db.name());
    admin
        .batch_execute(&format!(
            "CREATE DATABASE \"{restored}\" TEMPLATE \"{}\"",
            db.name()
        ))
        .await
        .expect("copy the database");
    let restored_url = db.url().replacen(db.name(), &restored, 1);
    let effects_in = |url: String| async move {
        let client = idem_testing::connect(&url).await.expect("connect");
        client
            .query_one("SELECT count(*) FROM effects", &[])
            .await
            .unwrap()
            .get::<_, i64>(0)
    };

    let url = shared_url();
    let prefix = idem_testing::redis::unique_prefix("cache");
    let config = CacheConfig::new()
        .prefix(prefix)
        .timeout(Duration::from_millis(250))
        .recheck(Duration::from_millis(300));
    let cache = ReplayCache::with_config(&url, config.clone()).expect("a cache");
    let before = pay(&pool_on(db.url()), Some(&cache), &cmd("restored", 10.0)).await;
    assert!(!before.unwrap().replayed);

    // A process started on the restored database, with Redis as it was.
    let fresh = ReplayCache::with_config(&url, config).expect("a cache");
    let on_restored = pool_on(&restored_url);
    let reply = pay(&on_restored, Some(&fresh), &cmd("restored", 10.0)).await;
    assert!(!reply.unwrap().replayed, "the restored database ran it");
    assert_eq!(effects_in(restored_url.clone()).await, 1);

    // The running process, past `recheck`: its key is read again from the
    // database it now talks to, and the old entry is refused.
    let again = cmd("restored-2", 10.0);
    pay(&pool_on(db.url()), Some(&cache), &again).await.unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    let reply = pay(&on_restored, Some(&cache), &again).await;
    assert!(!reply.unwrap().replayed, "the restored database ran it");
    assert_eq!(effects_in(restored_url).await, 2);
    drop(on_restored);
    admin
        .batch_execute(&format!("DROP DATABASE \"{restored}\" WITH (FORCE)"))
        .await
        .expect("drop the copy");
}

/// Rotating the database's secret invalidates every entry: the next
/// duplicate is answered by the database.
#[tokio::test]
async fn rotating_the_secret_invalidates_every_entry() {
    let env = env().await;
    let url = shared_url();
    let config = CacheConfig::new()
        .prefix(idem_testing::redis::unique_prefix("cache"))
        .timeout(Duration::from_millis(250))
        .recheck(Duration::from_millis(300));
    let cache = ReplayCache::with_config(&url, config).expect("a cache");
    pay(&env.pool, Some(&cache), &cmd("rotated", 10.0))
        .await
        .unwrap();
    let mut redis = raw_redis(&url).await;
    let at = redis_key_of(&cache, 7, "rotated");
    let sealed_before = redis_get(&mut redis, &at).await.expect("an entry");
    env.client
        .batch_execute(
            "UPDATE idem_cache_secret SET secret = \
             decode(replace(gen_random_uuid()::text || gen_random_uuid()::text, '-', ''), 'hex')",
        )
        .await
        .expect("rotate");
    tokio::time::sleep(Duration::from_millis(400)).await;
    let (counted, proxy) = env.counted_pool(&cache).await;
    let reply = pay(&counted, Some(&cache), &cmd("rotated", 10.0)).await;
    assert!(reply.unwrap().replayed);
    // One connection: the key read again, then the database's replay on it,
    // which sealed the entry again under the new secret.
    assert_eq!(proxy.accepted(), 1);
    assert_ne!(
        redis_get(&mut redis, &at).await.expect("an entry"),
        sealed_before,
        "the database answered and the entry was sealed again"
    );
    let after = pay(&counted, Some(&cache), &cmd("rotated", 10.0)).await;
    assert!(after.unwrap().replayed);
    assert_eq!(proxy.accepted(), 1, "refilled under the new secret: a hit");
    assert_eq!(env.effects("rotated").await, 1);
}
