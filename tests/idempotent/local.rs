//! Local mode: one effect for 200 same-key requests, one commit per request, refusals, key spaces.

use super::*;

// ---------------------------------------------------------------------------
// Concurrency: one effect for 200 same-key requests
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 8)]
async fn two_hundred_concurrent_requests_have_one_effect() {
    let env = env(20).await;
    let barrier = Arc::new(Barrier::new(200));
    let tasks: Vec<_> = (0..200)
        .map(|i| {
            let pool = env.pool.clone();
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                pay(&pool, &CTX, &cmd("idem-order-1001", 3000), 1000 + i).await
            })
        })
        .collect();
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.unwrap().expect("every request is answered"));
    }
    let firsts: Vec<_> = answers.iter().filter(|a| !a.replayed).collect();
    assert_eq!(firsts.len(), 1, "exactly one request ran the body");
    assert_eq!(answers.iter().filter(|a| a.replayed).count(), 199);
    let winner = &firsts[0].value;
    assert!(
        answers.iter().all(|a| &a.value == winner),
        "every replay carries the winner's response"
    );
    assert_eq!(env.payments().await, 1, "one business row");
    assert_eq!(
        env.scalar("SELECT id FROM payments").await,
        winner.id,
        "the row is the winner's"
    );
    assert_eq!(env.records().await, 1);
    let (state, outcome, _) = env.record("idem-order-1001").await.unwrap();
    assert_eq!(
        (state.as_str(), outcome.as_deref()),
        ("completed", Some("ok"))
    );
}

// ---------------------------------------------------------------------------
// Local mode: one commit per new request
// ---------------------------------------------------------------------------

/// `xact_commit` of database `name`, read from another database so that the
/// reading adds nothing to it; waits until it stops moving (backends flush
/// their counters asynchronously, at the latest when they exit).
async fn settled_commits(admin: &tokio_postgres::Client, name: &str) -> i64 {
    // Backends of the database still connected have unflushed counters.
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let connected: i64 = admin
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = $1",
                &[&name],
            )
            .await
            .unwrap()
            .get(0);
        if connected == 0 {
            break;
        }
        assert!(Instant::now() < until, "backends of {name} did not exit");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let read = || async {
        admin
            .batch_execute("SELECT pg_stat_clear_snapshot()")
            .await
            .unwrap();
        admin
            .query_one(
                "SELECT xact_commit FROM pg_stat_database WHERE datname = $1",
                &[&name],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
    };
    let mut last = read().await;
    let mut stable = 0;
    while stable < 5 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = read().await;
        if now == last {
            stable += 1;
        } else {
            (last, stable) = (now, 0);
        }
    }
    last
}

