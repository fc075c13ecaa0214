//! Open savepoints met by replays, failures, panics and cancellation.

use super::*;

/// An outer `conn.transaction(..)` completes while an inner one inside it
/// was dropped by a timeout: the outer's "commit" only released the inner
/// savepoint, so the outer is still open when the body returns `Ok`.
#[retryable(max = 4, deadline_ms = 5000)]
async fn outer_completes_inner_dropped(
    conn: &mut AsyncPgConnection,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    insert_item(conn, 1800).await?;
    let outer = conn
        .transaction::<_, AppError, _>(async |c| {
            insert_item(c, 1801).await?;
            let inner = tokio::time::timeout(
                Duration::from_millis(50),
                c.transaction::<_, AppError, _>(async |c2| {
                    insert_item(c2, 1802).await?;
                    diesel::sql_query("SELECT pg_sleep(0.3)")
                        .execute(c2)
                        .await?;
                    Ok(())
                }),
            )
            .await;
            assert!(inner.is_err(), "the inner transaction was to time out");
            insert_item(c, 1803).await?;
            Ok(())
        })
        .await;
    assert!(outer.is_ok(), "{outer:?}");
    Ok(())
}

#[tokio::test]
async fn attack_outer_transaction_completes_with_inner_dropped() {
    let env = env(1).await;
    let calls = AtomicU32::new(0);
    let result = outer_completes_inner_dropped(&env.pool, &calls).await;
    assert!(savepoint_open(&result), "{result:?}");
    assert_eq!(count(&calls), 1);
    assert_eq!(items_in(&env, "1800, 1801, 1802, 1803").await, 0);
    no_session_left_in_a_transaction(&env, "outer completes").await;
    env.assert_pool_clean().await;
}

/// A dropped inner transaction the body then ends itself through
/// diesel-async's manager (a rollback to its savepoint): legitimate, and
/// the rest of the transaction commits.
#[retryable(max = 4, deadline_ms = 5000)]
async fn dropped_then_repaired(
    conn: &mut AsyncPgConnection,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    insert_item(conn, 1900).await?;
    let inner = tokio::time::timeout(
        Duration::from_millis(50),
        conn.transaction::<_, AppError, _>(async |c| {
            insert_item(c, 1901).await?;
            diesel::sql_query("SELECT pg_sleep(0.3)").execute(c).await?;
            Ok(())
        }),
    )
    .await;
    assert!(inner.is_err());
    AnsiTransactionManager::rollback_transaction(conn).await?;
    insert_item(conn, 1902).await?;
    Ok(())
}

#[tokio::test]
async fn attack_dropped_inner_transaction_rolled_back_by_the_body_commits_the_rest() {
    let env = env(1).await;
    let calls = AtomicU32::new(0);
    dropped_then_repaired(&env.pool, &calls)
        .await
        .expect("the savepoint was ended: the transaction commits");
    assert_eq!(count(&calls), 1);
    assert_eq!(items_in(&env, "1900, 1902").await, 2);
    assert_eq!(items_in(&env, "1901").await, 0);
    no_session_left_in_a_transaction(&env, "repaired").await;
    env.assert_pool_clean().await;
}

/// An inner transaction timed out while its statement (`pg_sleep(5)`)
/// still runs when the body returns `Ok`, under a short deadline: the
/// statement is cut by the deadline, nothing commits, nothing stays.
#[retryable(max = 2, deadline_ms = 400)]
async fn statement_still_running_in_open_savepoint(
    conn: &mut AsyncPgConnection,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    bump_counter_3_in(conn).await?;
    insert_item(conn, 2000).await?;
    let _ = tokio::time::timeout(
        Duration::from_millis(30),
        conn.transaction::<_, AppError, _>(async |c| {
            insert_item(c, 2001).await?;
            diesel::sql_query("SELECT pg_sleep(5)").execute(c).await?;
            Ok(())
        }),
    )
    .await;
    Ok(())
}

