//! Versioned writers on one row: at most k attempts for the k-th committer; `on_conflict = lock`.

use super::*;

// ---------------------------------------------------------------------------
// Versioned writers: the k-th committer needs at most k attempts
// ---------------------------------------------------------------------------

async fn increment(
    conn: &mut AsyncPgConnection,
    id: i64,
    barrier: Option<&Barrier>,
) -> Result<(i64, u32), AppError> {
    let attempt = attempt_no();
    let c = Counter::find(id).load(conn).await?;
    if let (1, Some(barrier)) = (attempt, barrier) {
        barrier.wait().await;
    }
    let c = Counter::update(id)
        .expect_version(c.version)
        .set(&SetN { n: c.n + 1 })
        .execute(conn)
        .await?;
    Ok((c.version, attempt))
}

#[retryable(max = 5, deadline_ms = 30000)]
async fn increment_max5(
    conn: &mut AsyncPgConnection,
    id: i64,
    barrier: Arc<Barrier>,
) -> Result<(i64, u32), AppError> {
    increment(conn, id, Some(&barrier)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_writers_with_five_attempts_all_commit() {
    let env = env(4).await;
    let barrier = Arc::new(Barrier::new(4));
    let tasks: Vec<_> = (0..4)
        .map(|_| {
            let (pool, barrier) = (env.pool.clone(), barrier.clone());
            tokio::spawn(async move { increment_max5(&pool, 1, barrier).await })
        })
        .collect();
    let mut committed = Vec::new();
    for task in tasks {
        committed.push(task.await.unwrap().expect("every writer commits"));
    }
    committed.sort();
    // The version a writer wrote is its place in the commit order.
    assert_eq!(
        committed.iter().map(|(v, _)| *v).collect::<Vec<_>>(),
        vec![1, 2, 3, 4]
    );
    for (k, attempts) in &committed {
        assert!(
            i64::from(*attempts) <= *k,
            "committer {k} needed {attempts} attempts: {committed:?}"
        );
    }
    assert_eq!(env.counter(1).await, (4, 4));
    env.assert_pool_clean().await;
}

#[retryable(max = 4, deadline_ms = 60000)]
async fn increment_max4(conn: &mut AsyncPgConnection, id: i64) -> Result<i64, AppError> {
    let c = Counter::find(id).load(conn).await?;
    // Widens the window between read and write, so that writers collide.
    diesel::sql_query("SELECT pg_sleep(0.002)")
        .execute(conn)
        .await?;
    let c = Counter::update(id)
        .expect_version(c.version)
        .set(&SetN { n: c.n + 1 })
        .execute(conn)
        .await?;
    Ok(c.version)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_writers_with_four_attempts_exhaust_or_commit() {
    let env = env(20).await;
    let tasks: Vec<_> = (0..50)
        .map(|_| {
            let pool = env.pool.clone();
            tokio::spawn(async move { increment_max4(&pool, 1).await })
        })
        .collect();
    let (mut ok, mut exhausted) = (0_i64, 0);
    for task in tasks {
        match task.await.unwrap() {
            Ok(_) => ok += 1,
            Err(AppError::Idem(idem::Error::Exhausted {
                attempts: 4,
                last_cause: RetryCause::Stale,
                ..
            })) => exhausted += 1,
            Err(other) => panic!("unexpected failure: {other:?}"),
        }
    }
    eprintln!("50 writers, 4 attempts each: {ok} committed, {exhausted} exhausted");
    assert_eq!(ok + exhausted, 50);
    assert!(ok >= 1 && exhausted >= 1, "ok {ok}, exhausted {exhausted}");
    assert_eq!(
        env.counter(1).await,
        (ok, ok),
        "one version per successful writer, nothing from the exhausted ones"
    );
    env.assert_pool_clean().await;
}

// ---------------------------------------------------------------------------
// on_conflict = lock
// ---------------------------------------------------------------------------

/// Whether this transaction holds the table lock that `SELECT .. FOR UPDATE`
/// takes (ROW SHARE); a plain SELECT takes ACCESS SHARE, an UPDATE ROW EXCLUSIVE.
async fn loaded_for_update(conn: &mut AsyncPgConnection) -> Result<bool, DieselError> {
    sql::<Bool>(
        "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = pg_backend_pid() \
         AND locktype = 'relation' AND relation = 'counters'::regclass AND mode = 'RowShareLock')",
    )
    .get_result(conn)
    .await
}

type AttemptLog = Mutex<Vec<(u32, bool)>>;

async fn increment_logged(
    conn: &mut AsyncPgConnection,
    id: i64,
    barrier: &Barrier,
    log: &AttemptLog,
) -> Result<u32, AppError> {
    let attempt = attempt_no();
    let c = Counter::find(id).load(conn).await?;
    let locked = loaded_for_update(conn).await?;
    log.lock().unwrap().push((attempt, locked));
    if attempt == 1 {
        barrier.wait().await;
    }
    diesel::sql_query("SELECT pg_sleep(0.002)")
        .execute(conn)
        .await?;
    Counter::update(id)
        .expect_version(c.version)
        .set(&SetN { n: c.n + 1 })
        .execute(conn)
        .await?;
    Ok(attempt)
}

#[retryable(max = 100, deadline_ms = 60000, on_conflict = lock)]
async fn increment_adaptive(
    conn: &mut AsyncPgConnection,
    id: i64,
    barrier: Arc<Barrier>,
    log: Arc<AttemptLog>,
) -> Result<u32, AppError> {
    increment_logged(conn, id, &barrier, &log).await
}

#[retryable(max = 100, deadline_ms = 60000)]
async fn increment_optimistic(
    conn: &mut AsyncPgConnection,
    id: i64,
    barrier: Arc<Barrier>,
    log: Arc<AttemptLog>,
) -> Result<u32, AppError> {
    increment_logged(conn, id, &barrier, &log).await
}

const HOT_WRITERS: usize = 20;

async fn hot_row(env: &Env, id: i64, adaptive: bool) -> Vec<(u32, bool)> {
    let barrier = Arc::new(Barrier::new(HOT_WRITERS));
    let log = Arc::new(AttemptLog::default());
    let tasks: Vec<_> = (0..HOT_WRITERS)
        .map(|_| {
            let (pool, barrier, log) = (env.pool.clone(), barrier.clone(), log.clone());
            tokio::spawn(async move {
                if adaptive {
                    increment_adaptive(&pool, id, barrier, log).await
                } else {
                    increment_optimistic(&pool, id, barrier, log).await
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap().expect("every writer commits");
    }
    assert_eq!(
        env.counter(id).await,
        (HOT_WRITERS as i64, HOT_WRITERS as i64)
    );
    Arc::try_unwrap(log).unwrap().into_inner().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_conflict_lock_stops_a_hot_row_from_burning_attempts() {
    let env = env(HOT_WRITERS).await;

    let adaptive = hot_row(&env, 1, true).await;
    let adaptive_wasted = adaptive.len() - HOT_WRITERS;
    // First attempts are optimistic; after a conflict every attempt locks,
    // and a locked attempt cannot lose: at most one wasted attempt per writer.
    assert!(
        adaptive.iter().all(|(a, locked)| *locked == (*a > 1)),
        "{adaptive:?}"
    );
    assert!(adaptive.iter().all(|(a, _)| *a <= 2), "{adaptive:?}");
    assert!(adaptive_wasted <= HOT_WRITERS, "{adaptive_wasted} wasted");

    // The row that lost version races is remembered: a later call locks it
    // from its first attempt, while a call without on_conflict = lock never does.
    let log = Arc::new(AttemptLog::default());
    let attempt = increment_adaptive(&env.pool, 1, Arc::new(Barrier::new(1)), log.clone()).await;
    assert_eq!(attempt.unwrap(), 1);
    assert_eq!(*log.lock().unwrap(), vec![(1, true)]);
    let log = Arc::new(AttemptLog::default());
    let attempt = increment_optimistic(&env.pool, 1, Arc::new(Barrier::new(1)), log.clone()).await;
    assert_eq!(attempt.unwrap(), 1);
    assert_eq!(*log.lock().unwrap(), vec![(1, false)]);
    assert_eq!(
        env.counter(1).await,
        (HOT_WRITERS as i64 + 2, HOT_WRITERS as i64 + 2)
    );

    let optimistic = hot_row(&env, 2, false).await;
    let optimistic_wasted = optimistic.len() - HOT_WRITERS;
    assert!(optimistic.iter().all(|(_, locked)| !locked));
    eprintln!("{HOT_WRITERS} writers on one row: wasted attempts adaptive {adaptive_wasted}, optimistic {optimistic_wasted}");
    assert!(optimistic_wasted >= adaptive_wasted);
    env.assert_pool_clean().await;
}

#[tokio::test]
async fn on_conflict_lock_never_locks_without_a_conflict() {
    let env = env(2).await;
    for _ in 0..5 {
        let log = Arc::new(AttemptLog::default());
        let attempt =
            increment_adaptive(&env.pool, 3, Arc::new(Barrier::new(1)), log.clone()).await;
        assert_eq!(attempt.unwrap(), 1);
        assert_eq!(*log.lock().unwrap(), vec![(1, false)]);
    }
    assert_eq!(env.counter(3).await, (5, 5));
}
