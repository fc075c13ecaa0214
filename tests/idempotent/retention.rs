//! Retention: an expired key is new again, and the purge deletes in batches.

use super::*;

// ---------------------------------------------------------------------------
// Retention and purge
// ---------------------------------------------------------------------------

#[idempotent(key = key, fingerprint(n), ttl_s = 1, scope = none)]
async fn short_lived(
    conn: &mut AsyncPgConnection,
    key: &str,
    n: i64,
    script: &Script,
) -> Result<i64, AppError> {
    let id = insert_effect(conn, "short", n).await?;
    script.run(conn).await?;
    Ok(id)
}

async fn wait_until_expired(env: &Env, key: &str) {
    let until = Instant::now() + Duration::from_secs(20);
    while env
        .client
        .query_one(
            "SELECT count(*) FROM idem_requests WHERE key = $1 AND expires_at <= now()",
            &[&key],
        )
        .await
        .unwrap()
        .get::<_, i64>(0)
        == 0
    {
        assert!(Instant::now() < until, "{key} never expired");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_its_retention_a_key_is_new() {
    let env = Arc::new(env(10).await);
    let script = Arc::new(Script::default());
    let first = short_lived(&env.pool, "r-1", 1, &script).await.unwrap();
    assert!(!first.replayed);
    let expiry: f64 = env
        .client
        .query_one(
            "SELECT extract(epoch FROM expires_at - created_at)::float8 FROM idem_requests WHERE key = 'r-1'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(expiry, 1.0, "ttl_s = 1");
    let replay = short_lived(&env.pool, "r-1", 1, &script).await.unwrap();
    assert!(replay.replayed);
    assert!(matches_idem(
        &short_lived(&env.pool, "r-1", 2, &script).await,
        "FingerprintMismatch"
    ));

    wait_until_expired(&env, "r-1").await;
    // Reused after expiry, even for another request: new, and run once, by
    // one of several requests racing to take the expired record over.
    let barrier = Arc::new(Barrier::new(10));
    let racers: Vec<_> = (0..10)
        .map(|_| {
            let (env, script, barrier) = (env.clone(), script.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                short_lived(&env.pool, "r-1", 2, &script).await
            })
        })
        .collect();
    let mut answers = Vec::new();
    for racer in racers {
        answers.push(racer.await.unwrap().unwrap());
    }
    let reused: Vec<_> = answers.iter().filter(|a| !a.replayed).collect();
    assert_eq!(reused.len(), 1, "one request took the expired key over");
    let reused = reused[0].clone();
    assert!(answers.iter().all(|a| a.value == reused.value));
    assert_ne!(reused.value, first.value);
    assert_eq!(script.calls(), 2);
    assert_eq!(
        env.records().await,
        1,
        "the record was taken over, not duplicated"
    );
    // The key now belongs to the new request.
    assert!(
        short_lived(&env.pool, "r-1", 2, &script)
            .await
            .unwrap()
            .replayed
    );
    assert!(matches_idem(
        &short_lived(&env.pool, "r-1", 1, &script).await,
        "FingerprintMismatch"
    ));
    assert_eq!(env.effects("short").await, 2);

    // Once expired, the purge drops it.
    wait_until_expired(&env, "r-1").await;
    let mut conn = AsyncPgConnection::establish(env.db.url()).await.unwrap();
    let report = purge_expired(&mut conn, 100).await.unwrap();
    assert_eq!(report.deleted, 1);
    assert_eq!(env.records().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn purge_deletes_expired_completed_records_in_batches_and_keeps_the_rest() {
    let env = env(1).await;
    // Every DELETE statement on the table logs how many rows it deleted.
    env.client
        .batch_execute(
            "CREATE TABLE purge_log (id bigserial PRIMARY KEY, deleted bigint NOT NULL);
             CREATE FUNCTION log_purge() RETURNS trigger LANGUAGE plpgsql AS
                 $$ BEGIN INSERT INTO purge_log (deleted) SELECT count(*) FROM gone; RETURN NULL; END $$;
             CREATE TRIGGER log_purge AFTER DELETE ON idem_requests
                 REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION log_purge();",
        )
        .await
        .unwrap();
    let insert = |prefix: &'static str,
                  n: i32,
                  state: &'static str,
                  outcome: &'static str,
                  expires: &'static str,
                  lease: &'static str| {
        format!(
            "INSERT INTO idem_requests (scope, key, operation, fingerprint, mode, state, outcome, response, expires_at, lease_until)
             SELECT 'null', '{prefix}-' || i, 'op', sha256(i::text::bytea), 'local', '{state}', {outcome},
                    CASE WHEN {outcome} IS NULL THEN NULL ELSE '1'::jsonb END, now() + {expires}, {lease}
             FROM generate_series(1, {n}) AS i"
        )
    };
    for statement in [
        insert(
            "expired",
            50,
            "completed",
            "'ok'",
            "interval '-1 minute'",
            "NULL",
        ),
        insert(
            "expired-error",
            3,
            "completed",
            "'error'",
            "interval '-1 second'",
            "NULL",
        ),
        insert("live", 5, "completed", "'ok'", "interval '1 hour'", "NULL"),
        insert(
            "lease-out",
            4,
            "in_progress",
            "NULL",
            "interval '-1 minute'",
            "now() - interval '1 second'",
        ),
        insert(
            "leased",
            3,
            "in_progress",
            "NULL",
            "interval '-1 minute'",
            "now() + interval '1 hour'",
        ),
        insert(
            "unknown",
            6,
            "unknown",
            "NULL",
            "interval '-1 minute'",
            "NULL",
        ),
    ] {
        env.client.batch_execute(&statement).await.unwrap();
    }
    let mut conn = AsyncPgConnection::establish(env.db.url()).await.unwrap();
    let report = purge_expired(&mut conn, 7).await.unwrap();
    assert_eq!(report.deleted, 53);
    assert_eq!(report.marked_unknown, 4);
    assert_eq!(report.unknown, 10);
    let batches: Vec<i64> = env
        .client
        .query(
            "SELECT deleted FROM purge_log WHERE deleted > 0 ORDER BY id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        batches,
        [7, 7, 7, 7, 7, 7, 7, 4],
        "53 rows, 7 per statement"
    );
    let left: Vec<(String, i64)> = env
        .client
        .query(
            "SELECT split_part(key, '-', 1) || ':' || state, count(*) FROM idem_requests GROUP BY 1 ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        left,
        [
            ("lease:unknown".to_owned(), 4),
            ("leased:in_progress".to_owned(), 3),
            ("live:completed".to_owned(), 5),
            ("unknown:unknown".to_owned(), 6),
        ]
    );
    // Nothing more to do: a second purge deletes and marks nothing.
    let again = purge_expired(&mut conn, 7).await.unwrap();
    assert_eq!(
        (again.deleted, again.marked_unknown, again.unknown),
        (0, 0, 10)
    );
}
