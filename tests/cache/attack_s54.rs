//! A hostile pass on the replay cache, written from README.md,
//! docs/idempotent.md (its Redis front cache) and the rustdoc of
//! `ReplayCache` / `CacheConfig` / `operate::settle_forced` only. It goes
//! where tests/cache/{replays,forged,failures,shared}.rs do not: another
//! *operation* under a cached key; an entry moved under another key of the
//! same tenant, truncated, or replaced by a value larger than any entry;
//! an operator's forced settlement and a retention purge under a cached
//! entry; a Redis out of memory (`maxmemory` + `noeviction`) and one frozen
//! between the commit and the cache's write; a cache whose URL is not a
//! Redis at all; the sealing key unreadable (its row deleted under a
//! running process, or a role without the grant); and a storm of
//! concurrent duplicates racing the write.
//! Effects are counted in PostgreSQL (`effects` rows, `idem_requests`),
//! never in the cache's stats.

use idem::idempotency::{purge_expired, Settlement};
use idem::operate::settle_forced;
use idem_testing::redis::RedisServer;

use super::*;

/// Generous bound for one call on a busy two-core machine.
const BOUND: Duration = Duration::from_secs(3);

/// Another operation (the function's path differs) with the same scope,
/// key and fingerprinted fields as `pay`.
#[idempotent(key = cmd.key, scope = cmd.tenant, fingerprint(cmd.amount), cache = cache)]
async fn refund(
    conn: &mut AsyncPgConnection,
    cache: Option<&ReplayCache>,
    cmd: &Cmd,
) -> Result<Receipt, AppError> {
    effect(conn, cmd).await
}

/// `pay` with a retention of 4 s.
#[idempotent(key = cmd.key, scope = cmd.tenant, fingerprint(cmd.amount), ttl_s = 4, cache = cache)]
async fn brief(
    conn: &mut AsyncPgConnection,
    cache: Option<&ReplayCache>,
    cmd: &Cmd,
) -> Result<Receipt, AppError> {
    effect(conn, cmd).await
}