/// Commits in the test database made by `calls` new-key payments on a
/// dedicated one-connection pool, including the pool's connection set-up.
async fn commits_of(env: &Env, admin: &tokio_postgres::Client, first: i64, calls: i64) -> i64 {
    let name = env.db.name();
    let before = settled_commits(admin, name).await;
    {
        let pool = pool_of(&env.db, 1);
        // The set-up of the connection, counted in every run alike.
        drop(pool.get().await.unwrap());
        for i in first..first + calls {
            let answer = pay(&pool, &CTX, &cmd(&format!("commit-{i}"), 10), i)
                .await
                .unwrap();
            assert!(!answer.replayed);
        }
    }
    // Behind PgBouncer, its server connections outlive the pool.
    env.db.release_server_connections().await.unwrap();
    settled_commits(admin, name).await - before
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn local_mode_commits_once_per_new_request() {
    let env = env(1).await;
    // Nothing of this test may touch the database while it counts.
    drop(env.client);
    drop(env.pool);
    let env = Env {
        client: side_connection(&idem_testing::server_url().unwrap()).await,
        pool: pool_of(&env.db, 1),
        db: env.db,
    };
    let admin = &env.client;
    const N: i64 = 25;
    // Autovacuum may visit the database and add commits to a window; it never
    // takes any away, so a clean pair of windows shows the exact count.
    let mut seen = Vec::new();
    for round in 0..3 {
        let overhead = commits_of(&env, admin, 0, 0).await;
        let with_calls = commits_of(&env, admin, 100 * (round + 1), N).await;
        seen.push((overhead, with_calls));
        if with_calls - overhead == N {
            return;
        }
    }
    panic!(
        "expected {N} commits for {N} new requests (connection set-up, then with calls): {seen:?}"
    );
}

// ---------------------------------------------------------------------------
// The same key for a different request, and key spaces
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_different_request_under_the_same_key_is_refused_and_scopes_are_separate() {
    let env = env(4).await;
    let first = pay(&env.pool, &CTX, &cmd("k-1", 3000), 1).await.unwrap();
    assert!(!first.replayed);
    let stored_before = env.record("k-1").await;

    // Same key, same request: the stored response, the body not run again.
    let again = pay(&env.pool, &CTX, &cmd("k-1", 3000), 2).await.unwrap();
    assert!(again.replayed);
    assert_eq!(again.value, first.value);
    assert_eq!(
        again.value.id, 1,
        "the first request's payment, not the proposed one"
    );

    // Same key, another amount, another currency, another merchant: refused.
    let mut other_merchant = cmd("k-1", 3000);
    other_merchant.merchant = "elsewhere".into();
    let mut other_currency = cmd("k-1", 3000);
    other_currency.currency = "EUR".into();
    for different in [cmd("k-1", 9999), other_merchant, other_currency] {
        let result = pay(&env.pool, &CTX, &different, 3).await;
        match &result {
            Err(AppError::Idem(e @ idem::Error::FingerprintMismatch)) => {
                assert_eq!(e.http_status(), 422)
            }
            other => panic!("expected a fingerprint mismatch, got {other:?}"),
        }
    }
    // Another operation under the same key and scope, with the same fields.
    let result = refund(&env.pool, &CTX, &cmd("k-1", 3000), 4).await;
    assert!(
        matches!(
            result,
            Err(AppError::Idem(idem::Error::FingerprintMismatch))
        ),
        "{result:?}"
    );
    // Nothing was written, and the record is untouched: not even locked by
    // the replays and refusals (a lock would leave their xid in xmax).
    assert_eq!(env.payments().await, 1);
    assert_eq!(env.records().await, 1);
    assert_eq!(env.record("k-1").await, stored_before);
    assert_eq!(
        env.scalar("SELECT xmax::text::bigint FROM idem_requests WHERE key = 'k-1'")
            .await,
        0
    );

    // Another tenant, then another user of the same tenant: their own key
    // spaces, where the same key is new, even for a different request.
    let tenant2 = Ctx { tenant: 2, user: 7 };
    let t2 = pay(&env.pool, &tenant2, &cmd("k-1", 9999), 5)
        .await
        .unwrap();
    assert!(!t2.replayed);
    assert_eq!(
        (t2.value.id, t2.value.tenant, t2.value.amount),
        (5, 2, 9999)
    );
    let user8 = Ctx { tenant: 1, user: 8 };
    let u8 = pay(&env.pool, &user8, &cmd("k-1", 3000), 6).await.unwrap();
    assert!(!u8.replayed);
    assert_eq!(u8.value.id, 6);
    assert_eq!(env.payments().await, 3);
    assert_eq!(env.records().await, 3);
    // And each scope replays its own record.
    let t2_again = pay(&env.pool, &tenant2, &cmd("k-1", 9999), 7)
        .await
        .unwrap();
    assert!(t2_again.replayed);
    assert_eq!(t2_again.value, t2.value);
    let scopes: Vec<String> = env
        .client
        .query(
            "SELECT scope_label FROM idem_requests ORDER BY scope_label",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(scopes, ["[1,7]", "[1,8]", "[2,7]"]);
}
