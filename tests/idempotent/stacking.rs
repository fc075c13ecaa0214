//! Stacking with `#[retryable]`, in both orders.

use super::*;

// ---------------------------------------------------------------------------
// Stacking with #[retryable], in both orders
// ---------------------------------------------------------------------------

#[idempotent(key = key, fingerprint(n), scope = none)]
#[retryable(max = 5, deadline_ms = 30000, backoff_base_ms = 1, backoff_cap_ms = 10)]
async fn idempotent_over_retryable(
    conn: &mut AsyncPgConnection,
    key: &str,
    n: i64,
    script: &Script,
) -> Result<i64, AppError> {
    let id = insert_effect(conn, "stacked", n).await?;
    script.run(conn).await?;
    Ok(id)
}

#[retryable(max = 5, deadline_ms = 30000, backoff_base_ms = 1, backoff_cap_ms = 10)]
#[idempotent(key = key, fingerprint(n), scope = none)]
async fn retryable_over_idempotent(
    conn: &mut AsyncPgConnection,
    key: &str,
    n: i64,
    script: &Script,
) -> Result<i64, AppError> {
    let id = insert_effect(conn, "stacked", n).await?;
    script.run(conn).await?;
    Ok(id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn both_stacking_orders_retry_conflicts_and_record_once() {
    let env = env(2).await;
    for (order, key) in [(0, "stack-idem-first"), (1, "stack-retry-first")] {
        let script = Script::new(&[Step::SerializationFailure, Step::Stale]);
        let call = || async {
            match order {
                0 => idempotent_over_retryable(&env.pool, key, 5, &script).await,
                _ => retryable_over_idempotent(&env.pool, key, 5, &script).await,
            }
        };
        let first = call().await.unwrap();
        assert!(!first.replayed, "{key}");
        assert_eq!(script.calls(), 3, "{key}: a 40001, a Stale, then success");
        // Only the last attempt's write, and its record, committed.
        let (id, n): (i64, i64) = {
            let row = env
                .client
                .query_one(
                    "SELECT max(id), count(*) FROM effects WHERE tag = 'stacked'",
                    &[],
                )
                .await
                .unwrap();
            (row.get(0), row.get(1))
        };
        assert_eq!((n, id), ((order + 1) as i64, first.value), "{key}");
        let (state, outcome, response) = env.record(key).await.unwrap();
        assert_eq!(
            (state.as_str(), outcome.as_deref(), response),
            ("completed", Some("ok"), Some(first.value.to_string())),
            "{key}"
        );
        let replay = call().await.unwrap();
        assert!(replay.replayed, "{key}");
        assert_eq!(replay.value, first.value);
        assert_eq!(script.calls(), 3, "{key}");
    }
    assert_eq!(env.records().await, 2);
}