/// Wait (bounded) until `key` has no entry in Redis.
async fn wait_entry_gone(url: &str, cache: &ReplayCache, key: &str, within: Duration) {
    let until = Instant::now() + within;
    while redis_ttl_ms(url, cache, key).await != -2 {
        assert!(
            Instant::now() < until,
            "the entry of {key} outlived {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `pay`'s reply to a duplicate of `key` on a pool of its own, and whether
/// it asked the database (opened a connection).
async fn asked(env: &Env, cache: &ReplayCache, key: &str) -> (Vec<u8>, bool) {
    let (counted, proxy) = env.counted_pool(cache).await;
    let reply = pay(&counted, Some(cache), &cmd(key, 10.0)).await;
    (reply_bytes(&reply), proxy.accepted() > 0)
}

/// Assert that a duplicate of `key` got `bytes`, from the database or not.
async fn check(env: &Env, cache: &ReplayCache, key: &str, bytes: &[u8], from_db: bool) {
    let (got, asked_db) = asked(env, cache, key).await;
    assert_eq!((got.as_slice(), asked_db), (bytes, from_db), "{key}");
}

/// The same scope, key and fingerprint under another operation: the
/// cached entry of `pay` is not `refund`'s, the database refuses (422), and
/// nothing runs (for a cached decline too); under another tenant the same
/// key is a new request.
#[tokio::test]
async fn another_operation_under_a_cached_key_is_refused_by_the_database() {
    let env = env().await;
    let cache = shared_cache();
    // A value, then a stored final error (a decline), each cached.
    for (key, amount) in [("op", 10.0), ("op-declined", -5.0)] {
        let _ = pay(&env.pool, Some(&cache), &cmd(key, amount)).await;
        assert!(cached_in_redis(&shared_url(), &cache, key).await);
        let (counted, proxy) = env.counted_pool(&cache).await;
        // Twice: the refusal must not be cached as refund's answer.
        for _ in 0..2 {
            let other = refund(&counted, Some(&cache), &cmd(key, amount)).await;
            let refused = matches!(other, Err(AppError::Idem(idem::Error::FingerprintMismatch)));
            assert!(refused, "{key}: {other:?}");
        }
        assert!(proxy.accepted() >= 1, "the database decided");
    }
    assert_eq!(env.effects("op").await, 1);
    let (counted, _proxy) = env.counted_pool(&cache).await;

    let mut tenant8 = cmd("op", 10.0);
    tenant8.tenant = 8;
    let fresh = pay(&env.pool, Some(&cache), &tenant8).await.unwrap();
    assert!(!fresh.replayed, "another tenant's key is new");
    assert_eq!(env.effects("op").await, 2);
    // And pay's own replay is still the first receipt.
    let replay = pay(&counted, Some(&cache), &cmd("op", 10.0)).await.unwrap();
    assert!(replay.replayed);
    assert_ne!(replay.id, fresh.id);
}

/// Within one tenant: B's Redis key holding A's (valid, sealed) entry, A's
/// entry truncated, then replaced by 8 MiB of junk. Each is refused, the
/// database answers with its own bytes, and that replay writes a good
/// entry again (the next duplicate opens no connection); the junk does
/// not put Redis to rest for other keys.
#[tokio::test]
async fn entries_moved_truncated_or_oversized_are_refused_and_rewritten() {
    let env = env().await;
    let cache = shared_cache();
    let url = shared_url();
    let mut conn = raw_redis(&url).await;
    pay(&env.pool, Some(&cache), &cmd("mv-a", 10.0))
        .await
        .unwrap();
    pay(&env.pool, Some(&cache), &cmd("mv-b", 10.0))
        .await
        .unwrap();
    let from_db_a = reply_bytes(&pay(&env.pool, None, &cmd("mv-a", 10.0)).await);
    let from_db_b = reply_bytes(&pay(&env.pool, None, &cmd("mv-b", 10.0)).await);
    assert_ne!(from_db_a, from_db_b);
    let (ka, kb) = (
        redis_key_of(&cache, 7, "mv-a"),
        redis_key_of(&cache, 7, "mv-b"),
    );
    let entry_a = redis_get(&mut conn, &ka).await.expect("A's entry");

    // A's entry under B's key: same tenant, same fingerprint, sealed.
    redis_set(&mut conn, &kb, &entry_a).await;
    check(&env, &cache, "mv-b", &from_db_b, true).await;
    check(&env, &cache, "mv-b", &from_db_b, false).await;

    // Truncated, at the lengths a torn write could leave.
    for cut in [entry_a.len() / 2, 1, entry_a.len() - 1] {
        redis_set(&mut conn, &ka, &entry_a[..cut]).await;
        check(&env, &cache, "mv-a", &from_db_a, true).await;
        check(&env, &cache, "mv-a", &from_db_a, false).await;
    }

    // 8 MiB at A's key: more than 4 × max_response_bytes + 64 KiB.
    redis_set(&mut conn, &ka, &vec![b'x'; 8 << 20]).await;
    check(&env, &cache, "mv-a", &from_db_a, true).await;
    // Redis not taken for down: B is still answered from it at once.
    check(&env, &cache, "mv-b", &from_db_b, false).await;
    // And A's entry was written again by the database's replay.
    let len: i64 = redis::cmd("STRLEN")
        .arg(&ka)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(len < 1 << 20, "the junk is still at A's key ({len} B)");
    check(&env, &cache, "mv-a", &from_db_a, false).await;
    assert_eq!(env.effects("mv-a").await, 1);
    assert_eq!(env.effects("mv-b").await, 1);
}

/// An operator replaces a completed record's response
/// (`settle_forced(Completed)`), then releases it: the documented window
/// is the entry's life (at most `max_ttl`). Once the entry is gone, the
/// cache answers what the database holds, and warms itself with that, not
/// the old response; after the release the key runs once more, once.
#[tokio::test]
async fn an_operators_settlement_shows_through_the_cache_within_max_ttl() {
    let env = env().await;
    let url = shared_url();
    let config = CacheConfig::new()
        .prefix(idem_testing::redis::unique_prefix("s54"))
        .timeout(Duration::from_millis(250))
        .max_ttl(Duration::from_secs(1))
        .recheck(Duration::from_secs(60));
    let cache = ReplayCache::with_config(&url, config).unwrap();
    let first = pay(&env.pool, Some(&cache), &cmd("op-settle", 10.0))
        .await
        .unwrap();
    let ttl = redis_ttl_ms(&url, &cache, "op-settle").await;
    assert!(ttl > 0 && ttl <= 1000, "entry TTL {ttl} ms above max_ttl");

    let mut corrected = serde_json::to_value(&first.value).unwrap();
    corrected["id"] = serde_json::json!(424242);
    let forced = settle_forced(
        &env.pool,
        &7_i64,
        "op-settle",
        Settlement::Completed(corrected),
    )
    .await
    .unwrap();
    assert!(
        matches!(forced, idem::operate::Forced::Overwritten),
        "{forced:?}"
    );
    // The window: whatever answers meanwhile runs nothing.
    let meanwhile = pay(&env.pool, Some(&cache), &cmd("op-settle", 10.0))
        .await
        .unwrap();
    assert!(meanwhile.replayed && [first.id, 424242].contains(&meanwhile.id));
    wait_entry_gone(&url, &cache, "op-settle", Duration::from_secs(10)).await;
    let corrected = reply_bytes(&pay(&env.pool, None, &cmd("op-settle", 10.0)).await);
    assert!(String::from_utf8_lossy(&corrected).contains("424242"));
    check(&env, &cache, "op-settle", &corrected, true).await;
    // The replay warmed the cache with the operator's response, not the old.
    let mut conn = raw_redis(&url).await;
    let entry = redis_get(&mut conn, &redis_key_of(&cache, 7, "op-settle")).await;
    let entry = String::from_utf8_lossy(entry.as_deref().expect("warmed")).into_owned();
    assert!(entry.contains("424242"), "{entry}");
    assert_eq!(asked(&env, &cache, "op-settle").await.0, corrected);

    let released = settle_forced(&env.pool, &7_i64, "op-settle", Settlement::Released)
        .await
        .unwrap();
    assert!(matches!(released, idem::operate::Forced::Overwritten));
    wait_entry_gone(&url, &cache, "op-settle", Duration::from_secs(10)).await;
    let rerun = pay(&env.pool, Some(&cache), &cmd("op-settle", 10.0))
        .await
        .unwrap();
    assert!(!rerun.replayed, "released: the key runs again");
    let replay = pay(&env.pool, Some(&cache), &cmd("op-settle", 10.0))
        .await
        .unwrap();
    assert_eq!((replay.replayed, replay.id), (true, rerun.id));
    assert_eq!(env.effects("op-settle").await, 2);
}

/// A record kept 4 s: its entry lives at most half of that, is gone
/// before the record expires (a replay then still comes from the
/// database), and once the record is purged the key is new, cache or not.
#[tokio::test]
async fn a_short_retention_entry_never_outlives_its_record() {
    let env = env().await;
    let cache = shared_cache();
    let url = shared_url();
    let started = Instant::now();
    let first = brief(&env.pool, Some(&cache), &cmd("brief", 10.0))
        .await
        .unwrap();
    let ttl = redis_ttl_ms(&url, &cache, "brief").await;
    assert!(
        ttl > 0 && ttl <= 2000,
        "entry TTL {ttl} ms: more than half of 4 s"
    );

    wait_entry_gone(&url, &cache, "brief", Duration::from_secs(10)).await;
    if started.elapsed() < Duration::from_millis(3500) {
        let replay = brief(&env.pool, Some(&cache), &cmd("brief", 10.0))
            .await
            .unwrap();
        assert_eq!((replay.replayed, replay.id), (true, first.id));
    }

    // Wait for the record to expire, then purge it (an event: the row goes).
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let mut conn = env.pool.get().await.unwrap();
        purge_expired(&mut conn, 100).await.unwrap();
        drop(conn);
        if env.state("brief").await.is_none() {
            break;
        }
        assert!(Instant::now() < until, "the record was never purged");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let fresh = brief(&env.pool, Some(&cache), &cmd("brief", 10.0))
        .await
        .unwrap();
    assert!(!fresh.replayed, "a purged key is new");
    assert_ne!(fresh.id, first.id);
    assert_eq!(env.effects("brief").await, 2);
}

/// Redis out of memory with `noeviction`: every `SET` fails. Fresh
/// requests still commit and answer once, replays come from the database
/// with the same bytes; once memory is back the replays warm the cache.
#[tokio::test]
async fn a_full_redis_fails_no_request() {
    let env = env().await;
    let server = RedisServer::start().expect("a redis-server");
    let cache = cache_on(&server);
    assert!(cache.prepare(&env.pool).await);
    let config_set = |name, value| server.command(&["CONFIG", "SET", name, value]).unwrap();
    config_set("maxmemory-policy", "noeviction");
    config_set("maxmemory", "1");

    let mut firsts = Vec::new();
    for i in 0..5 {
        let key = format!("oom-{i}");
        let started = Instant::now();
        let reply = pay(&env.pool, Some(&cache), &cmd(&key, 10.0)).await;
        assert!(started.elapsed() < BOUND);
        let reply = reply.expect("a full Redis must not fail the request");
        assert!(!reply.replayed);
        assert_eq!(env.state(&key).await.as_deref(), Some("completed"));
        firsts.push(reply.id);
    }
    assert_eq!(
        server.command(&["DBSIZE"]).unwrap(),
        ":0",
        "nothing was written"
    );
    for (i, id) in firsts.iter().enumerate() {
        let key = format!("oom-{i}");
        let replay = pay(&env.pool, Some(&cache), &cmd(&key, 10.0)).await;
        assert_eq!(
            reply_bytes(&replay),
            reply_bytes(&pay(&env.pool, None, &cmd(&key, 10.0)).await)
        );
        assert_eq!(replay.unwrap().id, *id);
        assert_eq!(env.effects(&key).await, 1);
    }

    config_set("maxmemory", "0");
    let until = Instant::now() + Duration::from_secs(30);
    while !cached_in_redis(server.url(), &cache, "oom-0").await {
        assert!(Instant::now() < until, "the cache never warmed again");
        let replay = pay(&env.pool, Some(&cache), &cmd("oom-0", 10.0))
            .await
            .unwrap();
        assert_eq!((replay.replayed, replay.id), (true, firsts[0]));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (counted, proxy) = env.counted_pool(&cache).await;
    let hit = pay(&counted, Some(&cache), &cmd("oom-0", 10.0))
        .await
        .unwrap();
    assert_eq!((hit.id, proxy.accepted()), (firsts[0], 0));
}

/// External mode, Redis frozen after the claim and before the body ends:
/// the commit happens, the cache's `SET` after it gives up within the
/// timeout, the caller gets its receipt (not an error), and a duplicate
/// after Redis thaws gets the same receipt.
#[tokio::test]
async fn redis_frozen_between_the_commit_and_its_write() {
    let env = env().await;
    let server = RedisServer::start().expect("a redis-server");
    let cache = cache_on(&server);
    assert!(cache.prepare(&env.pool).await);
    let gate = Arc::new(Semaphore::new(0));
    let first = charge_in_background(&env.pool, &cache, cmd("thaw", 10.0), &gate);
    wait_for_state(&env, "thaw", "in_progress").await;

    server.pause();
    let started = Instant::now();
    gate.add_permits(1);
    let first = tokio::time::timeout(Duration::from_secs(30), first)
        .await
        .expect("the request hung on a frozen Redis")
        .unwrap();
    let elapsed = started.elapsed();
    server.resume();
    let first = first.expect("a frozen Redis after the commit failed the request");
    assert!(!first.replayed);
    assert!(elapsed < BOUND, "{elapsed:?}");
    assert_eq!(env.state("thaw").await.as_deref(), Some("completed"));
    assert_eq!(env.effects("thaw").await, 1);

    let no_gate = Semaphore::new(1);
    let dup = charge(&env.pool, Some(&cache), &cmd("thaw", 10.0), &no_gate)
        .await
        .unwrap();
    assert_eq!((dup.replayed, dup.id), (true, first.id));
    assert_eq!(env.effects("thaw").await, 1);
}

/// A URL the client refuses is an error at construction; a port nothing
/// listens on, and one where something that is not Redis answers, only
/// cost the timeout: requests run once and replay with the database's
/// bytes.
#[tokio::test]
async fn a_cache_pointed_at_no_redis_changes_nothing() {
    let env = env().await;
    assert!(ReplayCache::with_config("http://127.0.0.1:6379", CacheConfig::new()).is_err());
    assert!(ReplayCache::new("not a url").is_err());

    // Something that speaks HTTP, not RESP, and hangs up.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = format!("redis://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        use tokio::io::AsyncWriteExt;
        while let Ok((mut socket, _)) = listener.accept().await {
            let _ = socket.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").await;
        }
    });
    // A port that refuses: bind one, note it, let it go.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("redis://{}", l.local_addr().unwrap())
    };
    for (i, url) in [http, closed].iter().enumerate() {
        let config = CacheConfig::new()
            .timeout(Duration::from_millis(100))
            .backoff(Duration::from_millis(50));
        let cache = ReplayCache::with_config(url, config).expect("a well-formed URL");
        let key = format!("nowhere-{i}");
        let mut replies = Vec::new();
        for _ in 0..4 {
            let started = Instant::now();
            let reply = pay(&env.pool, Some(&cache), &cmd(&key, 10.0)).await;
            assert!(started.elapsed() < BOUND, "{url}: {:?}", started.elapsed());
            replies.push(reply);
        }
        assert!(!replies[0].as_ref().unwrap().replayed, "{url}");
        for reply in &replies[1..] {
            assert_eq!(reply_bytes(reply), reply_bytes(&replies[1]), "{url}");
            assert!(reply.as_ref().unwrap().replayed);
        }
        assert_eq!(env.effects(&key).await, 1, "{url}");
        assert_eq!(env.state(&key).await.as_deref(), Some("completed"));
    }
}

/// Concurrent duplicates of a fresh key, each with the cache: one runs,
/// all others replay its receipt; the writes racing each other leave one
/// good entry, answered without the database with the database's bytes.
#[tokio::test]
async fn a_storm_of_concurrent_duplicates_runs_once_and_leaves_a_good_entry() {
    let env = env().await;
    let cache = shared_cache();
    let calls: Vec<_> = (0..16)
        .map(|_| {
            let (pool, cache) = (env.pool.clone(), cache.clone());
            tokio::spawn(async move { pay(&pool, Some(&cache), &cmd("storm", 10.0)).await })
        })
        .collect();
    let mut replies = Vec::new();
    for call in calls {
        replies.push(call.await.unwrap());
    }
    assert_eq!(env.effects("storm").await, 1);
    let answers: Vec<_> = replies
        .iter()
        .map(|r| r.as_ref().expect("every duplicate answered"))
        .collect();
    assert_eq!(answers.iter().filter(|r| !r.replayed).count(), 1);
    assert!(answers.iter().all(|r| r.id == answers[0].id));

    let from_db = reply_bytes(&pay(&env.pool, None, &cmd("storm", 10.0)).await);
    for reply in replies.iter().filter(|r| r.as_ref().unwrap().replayed) {
        assert_eq!(reply_bytes(reply), from_db);
    }
    assert!(cached_in_redis(&shared_url(), &cache, "storm").await);
    let (counted, proxy) = env.counted_pool(&cache).await;
    let hit = pay(&counted, Some(&cache), &cmd("storm", 10.0)).await;
    assert_eq!(reply_bytes(&hit), from_db);
    assert_eq!(proxy.accepted(), 0);
}

/// The secret's row deleted under a running process: the key can no longer
/// be read, so "the cache is not used". The record's response is replaced
/// by the operator at the same time, so who answers shows: within a few
/// `recheck`s every duplicate gets the database's response, a new pool
/// cannot `prepare`, and new keys still run once.
#[tokio::test]
async fn a_deleted_secret_turns_the_cache_off_not_the_service() {
    let env = env().await;
    let config = CacheConfig::new()
        .prefix(idem_testing::redis::unique_prefix("s54"))
        .timeout(Duration::from_millis(250))
        .recheck(Duration::from_millis(300));
    let cache = ReplayCache::with_config(&shared_url(), config).unwrap();
    let first = pay(&env.pool, Some(&cache), &cmd("nosecret", 10.0))
        .await
        .unwrap();
    let hit = pay(&env.pool, Some(&cache), &cmd("nosecret", 10.0))
        .await
        .unwrap();
    assert_eq!(hit.id, first.id);

    env.client
        .batch_execute("DELETE FROM idem_cache_secret")
        .await
        .unwrap();
    let mut corrected = serde_json::to_value(&first.value).unwrap();
    corrected["id"] = serde_json::json!(777);
    settle_forced(
        &env.pool,
        &7_i64,
        "nosecret",
        Settlement::Completed(corrected),
    )
    .await
    .unwrap();
    assert!(cached_in_redis(&shared_url(), &cache, "nosecret").await);
    let until = Instant::now() + Duration::from_secs(15);
    loop {
        let now = pay(&env.pool, Some(&cache), &cmd("nosecret", 10.0))
            .await
            .unwrap();
        if now.id == 777 {
            break;
        }
        assert_eq!(now.id, first.id);
        assert!(
            Instant::now() < until,
            "an unreadable key kept the entry served"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for _ in 0..3 {
        let now = pay(&env.pool, Some(&cache), &cmd("nosecret", 10.0))
            .await
            .unwrap();
        assert_eq!(now.id, 777, "the old entry came back");
    }
    assert!(!cache.prepare(&pool_on(env.db.url())).await);
    let fresh = pay(&env.pool, Some(&cache), &cmd("nosecret-2", 10.0))
        .await
        .unwrap();
    assert!(!fresh.replayed);
    let again = pay(&env.pool, Some(&cache), &cmd("nosecret-2", 10.0))
        .await
        .unwrap();
    assert_eq!((again.replayed, again.id), (true, fresh.id));
    assert!(!cached_in_redis(&shared_url(), &cache, "nosecret-2").await);
    assert_eq!(env.effects("nosecret").await, 1);
    assert_eq!(env.effects("nosecret-2").await, 1);
}

/// An application role that may not read `idem_cache_secret` (a grant
/// forgotten): `prepare` says so, requests run once and replay from the
/// database, and nothing is written to Redis.
#[tokio::test]
async fn a_role_without_the_secret_runs_without_the_cache() {
    let env = env().await;
    let role = format!("s54_{}", std::process::id());
    let admin = admin().await;
    let _ = admin
        .batch_execute(&format!("CREATE ROLE {role} LOGIN"))
        .await;
    env.client
        .batch_execute(&format!(
            "GRANT USAGE ON SCHEMA public TO {role};
             GRANT ALL ON ALL TABLES IN SCHEMA public TO {role};
             GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {role};
             REVOKE ALL ON idem_cache_secret FROM {role};"
        ))
        .await
        .unwrap();
    let url = env
        .db
        .url()
        .replacen("://postgres@", &format!("://{role}@"), 1);
    assert_ne!(url, env.db.url(), "the URL names its user");
    let pool = pool_on(&url);
    let cache = shared_cache();
    assert!(!cache.prepare(&pool).await, "the secret was readable");
    let first = pay(&pool, Some(&cache), &cmd("norole", 10.0))
        .await
        .unwrap();
    let again = pay(&pool, Some(&cache), &cmd("norole", 10.0))
        .await
        .unwrap();
    assert_eq!(
        (first.replayed, again.replayed, again.id),
        (false, true, first.id)
    );
    assert_eq!(env.effects("norole").await, 1);
    assert!(!cached_in_redis(&shared_url(), &cache, "norole").await);
    drop(pool);
    env.client
        .batch_execute(&format!("DROP OWNED BY {role}"))
        .await
        .unwrap();
    let _ = admin
        .batch_execute(&format!("DROP ROLE IF EXISTS {role}"))
        .await;
}
