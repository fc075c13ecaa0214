//! Lost connections (before COMMIT, during COMMIT) and cancelled calls.

use super::*;

// ---------------------------------------------------------------------------
// Lost connections: before COMMIT (replayed), during COMMIT (unknown)
// ---------------------------------------------------------------------------

#[retryable(max = 4, deadline_ms = 60000)]
async fn insert_then_sleep(
    conn: &mut AsyncPgConnection,
    pids: &Mutex<Vec<i32>>,
) -> Result<u32, AppError> {
    let attempt = attempt_no();
    let pid = backend_pid(conn).await?;
    pids.lock().unwrap().push(pid);
    insert_item(conn, 100 + i64::from(attempt)).await?;
    if attempt == 1 {
        diesel::sql_query("SELECT pg_sleep(30)")
            .execute(conn)
            .await?;
    }
    Ok(attempt)
}

async fn first_pid(pids: &Mutex<Vec<i32>>) -> i32 {
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let first = pids.lock().unwrap().iter().next().copied();
        if let Some(pid) = first {
            return pid;
        }
        assert!(Instant::now() < until, "the body never ran");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_terminated_backend_is_replayed_on_a_fresh_connection() {
    let env = env(4).await;
    let pids = Mutex::new(Vec::new());
    let (result, ()) = tokio::join!(insert_then_sleep(&env.pool, &pids), async {
        env.terminate_when_sleeping(first_pid(&pids).await).await
    });
    assert_eq!(result.unwrap(), 2);
    let pids = pids.into_inner().unwrap();
    assert_eq!(pids.len(), 2);
    assert_ne!(pids[0], pids[1], "the replay ran on another backend");
    assert_eq!(
        env.scalar_i64("SELECT count(*) FROM items WHERE id > 100")
            .await,
        1
    );
    assert_eq!(
        env.scalar_i64("SELECT id FROM items WHERE id > 100").await,
        102,
        "only the second attempt committed"
    );
    let pid = env.assert_pool_clean().await;
    assert_ne!(pid, pids[0], "the dead connection went back to the pool");
}

/// Loses its connection mid-statement on its first attempt, ignores that,
/// and fails with an error of its own: the ROLLBACK then fails too, and must
/// not replace anything. The dead transaction is replayed (what failed on the
/// connection decides, not the error the body chose), and the replay's own
/// answer is returned.
#[retryable(max = 4, deadline_ms = 60000)]
async fn refuse_after_losing_the_connection(
    conn: &mut AsyncPgConnection,
    pids: &Mutex<Vec<i32>>,
) -> Result<(), AppError> {
    let pid = backend_pid(conn).await?;
    let first = {
        let mut pids = pids.lock().unwrap();
        pids.push(pid);
        pids.len() == 1
    };
    if first {
        let lost = diesel::sql_query("SELECT pg_sleep(30)").execute(conn).await;
        assert_eq!(
            lost.unwrap_err().transient(),
            Some(RetryCause::ConnectionLost)
        );
    }
    Err(AppError::InsufficientFunds)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failing_rollback_never_hides_the_original_error() {
    let env = env(4).await;
    let pids = Mutex::new(Vec::new());
    let (result, ()) = tokio::join!(
        refuse_after_losing_the_connection(&env.pool, &pids),
        async { env.terminate_when_sleeping(first_pid(&pids).await).await }
    );
    assert!(
        matches!(result, Err(AppError::InsufficientFunds)),
        "{result:?}"
    );
    let pids = pids.into_inner().unwrap();
    assert_eq!(pids.len(), 2, "replayed once, on a fresh connection");
    assert_ne!(pids[0], pids[1]);
    let pid = env.assert_pool_clean().await;
    assert_ne!(pid, pids[0], "the dead connection went back to the pool");
}

#[retryable(max = 4, deadline_ms = 60000)]
async fn insert_slow_commit(
    conn: &mut AsyncPgConnection,
    pids: &Mutex<Vec<i32>>,
) -> Result<(), AppError> {
    let pid = backend_pid(conn).await?;
    pids.lock().unwrap().push(pid);
    diesel::sql_query("INSERT INTO slow_commit VALUES (1)")
        .execute(conn)
        .await?;
    Ok(())
}

#[retryable(max = 4, deadline_ms = 60000, commit_timeout_ms = 300)]
async fn insert_slow_commit_with_timeout(
    conn: &mut AsyncPgConnection,
    pids: &Mutex<Vec<i32>>,
) -> Result<(), AppError> {
    let pid = backend_pid(conn).await?;
    pids.lock().unwrap().push(pid);
    diesel::sql_query("INSERT INTO slow_commit VALUES (2)")
        .execute(conn)
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backend_terminated_during_commit_gives_commit_unknown() {
    let env = env(4).await;
    let pids = Mutex::new(Vec::new());
    // The body returns at once; the backend then sleeps in the deferred
    // trigger, inside COMMIT, where it is terminated.
    let (result, ()) = tokio::join!(insert_slow_commit(&env.pool, &pids), async {
        env.terminate_when_sleeping(first_pid(&pids).await).await
    });
    assert!(
        matches!(
            result,
            Err(AppError::Idem(idem::Error::CommitUnknown {
                attempts: 1,
                ..
            }))
        ),
        "{result:?}"
    );
    assert_eq!(pids.lock().unwrap().len(), 1, "never replayed");
    assert_eq!(env.scalar_i64("SELECT count(*) FROM slow_commit").await, 0);
    env.assert_pool_clean().await;

    // A COMMIT that gets no answer in time is unknown too.
    let pids = Mutex::new(Vec::new());
    let started = Instant::now();
    let result = insert_slow_commit_with_timeout(&env.pool, &pids).await;
    assert!(
        matches!(
            result,
            Err(AppError::Idem(idem::Error::CommitUnknown {
                attempts: 1,
                ..
            }))
        ),
        "{result:?}"
    );
    // Its own timeout, not twice it: idem's `COMMIT` went out (the seal,
    // up once it did, holds nothing back to wait for).
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(300), "{took:?}");
    assert!(took < Duration::from_millis(600), "{took:?}");
    assert_eq!(pids.lock().unwrap().len(), 1, "never replayed");
    env.assert_pool_clean().await;
}

// ---------------------------------------------------------------------------
// Cancellation
// ---------------------------------------------------------------------------

#[retryable(max = 4, deadline_ms = 60000)]
async fn hold_a_row_lock(
    conn: &mut AsyncPgConnection,
    pids: &Mutex<Vec<i32>>,
    sleep_on_server: bool,
) -> Result<(), AppError> {
    let pid = backend_pid(conn).await?;
    diesel::sql_query("UPDATE accounts SET balance = balance + 1 WHERE id = 1")
        .execute(conn)
        .await?;
    pids.lock().unwrap().push(pid);
    if sleep_on_server {
        diesel::sql_query("SELECT pg_sleep(60)")
            .execute(conn)
            .await?;
    } else {
        tokio::time::sleep(Duration::from_secs(60)).await;
    }
    Ok(())
}

async fn cancel_mid_attempt(sleep_on_server: bool) {
    let env = env(2).await;
    let pids = Mutex::new(Vec::new());
    // Drop the call once its body holds the row lock and sleeps.
    let holding = async {
        let pid = first_pid(&pids).await;
        let state = if sleep_on_server {
            "wait_event = 'PgSleep'"
        } else {
            "state = 'idle in transaction'"
        };
        env.wait_for_backend(pid, state).await;
        pid
    };
    let pid = tokio::select! {
        result = hold_a_row_lock(&env.pool, &pids, sleep_on_server) => panic!("the call returned {result:?}"),
        pid = holding => pid,
    };

    // The backend goes away, and its transaction and row lock with it.
    env.wait_for_backend_to_exit(pid).await;
    assert_eq!(env.idle_in_transaction().await, 0);
    env.client
        .batch_execute(
            "SET lock_timeout = '1s'; UPDATE accounts SET balance = balance + 10 WHERE id = 1",
        )
        .await
        .expect("the row lock was released");
    assert_eq!(
        env.scalar_i64("SELECT balance FROM accounts WHERE id = 1")
            .await,
        10,
        "the cancelled attempt did not commit"
    );
    let status = env.pool.status();
    assert_eq!(
        (status.size, status.available),
        (0, 0),
        "the cancelled attempt's connection was closed, not pooled"
    );
    env.assert_pool_clean().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dropping_the_future_while_the_body_awaits_closes_the_transaction() {
    cancel_mid_attempt(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dropping_the_future_while_a_statement_runs_closes_the_transaction() {
    cancel_mid_attempt(true).await;
}

// ---------------------------------------------------------------------------
// A swapped connection committed by hand (moved from attack_session34.rs)
// ---------------------------------------------------------------------------

/// Writes item `id` on idem's connection, swaps it out for one of its own,
/// commits idem's transaction by hand on the connection taken away, and
/// returns `Ok`.
#[retryable(max = 3, deadline_ms = 5000)]
async fn swaps_then_commits_by_hand(
    conn: &mut AsyncPgConnection,
    url: &str,
    id: i64,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    insert_item(conn, id).await?;
    let mut taken = AsyncPgConnection::establish(url).await.expect("connect");
    std::mem::swap(conn, &mut taken);
    let _ = taken.batch_execute("COMMIT").await;
    Ok(())
}

/// A body that both swaps and commits idem's transaction by hand on the
/// connection it took away: never `Ok`, never replayed; the item it
/// committed by hand is there (idem cannot call it back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_swap_then_a_commit_by_hand_is_never_ok() {
    let env = env(1).await;
    let calls = AtomicU32::new(0);
    let r = swaps_then_commits_by_hand(&env.pool, env.db.url(), 9500, &calls).await;
    let items = items_from(&env, 9500).await;
    let replaced = matches!(r, Err(AppError::Idem(idem::Error::ConnectionReplaced)));
    assert!(replaced && count(&calls) == 1, "{r:?}");
    assert_eq!(items, [9500], "committed by hand, once");
    super::attack_seal::pool_serves(&env, "swap and commit").await;
}