#[tokio::test]
async fn attack_statement_still_running_in_an_open_savepoint_at_return() {
    let env = warm_pool_of_two().await;
    let calls = AtomicU32::new(0);
    let started = Instant::now();
    let result = statement_still_running_in_open_savepoint(&env.pool, &calls).await;
    assert!(result.is_err(), "never Ok: {result:?}");
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "the deadline bounds it: {:?}",
        started.elapsed()
    );
    assert_eq!(items_in(&env, "2000, 2001").await, 0, "{result:?}");
    assert_eq!(env.counter(3).await.0, 0, "{result:?}");
    no_session_left_in_a_transaction(&env, "still running").await;
    let sleeping = env
        .scalar_i64(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND query LIKE '%pg_sleep(5)%' AND state = 'active' AND pid <> pg_backend_pid()",
        )
        .await;
    assert_eq!(sleeping, 0, "the abandoned statement was cancelled");
    lock_released(&env, "still running").await;
    env.assert_pool_clean().await;
}

/// First attempt: a savepoint left open, a real serialization failure in
/// it (not rolled back to), and the error returned; the replay, on another
/// connection, commits once.
#[retryable(max = 4, deadline_ms = 10000)]
async fn serialization_failure_in_open_savepoint(
    conn: &mut AsyncPgConnection,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    let n = calls.fetch_add(1, Ordering::SeqCst);
    bump_counter_3_in(conn).await?;
    insert_item(conn, 2100).await?;
    if n == 0 {
        AnsiTransactionManager::begin_transaction(conn).await?;
        insert_item(conn, 2101).await?;
        fail_with(conn, RetryCause::SerializationFailure).await?;
    }
    Ok(())
}

#[tokio::test]
async fn attack_serialization_failure_in_an_open_savepoint_replays_once() {
    let env = warm_pool_of_two().await;
    let calls = AtomicU32::new(0);
    serialization_failure_in_open_savepoint(&env.pool, &calls)
        .await
        .expect("the replay commits");
    assert_eq!(count(&calls), 2, "one replay, not a wait on a left lock");
    assert_eq!(items_in(&env, "2100").await, 1);
    assert_eq!(items_in(&env, "2101").await, 0);
    assert_eq!(env.counter(3).await.0, 1, "committed exactly once");
    no_session_left_in_a_transaction(&env, "serialization failure").await;
    env.assert_pool_clean().await;
}

/// The same failure swallowed: the body returns `Ok` with the savepoint
/// open and the transaction failed inside it. Not `Ok`; and when the loop
/// replays it, the replay commits exactly once.
#[retryable(max = 4, deadline_ms = 10000)]
async fn swallowed_failure_in_open_savepoint(
    conn: &mut AsyncPgConnection,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    let n = calls.fetch_add(1, Ordering::SeqCst);
    insert_item(conn, 2200).await?;
    if n == 0 {
        AnsiTransactionManager::begin_transaction(conn).await?;
        let _ = fail_with(conn, RetryCause::SerializationFailure).await;
    }
    Ok(())
}

#[tokio::test]
async fn attack_swallowed_failure_in_an_open_savepoint() {
    let env = env(1).await;
    let calls = AtomicU32::new(0);
    let result = swallowed_failure_in_open_savepoint(&env.pool, &calls).await;
    let committed = items_in(&env, "2200").await;
    match &result {
        Ok(()) => {
            assert_eq!(count(&calls), 2, "Ok only after a replay");
            assert_eq!(committed, 1);
        }
        Err(_) => assert_eq!(committed, 0, "{result:?}"),
    }
    no_session_left_in_a_transaction(&env, "swallowed").await;
    env.assert_pool_clean().await;
}

/// A lost race (`Stale` by `lost_race()`) with a savepoint open on the
/// first attempt, on a pool of one: the replay gets a fresh connection and
/// commits exactly once.
#[retryable(max = 4, deadline_ms = 10000)]
async fn stale_with_open_savepoint(
    conn: &mut AsyncPgConnection,
    depth: u32,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    let n = calls.fetch_add(1, Ordering::SeqCst);
    diesel::sql_query("UPDATE counters SET n = n + 1 WHERE id = 2")
        .execute(conn)
        .await?;
    if n == 0 {
        for _ in 0..depth {
            AnsiTransactionManager::begin_transaction(conn).await?;
            diesel::sql_query("UPDATE counters SET n = n + 100 WHERE id = 2")
                .execute(conn)
                .await?;
        }
        return Err(lost_a_race());
    }
    Ok(())
}

