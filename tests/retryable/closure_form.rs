//! The closure form, `idem::retry::retry`.

use super::*;

// ---------------------------------------------------------------------------
// The closure form
// ---------------------------------------------------------------------------

const CLOSURE_POLICY: RetryPolicy = RetryPolicy::new()
    .isolation(Isolation::RepeatableRead)
    .deadline(Duration::from_secs(20));

async fn deposit_with_closure(
    pool: &Pool,
    barrier: &Barrier,
    calls: &AtomicU32,
) -> Result<u32, AppError> {
    retry(pool, CLOSURE_POLICY, "deposit_with_closure", |conn| {
        async move {
            calls.fetch_add(1, Ordering::SeqCst);
            let attempt = attempt_no();
            let balance: i64 = sql::<BigInt>("SELECT balance FROM accounts WHERE id = 2")
                .get_result(conn)
                .await?;
            if attempt == 1 {
                barrier.wait().await;
            }
            diesel::sql_query("UPDATE accounts SET balance = $1 WHERE id = 2")
                .bind::<BigInt, _>(balance + 1)
                .execute(conn)
                .await?;
            Ok(attempt)
        }
        .scope_boxed()
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_closure_form_replays_the_same_way() {
    let env = env(4).await;
    let barrier = Barrier::new(2);
    let calls = AtomicU32::new(0);
    let (a, b) = tokio::join!(
        deposit_with_closure(&env.pool, &barrier, &calls),
        deposit_with_closure(&env.pool, &barrier, &calls)
    );
    let mut attempts = vec![a.unwrap(), b.unwrap()];
    attempts.sort();
    assert_eq!(attempts, vec![1, 2]);
    assert_eq!(count(&calls), 3, "the closure runs once per attempt");
    assert_eq!(
        env.scalar_i64("SELECT balance FROM accounts WHERE id = 2")
            .await,
        2
    );

    // Not replayed: the user's error, after one call and a rollback.
    let calls = AtomicU32::new(0);
    let result: Result<(), AppError> = retry(&env.pool, CLOSURE_POLICY, "refuse", |conn| {
        let calls = &calls;
        async move {
            calls.fetch_add(1, Ordering::SeqCst);
            insert_item(conn, 70).await?;
            Err(AppError::InsufficientFunds)
        }
        .scope_boxed()
    })
    .await;
    assert!(matches!(result, Err(AppError::InsufficientFunds)));
    assert_eq!(count(&calls), 1);
    assert_eq!(
        env.scalar_i64("SELECT count(*) FROM items WHERE id = 70")
            .await,
        0
    );

    // Swallowed errors are caught here too.
    let result: Result<(), AppError> = retry(&env.pool, CLOSURE_POLICY, "swallow", |conn| {
        async move {
            let _ = insert_item(conn, 1).await;
            Ok(())
        }
        .scope_boxed()
    })
    .await;
    assert!(matches!(
        result,
        Err(AppError::Idem(idem::Error::RolledBack))
    ));
    env.assert_pool_clean().await;
}
