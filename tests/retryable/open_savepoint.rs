//! A body that returns with a savepoint still open: diesel-async's `COMMIT`
//! would be a `RELEASE SAVEPOINT`, which leaves the transaction open and
//! commits nothing. The call must say so, never `Ok`.

use super::*;
use diesel_async::{AnsiTransactionManager, TransactionManager};

/// Opens a savepoint through diesel-async's transaction manager and
/// returns with it open.
#[retryable(max = 4, deadline_ms = 5000)]
async fn leave_a_savepoint_open(
    conn: &mut AsyncPgConnection,
    id: i64,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    insert_item(conn, id).await?;
    AnsiTransactionManager::begin_transaction(conn).await?;
    insert_item(conn, id + 1).await?;
    Ok(())
}

/// The shape it takes in real code: a `conn.transaction(..)` given a time
/// limit, whose future the timeout drops with its savepoint open; the body
/// treats the timeout as "skip this part" and returns `Ok`.
#[retryable(max = 4, deadline_ms = 5000)]
async fn time_out_an_inner_transaction(
    conn: &mut AsyncPgConnection,
    id: i64,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    insert_item(conn, id).await?;
    let optional = tokio::time::timeout(
        Duration::from_millis(50),
        conn.transaction::<_, AppError, _>(async |c| {
            insert_item(c, id + 1).await?;
            diesel::sql_query("SELECT pg_sleep(0.3)").execute(c).await?;
            Ok(())
        }),
    )
    .await;
    assert!(optional.is_err(), "the inner transaction was to time out");
    Ok(())
}

fn is_savepoint_open(result: &Result<(), AppError>) -> bool {
    matches!(result, Err(AppError::Idem(idem::Error::SavepointOpen)))
}

/// The call answered `SavepointOpen` after one attempt, and none of the
/// items `ids` (an SQL list) committed.
async fn refused_whole(env: &Env, result: &Result<(), AppError>, calls: &AtomicU32, ids: &str) {
    assert!(is_savepoint_open(result), "{result:?}");
    assert_eq!(count(calls), 1, "not replayed");
    let committed = env
        .scalar_i64(&format!("SELECT count(*) FROM items WHERE id IN ({ids})"))
        .await;
    assert_eq!(committed, 0, "nothing committed");
}

#[tokio::test]
async fn a_savepoint_left_open_commits_nothing_and_says_so() {
    let env = env(1).await;
    let calls = AtomicU32::new(0);
    let result = leave_a_savepoint_open(&env.pool, 100, &calls).await;
    refused_whole(&env, &result, &calls, "100, 101").await;
    // The connection left with its transaction; the pool's next one is clean
    // and commits.
    env.assert_pool_clean().await;
    recover_with_a_savepoint_and_commit(&env.pool)
        .await
        .unwrap();
    assert_eq!(
        env.scalar_i64("SELECT count(*) FROM items WHERE id = 102")
            .await,
        1
    );
}

#[tokio::test]
async fn an_inner_transaction_dropped_by_a_timeout_commits_nothing() {
    let env = env(1).await;
    let calls = AtomicU32::new(0);
    let result = time_out_an_inner_transaction(&env.pool, 110, &calls).await;
    refused_whole(&env, &result, &calls, "110, 111").await;
    env.assert_pool_clean().await;
}

#[tokio::test]
async fn the_closure_form_says_so_too() {
    let env = env(1).await;
    let result: Result<(), AppError> = retry(&env.pool, RetryPolicy::new(), "open", |conn| {
        async move {
            insert_item(conn, 120).await?;
            AnsiTransactionManager::begin_transaction(conn).await?;
            Ok(())
        }
        .scope_boxed()
    })
    .await;
    assert!(is_savepoint_open(&result), "{result:?}");
    assert_eq!(
        env.scalar_i64("SELECT count(*) FROM items WHERE id = 120")
            .await,
        0
    );
    env.assert_pool_clean().await;
}

/// A savepoint opened and ended: the transaction commits as usual.
#[retryable(max = 4)]
async fn recover_with_a_savepoint_and_commit(conn: &mut AsyncPgConnection) -> Result<(), AppError> {
    conn.transaction::<_, DieselError, _>(async |c| insert_item(c, 102).await)
        .await?;
    Ok(())
}

/// Fails after opening a savepoint it never ends, with a cause the loop
/// replays: the row it locked must not stay locked on a pooled connection.
#[retryable(max = 3, deadline_ms = 20000)]
async fn lock_then_fail_with_a_savepoint_open(
    conn: &mut AsyncPgConnection,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    let n = calls.fetch_add(1, Ordering::SeqCst);
    bump_counter_3_in(conn).await?;
    if n == 0 {
        AnsiTransactionManager::begin_transaction(conn).await?;
        return Err(lost_a_race());
    }
    Ok(())
}

#[tokio::test]
async fn a_failed_attempt_with_a_savepoint_open_leaves_no_transaction_behind() {
    // Two connections: the replay may take the other one while the first,
    // had it gone back to the pool in its transaction, held the row's lock.
    let env = env(2).await;
    {
        // Both connections made and idle: the next checkout after the first
        // attempt's is the other one.
        let a = env.pool.get().await.unwrap();
        let b = env.pool.get().await.unwrap();
        drop((a, b));
    }
    let calls = AtomicU32::new(0);
    lock_then_fail_with_a_savepoint_open(&env.pool, &calls)
        .await
        .expect("the replay commits");
    // A third attempt would mean the second waited on the first's row lock,
    // left in a transaction on a pooled connection, until its lock timeout.
    assert_eq!(count(&calls), 2);
    assert_eq!(
        env.counter(3).await.0,
        1,
        "the first attempt's update rolled back"
    );
    assert_eq!(env.idle_in_transaction().await, 0);
    env.assert_pool_clean().await;
}