#[tokio::test]
async fn attack_stale_with_savepoints_open_replays_once_on_a_pool_of_one() {
    let env = env(1).await;
    for depth in 1..=3u32 {
        let calls = AtomicU32::new(0);
        let before = env.counter(2).await.0;
        stale_with_open_savepoint(&env.pool, depth, &calls)
            .await
            .unwrap_or_else(|e| panic!("depth {depth}: {e:?}"));
        assert_eq!(count(&calls), 2, "depth {depth}");
        assert_eq!(env.counter(2).await.0, before + 1, "depth {depth}");
        no_session_left_in_a_transaction(&env, "stale").await;
    }
    env.assert_pool_clean().await;
}

/// A non-replayable error of the body's own with a savepoint open, after
/// taking a row lock: returned once, nothing commits, the lock goes.
#[retryable(max = 4, deadline_ms = 5000)]
async fn own_error_with_open_savepoint(
    conn: &mut AsyncPgConnection,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    bump_counter_3_in(conn).await?;
    AnsiTransactionManager::begin_transaction(conn).await?;
    AnsiTransactionManager::begin_transaction(conn).await?;
    insert_item(conn, 2300).await?;
    Err(AppError::InsufficientFunds)
}

#[tokio::test]
async fn attack_own_error_with_savepoints_open_leaves_no_lock() {
    let env = warm_pool_of_two().await;
    let calls = AtomicU32::new(0);
    let result = own_error_with_open_savepoint(&env.pool, &calls).await;
    assert!(
        matches!(result, Err(AppError::InsufficientFunds)),
        "{result:?}"
    );
    assert_eq!(count(&calls), 1);
    assert_eq!(items_in(&env, "2300").await, 0);
    assert_eq!(env.counter(3).await.0, 0);
    no_session_left_in_a_transaction(&env, "own error").await;
    lock_released(&env, "own error").await;
    env.assert_pool_clean().await;
}

