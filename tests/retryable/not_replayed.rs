//! Not replayed: 23505, user errors, 55P03 unless opted in, swallowed failures; the pool stays clean.

use super::*;

// ---------------------------------------------------------------------------
// Not replayed: 23505, the user's own errors, 55P03 unless opted in
// ---------------------------------------------------------------------------

#[retryable(max = 4)]
async fn insert_items(
    conn: &mut AsyncPgConnection,
    ids: Vec<i64>,
    refuse: bool,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    for id in &ids {
        insert_item(conn, *id).await?;
    }
    if refuse {
        return Err(AppError::InsufficientFunds);
    }
    Ok(())
}

#[tokio::test]
async fn unique_violation_and_user_errors_are_returned_after_one_attempt() {
    let env = env(2).await;
    let calls = AtomicU32::new(0);
    let result = insert_items(&env.pool, vec![2, 1], false, &calls).await;
    assert!(
        matches!(
            result,
            Err(AppError::Db(DieselError::DatabaseError(
                DatabaseErrorKind::UniqueViolation,
                _
            )))
        ),
        "{result:?}"
    );
    assert_eq!(count(&calls), 1);

    let calls = AtomicU32::new(0);
    let result = insert_items(&env.pool, vec![3], true, &calls).await;
    assert!(
        matches!(result, Err(AppError::InsufficientFunds)),
        "{result:?}"
    );
    assert_eq!(count(&calls), 1);

    assert_eq!(
        env.scalar_i64("SELECT count(*) FROM items").await,
        1,
        "neither attempt committed its rows"
    );
    env.assert_pool_clean().await;
}

async fn lock_item_nowait(conn: &mut AsyncPgConnection, calls: &AtomicU32) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    diesel::sql_query("SELECT id FROM items WHERE id = 1 FOR UPDATE NOWAIT")
        .execute(conn)
        .await?;
    Ok(())
}

#[retryable(max = 50, deadline_ms = 20000, backoff_cap_ms = 20)]
async fn nowait(conn: &mut AsyncPgConnection, calls: &AtomicU32) -> Result<(), AppError> {
    lock_item_nowait(conn, calls).await
}

#[retryable(
    max = 50,
    deadline_ms = 20000,
    backoff_cap_ms = 20,
    retry_lock_not_available = true
)]
async fn nowait_replayed(conn: &mut AsyncPgConnection, calls: &AtomicU32) -> Result<(), AppError> {
    lock_item_nowait(conn, calls).await
}

