//! Local mode writes one row per new request: the completed record, inserted
//! just before COMMIT. Duplicates queue on an advisory lock of (scope, key)
//! and then replay, at every isolation level; a lock shared by two unrelated
//! requests (a hash collision) only makes one wait for the other.

use super::*;

macro_rules! isolated {
    ($name:ident, $level:ident) => {
        /// Writes an effect, or declines when `n` is negative.
        #[idempotent(key = key, scope = none, fingerprint(n))]
        #[retryable(max = 8, deadline_ms = 30000, isolation = $level)]
        async fn $name(conn: &mut AsyncPgConnection, key: &str, n: i64) -> Result<i64, AppError> {
            let id = insert_effect(conn, stringify!($name), n).await?;
            // Widen the window in which duplicates arrive.
            tokio::time::sleep(Duration::from_millis(20)).await;
            if n < 0 {
                return Err(AppError::Declined(Declined::InsufficientFunds {
                    needed: -n,
                }));
            }
            Ok(id)
        }
    };
}
isolated!(read_committed, read_committed);
isolated!(repeatable_read, repeatable_read);
isolated!(serializable, serializable);

/// Fires `copies` calls of one key at once and returns their results.
async fn race<F, Fut>(copies: usize, call: F) -> Vec<Result<idem::Idempotent<i64>, AppError>>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<idem::Idempotent<i64>, AppError>> + Send + 'static,
{
    let tasks: Vec<_> = (0..copies).map(|_| tokio::spawn(call())).collect();
    let mut results = Vec::new();
    for task in tasks {
        results.push(task.await.expect("no panic"));
    }
    results
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_duplicates_have_one_effect_at_every_isolation_level() {
    let env = env(8).await;
    for level in ["read_committed", "repeatable_read", "serializable"] {
        // A success, raced by 24 copies.
        let pool = env.pool.clone();
        let results = race(24, move || {
            let pool = pool.clone();
            async move {
                match level {
                    "read_committed" => read_committed(&pool, "ok", 5).await,
                    "repeatable_read" => repeatable_read(&pool, "ok", 5).await,
                    _ => serializable(&pool, "ok", 5).await,
                }
            }
        })
        .await;
        let ids: Vec<i64> = results
            .iter()
            .map(|r| r.as_ref().expect("every copy answers").value)
            .collect();
        assert!(
            ids.iter().all(|id| *id == ids[0]),
            "{level}: one answer {ids:?}"
        );
        let fresh = results
            .iter()
            .filter(|r| !r.as_ref().unwrap().replayed)
            .count();
        assert_eq!(fresh, 1, "{level}: one ran, the others replayed");
        assert_eq!(env.effects(level).await, 1, "{level}: one effect");

        // A decline, raced: stored once, every copy answers with it.
        let pool = env.pool.clone();
        let results = race(12, move || {
            let pool = pool.clone();
            async move {
                match level {
                    "read_committed" => read_committed(&pool, "no", -3).await,
                    "repeatable_read" => repeatable_read(&pool, "no", -3).await,
                    _ => serializable(&pool, "no", -3).await,
                }
            }
        })
        .await;
        for result in &results {
            assert!(
                matches!(
                    result,
                    Err(AppError::Declined(Declined::InsufficientFunds {
                        needed: 3
                    }))
                ),
                "{level}: {result:?}"
            );
        }
        assert_eq!(
            env.effects(level).await,
            1,
            "{level}: the decline wrote nothing"
        );
        assert_eq!(
            env.record("no")
                .await
                .map(|(state, outcome, _)| (state, outcome)),
            Some(("completed".to_owned(), Some("error".to_owned())))
        );
        env.client
            .batch_execute("DELETE FROM idem_requests")
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_new_request_writes_one_row_version_of_its_record() {
    let env = env(4).await;
    for i in 0..20 {
        let key = format!("one-{i}");
        assert!(!read_committed(&env.pool, &key, i).await.unwrap().replayed);
        assert!(read_committed(&env.pool, &key, i).await.unwrap().replayed);
    }
    // The table started empty: rows written once sit at line pointers 1..=20
    // of its first page; a claim completed by an UPDATE would leave its
    // visible version at 2, 4, ...
    let rows = env
        .client
        .query(
            "SELECT (ctid::text::point)[0]::bigint, (ctid::text::point)[1]::bigint \
             FROM idem_requests ORDER BY 2",
            &[],
        )
        .await
        .unwrap();
    let slots: Vec<(i64, i64)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    let expected: Vec<(i64, i64)> = (1..=20).map(|n| (0, n)).collect();
    assert_eq!(slots, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_colliding_lock_only_makes_the_request_wait() {
    let env = env(2).await;
    let scope = idem::idempotency::scope_hash(&()).unwrap();
    let lock = idem::__private::lock_key(&scope, "collides");
    // An unrelated transaction holds the same advisory lock, as a request
    // whose (scope, key) hashed alike would.
    let mut side = side_connection(env.db.url()).await;
    let holder = side.transaction().await.unwrap();
    tokio_postgres::GenericClient::execute(&holder, "SELECT pg_advisory_xact_lock($1)", &[&lock])
        .await
        .unwrap();
    let pool = env.pool.clone();
    let call = tokio::spawn(async move { read_committed(&pool, "collides", 1).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!call.is_finished(), "it waits for the lock");
    assert_eq!(env.effects("read_committed").await, 0);
    holder.commit().await.unwrap();
    let result = call.await.unwrap().expect("then it runs");
    assert!(!result.replayed, "a new request, not a replay or a refusal");
    assert_eq!(env.effects("read_committed").await, 1);
}
