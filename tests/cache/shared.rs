//! What the cache shares, and what it must not: one cache in front of two
//! databases, one forged key among many, and the cache behind PgBouncer.
//! An answer from Redis is told from the database's by marking the stored
//! response in the database (`id` 555) after the entry was made.

use idem::pool::Pooler;

use super::*;

impl Env {
    /// Change the record's stored response, so a replay from the database
    /// says `id` 555 where the cache's copy says the original id.
    async fn mark_stored_response(&self, key: &str) {
        // Client's own `execute`: diesel's, in scope here, takes `self`.
        let changed = tokio_postgres::Client::execute(
            &self.client,
            "UPDATE idem_requests SET response = jsonb_set(response, '{id}', '555') WHERE key = $1",
            &[&key],
        )
        .await
        .expect("mark");
        assert_eq!(changed, 1);
    }
}

/// One cache built at start-up in front of two databases (a database per
/// tenant): a request on the second is never answered with the first's
/// entry; each database's requests hit their own entries.
#[tokio::test]
async fn one_cache_in_front_of_two_databases_answers_each_from_its_own() {
    let first = env().await;
    let second = env().await;
    let cache = shared_cache();
    let a = pay(&first.pool, Some(&cache), &cmd("shared", 10.0))
        .await
        .unwrap();
    let b = pay(&second.pool, Some(&cache), &cmd("shared", 10.0))
        .await
        .unwrap();
    assert!(!b.replayed, "the second database never saw the request");
    assert_eq!(second.effects("shared").await, 1, "it ran there");
    assert_eq!(first.effects("shared").await, 1);
    // Each replays its own: the entry in Redis is now the second's, so the
    // first's duplicate is refused there and its database answers.
    let a_again = pay(&first.pool, Some(&cache), &cmd("shared", 10.0))
        .await
        .unwrap();
    assert!(a_again.replayed);
    assert_eq!(a_again.id, a.id);
}

/// A value of another type planted at one key (a hash where the entry
/// was) sends that key's duplicates to the database, and no other key's:
/// Redis is not taken for down, and the next replay of the key writes its
/// entry again.
#[tokio::test]
async fn a_forged_key_of_another_type_costs_only_that_key() {
    let env = env().await;
    let cache = shared_cache();
    for key in ["hot", "other"] {
        pay(&env.pool, Some(&cache), &cmd(key, 10.0)).await.unwrap();
        env.mark_stored_response(key).await;
    }
    let mut redis = raw_redis(&shared_url()).await;
    let hot = redis_key_of(&cache, 7, "hot");
    let () = redis::cmd("DEL")
        .arg(&hot)
        .query_async(&mut redis)
        .await
        .unwrap();
    let () = redis::cmd("HSET")
        .arg(&hot)
        .arg("f")
        .arg("v")
        .query_async(&mut redis)
        .await
        .unwrap();

    let from_db = pay(&env.pool, Some(&cache), &cmd("hot", 10.0))
        .await
        .unwrap();
    assert_eq!(from_db.id, 555, "the planted key's duplicate: the database");
    let mut others_from_db = 0;
    for _ in 0..20 {
        let other = pay(&env.pool, Some(&cache), &cmd("other", 10.0))
            .await
            .unwrap();
        others_from_db += usize::from(other.id == 555);
    }
    assert_eq!(
        others_from_db, 0,
        "every other key still answered from Redis"
    );
    let kind: String = redis::cmd("TYPE")
        .arg(&hot)
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(
        kind, "string",
        "the database's replay wrote the entry again"
    );
}

/// Behind PgBouncer in transaction pooling, the cache's sealing key is read
/// (inside a transaction, as every statement idem runs there), and
/// duplicates are answered from Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_pgbouncer_duplicates_are_answered_from_redis() {
    let env = env().await;
    let bouncer = tokio::task::spawn_blocking(|| {
        idem_testing::pgbouncer::PgBouncer::start(&idem_testing::server_url()?)
    })
    .await
    .unwrap()
    .expect("a PgBouncer");
    let url = bouncer.url_for(env.db.url()).expect("its URL");
    let through = |size| {
        build_pool_with(
            &url,
            &PoolConfig {
                max_size: size,
                pooler: Pooler::TransactionPooling,
                ..PoolConfig::default()
            },
        )
        .expect("a pool through PgBouncer")
    };
    let pool = through(4);
    // Other clients keep PgBouncer's server connections moving between
    // clients, as in production.
    let noise_pool = through(4);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let noise = tokio::spawn({
        let (pool, stop) = (noise_pool.clone(), Arc::clone(&stop));
        async move {
            let mut i = 0;
            while !std::sync::atomic::AtomicBool::load(&stop, std::sync::atomic::Ordering::Relaxed)
            {
                let _ = pay(&pool, None, &cmd(&format!("noise-{i}"), 1.0)).await;
                i += 1;
            }
        }
    });
    let cache = shared_cache();
    let first = pay(&pool, Some(&cache), &cmd("bounced", 10.0))
        .await
        .unwrap();
    env.mark_stored_response("bounced").await;
    let mut from_redis = 0;
    for _ in 0..20 {
        let again = pay(&pool, Some(&cache), &cmd("bounced", 10.0))
            .await
            .unwrap();
        assert!(again.replayed);
        from_redis += usize::from(again.id == first.id);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    noise.await.unwrap();
    assert_eq!(from_redis, 20, "every duplicate answered from Redis");
    assert_eq!(cache.stats().skipped, 0, "the key was never out of reach");
}