#[retryable(max = 50, deadline_ms = 20000)]
async fn lock_with_timeout(
    conn: &mut AsyncPgConnection,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    conn.batch_execute("SET LOCAL lock_timeout = '50ms'")
        .await?;
    diesel::sql_query("SELECT id FROM items WHERE id = 1 FOR UPDATE")
        .execute(conn)
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lock_not_available_is_replayed_only_when_opted_in() {
    let env = env(2).await;
    let holder = Arc::new(side_connection(env.db.url()).await);
    holder
        .batch_execute("BEGIN; SELECT id FROM items WHERE id = 1 FOR UPDATE")
        .await
        .unwrap();

    let calls = AtomicU32::new(0);
    let result = nowait(&env.pool, &calls).await;
    match &result {
        Err(AppError::Db(e)) => assert_eq!(e.transient(), Some(RetryCause::LockNotAvailable)),
        other => panic!("expected 55P03, got {other:?}"),
    }
    assert_eq!(count(&calls), 1, "55P03 is not replayed by default");

    let calls = AtomicU32::new(0);
    let result = lock_with_timeout(&env.pool, &calls).await;
    match &result {
        Err(AppError::Db(e)) => assert_eq!(e.transient(), Some(RetryCause::LockNotAvailable)),
        other => panic!("expected a lock timeout, got {other:?}"),
    }
    assert_eq!(count(&calls), 1);

    // Opted in: replayed until the holder lets go.
    let calls = Arc::new(AtomicU32::new(0));
    let release = {
        let (calls, holder) = (calls.clone(), holder.clone());
        tokio::spawn(async move {
            while count(&calls) < 2 {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            holder.batch_execute("ROLLBACK").await.unwrap();
        })
    };
    nowait_replayed(&env.pool, &calls).await.unwrap();
    release.await.unwrap();
    assert!(count(&calls) >= 2);
    env.assert_pool_clean().await;
}

// ---------------------------------------------------------------------------
// A body that swallows a failed statement
// ---------------------------------------------------------------------------

#[retryable(max = 4)]
async fn swallow_a_failure(
    conn: &mut AsyncPgConnection,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    let duplicate = insert_item(conn, 1).await;
    assert!(matches!(
        duplicate,
        Err(DieselError::DatabaseError(
            DatabaseErrorKind::UniqueViolation,
            _
        ))
    ));
    // The transaction is aborted: this fails too (25P02), and is ignored too.
    let _ = insert_item(conn, 2).await;
    Ok(())
}

/// The right way to survive a failed statement: a savepoint.
#[retryable(max = 4)]
async fn recover_with_a_savepoint(conn: &mut AsyncPgConnection) -> Result<(), AppError> {
    let duplicate = conn
        .transaction::<_, DieselError, _>(async |conn| insert_item(conn, 1).await)
        .await;
    assert!(duplicate.is_err());
    insert_item(conn, 3).await?;
    Ok(())
}

#[tokio::test]
async fn a_swallowed_error_is_never_reported_as_committed() {
    let env = env(1).await;
    let calls = AtomicU32::new(0);
    let result = swallow_a_failure(&env.pool, &calls).await;
    assert!(
        matches!(result, Err(AppError::Idem(idem::Error::RolledBack))),
        "{result:?}"
    );
    assert_eq!(count(&calls), 1);
    assert_eq!(
        env.scalar_i64("SELECT count(*) FROM items WHERE id <> 1")
            .await,
        0
    );
    env.assert_pool_clean().await;

    // A failure rolled back to a savepoint leaves the transaction healthy.
    recover_with_a_savepoint(&env.pool).await.unwrap();
    assert_eq!(
        env.scalar_i64("SELECT count(*) FROM items WHERE id = 3")
            .await,
        1
    );
    env.assert_pool_clean().await;
}

// ---------------------------------------------------------------------------
// Connection hygiene
// ---------------------------------------------------------------------------

#[retryable(max = 2, deadline_ms = 20000)]
async fn always_stale(conn: &mut AsyncPgConnection) -> Result<(), AppError> {
    insert_item(conn, 50).await?;
    // A hand-written version check that lost its race says so.
    idem::attempt::lost_race();
    Err(AppError::Versioned(VersionedError::Stale {
        expected: 1,
        actual: 2,
    }))
}

#[retryable(max = 4)]
async fn violate_at_commit(conn: &mut AsyncPgConnection) -> Result<(), AppError> {
    conn.batch_execute("INSERT INTO deferred_unique VALUES (1), (1)")
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failed_attempts_never_return_a_broken_connection_to_the_pool() {
    // One connection: every call and every check gets the same one back.
    let env = env(1).await;
    let pid = env.assert_pool_clean().await;
    let calls = AtomicU32::new(0);

    let result = insert_items(&env.pool, vec![7], true, &calls).await;
    assert!(matches!(result, Err(AppError::InsufficientFunds)));
    assert_eq!(env.assert_pool_clean().await, pid);

    let result = insert_items(&env.pool, vec![8, 1], false, &calls).await;
    assert!(matches!(result, Err(AppError::Db(_))));
    assert_eq!(env.assert_pool_clean().await, pid);

    let result = swallow_a_failure(&env.pool, &calls).await;
    assert!(matches!(
        result,
        Err(AppError::Idem(idem::Error::RolledBack))
    ));
    assert_eq!(env.assert_pool_clean().await, pid);

    let result = always_stale(&env.pool).await;
    assert!(is_exhausted(&result, RetryCause::Stale), "{result:?}");
    assert_eq!(env.assert_pool_clean().await, pid);

    let result = violate_at_commit(&env.pool).await;
    match &result {
        Err(AppError::Idem(idem::Error::Commit(DieselError::DatabaseError(
            DatabaseErrorKind::UniqueViolation,
            _,
        )))) => {}
        other => panic!("expected a failed COMMIT, got {other:?}"),
    }
    assert_eq!(env.assert_pool_clean().await, pid);

    let holder = side_connection(env.db.url()).await;
    holder
        .batch_execute("BEGIN; SELECT id FROM items WHERE id = 1 FOR UPDATE")
        .await
        .unwrap();
    let result = nowait(&env.pool, &calls).await;
    assert!(matches!(result, Err(AppError::Db(_))));
    holder.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(env.assert_pool_clean().await, pid);

    assert_eq!(
        env.scalar_i64("SELECT count(*) FROM items").await
            + env.scalar_i64("SELECT count(*) FROM deferred_unique").await,
        1,
        "nothing was committed"
    );
}
