//! A retry loop inside an attempt is rejected.

use super::*;

// ---------------------------------------------------------------------------
// Nesting
// ---------------------------------------------------------------------------

#[retryable]
async fn inner(conn: &mut AsyncPgConnection, calls: &AtomicU32) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    insert_item(conn, 60).await?;
    Ok(())
}

#[retryable]
async fn outer(
    conn: &mut AsyncPgConnection,
    pool: &Pool,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    insert_item(conn, 61).await?;
    inner(pool, calls).await
}

#[retryable]
async fn outer_with_closure(
    conn: &mut AsyncPgConnection,
    pool: &Pool,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    insert_item(conn, 62).await?;
    retry(pool, RetryPolicy::new(), "inner_closure", |conn| {
        async move {
            calls.fetch_add(1, Ordering::SeqCst);
            insert_item(conn, 63).await?;
            Ok::<_, AppError>(())
        }
        .scope_boxed()
    })
    .await
}

#[tokio::test]
async fn a_retry_loop_inside_an_attempt_is_rejected() {
    let env = env(4).await;
    let calls = AtomicU32::new(0);
    let result = outer(&env.pool, &env.pool, &calls).await;
    assert!(
        matches!(result, Err(AppError::Idem(idem::Error::Nested))),
        "{result:?}"
    );
    let result = outer_with_closure(&env.pool, &env.pool, &calls).await;
    assert!(
        matches!(result, Err(AppError::Idem(idem::Error::Nested))),
        "{result:?}"
    );
    assert_eq!(count(&calls), 0, "no inner body ran");
    assert_eq!(env.scalar_i64("SELECT count(*) FROM items").await, 1);
    // Called on its own, the inner function works.
    inner(&env.pool, &calls).await.unwrap();
    assert_eq!(count(&calls), 1);
    env.assert_pool_clean().await;
}