/// The body panics with a savepoint open (and, second, without): the
/// panic reaches the caller, nothing commits, and no session stays in the
/// transaction holding its lock.
#[retryable(max = 4, deadline_ms = 5000)]
async fn panics_midway(conn: &mut AsyncPgConnection, savepoint: bool) -> Result<(), AppError> {
    bump_counter_3_in(conn).await?;
    insert_item(conn, 2400).await?;
    if savepoint {
        AnsiTransactionManager::begin_transaction(conn).await?;
        insert_item(conn, 2401).await?;
    }
    panic!("the body panics");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_body_panics_with_a_savepoint_open() {
    let env = warm_pool_of_two().await;
    for savepoint in [true, false] {
        let pool = env.pool.clone();
        let joined = tokio::spawn(async move { panics_midway(&pool, savepoint).await }).await;
        assert!(
            joined.is_err_and(|e| e.is_panic()),
            "the panic is the caller's"
        );
        assert_eq!(
            items_in(&env, "2400, 2401").await,
            0,
            "savepoint {savepoint}"
        );
        assert_eq!(env.counter(3).await.0, 0, "savepoint {savepoint}");
        no_session_left_in_a_transaction(&env, "panic").await;
        lock_released(&env, "panic").await;
        // The lock check bumped it: back to 0 for the next round.
        env.client
            .batch_execute("UPDATE counters SET n = 0 WHERE id = 3")
            .await
            .unwrap();
    }
    env.assert_pool_clean().await;
}

/// The caller drops the call's future while the body sits in an open
/// savepoint (`pg_sleep` inside it): nothing commits, the statement is
/// cancelled and the lock goes.
#[retryable(max = 4, deadline_ms = 20000)]
async fn sleeps_in_a_savepoint(conn: &mut AsyncPgConnection) -> Result<(), AppError> {
    bump_counter_3_in(conn).await?;
    conn.transaction::<_, AppError, _>(async |c| {
        insert_item(c, 2500).await?;
        diesel::sql_query("SELECT pg_sleep(10)").execute(c).await?;
        Ok(())
    })
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_call_cancelled_inside_an_open_savepoint() {
    let env = warm_pool_of_two().await;
    let dropped =
        tokio::time::timeout(Duration::from_millis(300), sleeps_in_a_savepoint(&env.pool)).await;
    assert!(dropped.is_err(), "the call was to be cancelled");
    assert_eq!(items_in(&env, "2500").await, 0);
    assert_eq!(env.counter(3).await.0, 0);
    no_session_left_in_a_transaction(&env, "cancelled").await;
    // Directly, idem's cancel ends the statement at once. Behind a
    // transaction pooler none is sent (PgBouncer drops it, and 1.18 was seen
    // to exit on one): the server ends it when its
    // `client_connection_check_interval` (1 s in the harness) finds the
    // client gone.
    let within = if env.db.via().is_transaction_pooling() {
        Duration::from_secs(4)
    } else {
        Duration::from_secs(1)
    };
    let until = Instant::now() + within;
    loop {
        let sleeping = env
            .scalar_i64(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                 AND query LIKE '%pg_sleep(10)%' AND state = 'active' AND pid <> pg_backend_pid()",
            )
            .await;
        if sleeping == 0 {
            break;
        }
        assert!(
            Instant::now() < until,
            "the abandoned statement still runs after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    lock_released(&env, "cancelled").await;
    env.assert_pool_clean().await;
}

/// A connection of the pool handed to `begin_test_transaction` (a common
/// test set-up) and given back: a write made in it never commits, and the
/// next call neither answers `Ok` without committing nor runs inside that
/// test transaction.
#[retryable(max = 4, deadline_ms = 5000)]
async fn insert_one(conn: &mut AsyncPgConnection, id: i64) -> Result<(), AppError> {
    insert_item(conn, id).await?;
    Ok(())
}

#[tokio::test]
async fn attack_begin_test_transaction_on_a_pooled_connection() {
    let env = env(1).await;
    {
        let mut conn = env.pool.get().await.unwrap();
        conn.begin_test_transaction().await.unwrap();
        insert_item(&mut conn, 2600).await.unwrap();
    }
    let result = insert_one(&env.pool, 2601).await;
    let committed = items_in(&env, "2601").await;
    match &result {
        Ok(()) => assert_eq!(committed, 1, "Ok means committed"),
        Err(_) => assert_eq!(committed, 0, "{result:?}"),
    }
    assert_eq!(
        items_in(&env, "2600").await,
        0,
        "a test transaction never commits"
    );
    no_session_left_in_a_transaction(&env, "test transaction").await;
    env.assert_pool_clean().await;
}

/// The body marks its open savepoint as diesel's test transaction (the
/// flag `begin_test_transaction` sets, through diesel-async's doc-hidden
/// accessor): diesel-async then no longer counts the connection broken.
#[retryable(max = 4, deadline_ms = 5000)]
async fn open_marked_as_test(
    conn: &mut AsyncPgConnection,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    insert_item(conn, 2700).await?;
    AnsiTransactionManager::begin_transaction(conn).await?;
    insert_item(conn, 2701).await?;
    AnsiTransactionManager::transaction_manager_status_mut(conn).set_test_transaction_flag();
    Ok(())
}

#[tokio::test]
async fn attack_open_savepoint_marked_as_test_transaction() {
    let env = env(1).await;
    let calls = AtomicU32::new(0);
    let result = open_marked_as_test(&env.pool, &calls).await;
    let committed = items_in(&env, "2700, 2701").await;
    assert!(
        savepoint_open(&result),
        "{result:?}, {committed} of 2 items committed"
    );
    assert_eq!(committed, 0, "{result:?}");
    no_session_left_in_a_transaction(&env, "test flag").await;
    env.assert_pool_clean().await;
}
