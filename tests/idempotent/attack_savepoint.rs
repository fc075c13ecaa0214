//! Hostile tests of `Error::SavepointOpen` under `#[idempotent]`, local and
//! external mode: savepoints left open at several depths, touched by hand,
//! under a lost race, a final error, a concurrent duplicate, a statement
//! still running. Effects and records are counted in the database, and
//! `pg_stat_activity` is read for a session left idle in a transaction.

use super::attack::healthy;
use super::attack_ext::records_of;
use super::*;
use diesel_async::{AnsiTransactionManager, TransactionManager};

/// No backend of the test's database stays idle inside a transaction.
pub(super) async fn no_session_left_in_a_transaction(env: &Env, what: &str) {
    idem_testing::stats::no_session_idle_in_transaction(&env.client, Duration::from_secs(3))
        .await
        .unwrap_or_else(|e| panic!("{what}: after the call, {e}"));
}

/// Local mode: writes an effect, then opens `depth` savepoints (an effect
/// in each) and leaves them open, then runs `by_hand`. `depth` and
/// `by_hand` are not in the fingerprint: a repeat without them is the same
/// request.
#[idempotent(key = key, scope = none, fingerprint(tag))]
#[retryable(max = 3, deadline_ms = 10000)]
async fn local_open(
    conn: &mut AsyncPgConnection,
    key: &str,
    tag: &str,
    depth: u32,
    by_hand: &str,
    runs: &AtomicU32,
) -> Result<i64, AppError> {
    runs.fetch_add(1, Ordering::SeqCst);
    insert_effect(conn, tag, 0).await?;
    for level in 0..depth {
        AnsiTransactionManager::begin_transaction(conn).await?;
        insert_effect(conn, tag, i64::from(level) + 1).await?;
    }
    if !by_hand.is_empty() {
        conn.batch_execute(by_hand).await?;
    }
    Ok(7)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_savepoint_local_open_at_depths_then_the_same_key_runs_once() {
    let env = env(1).await;
    for depth in 1..=3u32 {
        let key = format!("sp-depth-{depth}");
        let tag = format!("sp-depth-{depth}");
        let runs = AtomicU32::new(0);
        let r = local_open(&env.pool, &key, &tag, depth, "", &runs).await;
        assert!(matches_idem(&r, "SavepointOpen"), "depth {depth}: {r:?}");
        assert_eq!(calls(&runs), 1, "depth {depth}: not replayed");
        assert_eq!(env.effects(&tag).await, 0, "depth {depth}");
        assert_eq!(records_of(&env, &key).await, 0, "depth {depth}: key free");
        no_session_left_in_a_transaction(&env, "local open").await;
        // The same key again, the body now sound: it runs once, then replays.
        let r = local_open(&env.pool, &key, &tag, 0, "", &runs).await;
        assert!(matches!(&r, Ok(v) if !v.replayed && v.value == 7), "{r:?}");
        let again = local_open(&env.pool, &key, &tag, depth, "", &runs).await;
        assert!(
            matches!(&again, Ok(v) if v.replayed && v.value == 7),
            "{again:?}"
        );
        assert_eq!(calls(&runs), 2, "depth {depth}: the replay ran no body");
        assert_eq!(env.effects(&tag).await, 1, "depth {depth}: one effect");
        assert_eq!(records_of(&env, &key).await, 1);
    }
    healthy(&env, &env.pool, "sp-depth-after", 2).await;
}

/// The savepoint left open is then released or rolled back to by hand:
/// never `Ok` unless committed, nothing commits, and no session is left in
/// a transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_savepoint_local_open_then_touched_by_hand() {
    let env = env(1).await;
    for (i, (depth, by_hand)) in [
        (1, "RELEASE SAVEPOINT diesel_savepoint_1"),
        (1, "ROLLBACK TO SAVEPOINT diesel_savepoint_1"),
        (3, "RELEASE SAVEPOINT diesel_savepoint_1"),
        (3, "ROLLBACK TO SAVEPOINT diesel_savepoint_1"),
    ]
    .into_iter()
    .enumerate()
    {
        let key = format!("sp-hand-{i}");
        let runs = AtomicU32::new(0);
        let r = local_open(&env.pool, &key, &key, depth, by_hand, &runs).await;
        let (effects, records) = (env.effects(&key).await, records_of(&env, &key).await);
        match &r {
            Ok(v) => assert_eq!((effects, records), (1 + i64::from(depth), 1), "{v:?}"),
            Err(_) => assert_eq!((effects, records), (0, 0), "{by_hand}: {r:?}"),
        }
        assert!(r.is_err(), "{by_hand} at depth {depth}: {r:?}");
        assert_eq!(calls(&runs), 1, "{by_hand}: not replayed");
        no_session_left_in_a_transaction(&env, by_hand).await;
        // The key is free: a sound repeat runs once.
        let again = local_open(&env.pool, &key, &key, 0, "", &runs).await;
        assert!(matches!(&again, Ok(v) if !v.replayed), "{again:?}");
        assert_eq!(env.effects(&key).await, 1);
    }
    healthy(&env, &env.pool, "sp-hand-after", 2).await;
}

/// First attempt: a savepoint open and a lost race (`Stale`, by
/// `lost_race()`); the replay, on a pool of one, commits once, with its
/// record.
#[idempotent(key = key, scope = none, fingerprint(key))]
#[retryable(max = 3, deadline_ms = 10000)]
async fn stale_with_savepoint(
    conn: &mut AsyncPgConnection,
    key: &str,
    runs: &AtomicU32,
) -> Result<i64, AppError> {
    let n = runs.fetch_add(1, Ordering::SeqCst);
    insert_effect(conn, "sp-stale", 1).await?;
    if n == 0 {
        AnsiTransactionManager::begin_transaction(conn).await?;
        AnsiTransactionManager::begin_transaction(conn).await?;
        insert_effect(conn, "sp-stale", 2).await?;
        idem::attempt::lost_race();
        return Err(AppError::Versioned(VersionedError::Stale {
            expected: 1,
            actual: 2,
        }));
    }
    Ok(i64::from(n))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_savepoint_local_stale_with_savepoints_open_replays_once() {
    let env = env(1).await;
    let runs = AtomicU32::new(0);
    let r = stale_with_savepoint(&env.pool, "sp-stale", &runs).await;
    assert!(matches!(&r, Ok(v) if !v.replayed && v.value == 1), "{r:?}");
    assert_eq!(calls(&runs), 2);
    assert_eq!(env.effects("sp-stale").await, 1, "committed exactly once");
    assert_eq!(records_of(&env, "sp-stale").await, 1);
    let again = stale_with_savepoint(&env.pool, "sp-stale", &runs).await;
    assert!(
        matches!(&again, Ok(v) if v.replayed && v.value == 1),
        "{again:?}"
    );
    assert_eq!(calls(&runs), 2);
    no_session_left_in_a_transaction(&env, "stale").await;
    healthy(&env, &env.pool, "sp-stale-after", 1).await;
}

/// A final error (a decline) returned with a savepoint open: stored under
/// the key without the body's writes, and replayed.
#[idempotent(key = key, scope = none, fingerprint(key))]
#[retryable(max = 3, deadline_ms = 10000)]
async fn declines_with_savepoint(
    conn: &mut AsyncPgConnection,
    key: &str,
    runs: &AtomicU32,
) -> Result<i64, AppError> {
    runs.fetch_add(1, Ordering::SeqCst);
    insert_effect(conn, "sp-decline", 1).await?;
    AnsiTransactionManager::begin_transaction(conn).await?;
    insert_effect(conn, "sp-decline", 2).await?;
    Err(AppError::Declined(Declined::InsufficientFunds {
        needed: 9,
    }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_savepoint_local_decline_with_savepoint_open() {
    let env = env(1).await;
    let runs = AtomicU32::new(0);
    for _ in 0..2 {
        let r = declines_with_savepoint(&env.pool, "sp-decline", &runs).await;
        assert!(
            matches!(
                &r,
                Err(AppError::Declined(Declined::InsufficientFunds {
                    needed: 9
                }))
            ),
            "{r:?}"
        );
    }
    assert_eq!(calls(&runs), 1, "the decline is replayed");
    assert_eq!(
        env.effects("sp-decline").await,
        0,
        "without the body's writes"
    );
    assert_eq!(records_of(&env, "sp-decline").await, 1);
    no_session_left_in_a_transaction(&env, "decline").await;
    healthy(&env, &env.pool, "sp-decline-after", 1).await;
}

/// The first call holds the key's advisory lock with a savepoint open and
/// sleeps; a duplicate waits on the lock. The first answers
/// `SavepointOpen`; the duplicate then runs the body once.
#[idempotent(key = key, scope = none, fingerprint(key))]
#[retryable(max = 3, deadline_ms = 20000)]
async fn slow_open(
    conn: &mut AsyncPgConnection,
    key: &str,
    leave_open: bool,
    runs: &AtomicU32,
) -> Result<i64, AppError> {
    runs.fetch_add(1, Ordering::SeqCst);
    insert_effect(conn, "sp-dup", i64::from(leave_open)).await?;
    if leave_open {
        AnsiTransactionManager::begin_transaction(conn).await?;
        insert_effect(conn, "sp-dup", 9).await?;
        diesel::sql_query("SELECT pg_sleep(0.5)")
            .execute(conn)
            .await?;
    }
    Ok(i64::from(leave_open))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_savepoint_local_concurrent_duplicate_behind_an_open_savepoint() {
    let env = Arc::new(env(2).await);
    let runs = Arc::new(AtomicU32::new(0));
    let first = {
        let (env, runs) = (env.clone(), runs.clone());
        tokio::spawn(async move { slow_open(&env.pool, "sp-dup", true, &runs).await })
    };
    // The first is in its body (it holds the key's lock) before the duplicate.
    let until = Instant::now() + Duration::from_secs(20);
    while calls(&runs) == 0 {
        assert!(Instant::now() < until, "the first call never ran");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let second = slow_open(&env.pool, "sp-dup", false, &runs).await;
    let first = first.await.unwrap();
    assert!(matches_idem(&first, "SavepointOpen"), "{first:?}");
    assert!(
        matches!(&second, Ok(v) if !v.replayed && v.value == 0),
        "{second:?}"
    );
    assert_eq!(calls(&runs), 2);
    assert_eq!(
        env.effects("sp-dup").await,
        1,
        "only the duplicate's effect"
    );
    assert_eq!(records_of(&env, "sp-dup").await, 1);
    no_session_left_in_a_transaction(&env, "duplicate").await;
}

/// A `conn.transaction(..)` timed out while its `pg_sleep` still runs at
/// the body's return, under a short deadline: never `Ok`, nothing
/// committed, the key free, nothing left running or in a transaction.
#[idempotent(key = key, scope = none, fingerprint(key))]
#[retryable(max = 2, deadline_ms = 400)]
async fn running_in_open_savepoint(
    conn: &mut AsyncPgConnection,
    key: &str,
    sleep: bool,
) -> Result<i64, AppError> {
    insert_effect(conn, "sp-running", 1).await?;
    if sleep {
        let _ = tokio::time::timeout(
            Duration::from_millis(30),
            conn.transaction::<_, AppError, _>(async |c| {
                insert_effect(c, "sp-running", 2).await?;
                diesel::sql_query("SELECT pg_sleep(5)").execute(c).await?;
                Ok(())
            }),
        )
        .await;
    }
    Ok(1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_savepoint_local_statement_running_in_open_savepoint() {
    let env = env(2).await;
    let started = Instant::now();
    let r = running_in_open_savepoint(&env.pool, "sp-running", true).await;
    assert!(r.is_err(), "never Ok: {r:?}");
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(env.effects("sp-running").await, 0, "{r:?}");
    assert_eq!(records_of(&env, "sp-running").await, 0, "{r:?}");
    no_session_left_in_a_transaction(&env, "running").await;
    let sleeping = env
        .scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND query LIKE '%pg_sleep(5)%' AND state = 'active' AND pid <> pg_backend_pid()",
        )
        .await;
    assert_eq!(sleeping, 0, "the abandoned statement was cancelled");
    let again = running_in_open_savepoint(&env.pool, "sp-running", false).await;
    assert!(matches!(&again, Ok(v) if !v.replayed), "{again:?}");
    assert_eq!(env.effects("sp-running").await, 1);
}

/// Local mode: the body marks its open savepoint as diesel's test
/// transaction (diesel-async then no longer counts the connection broken);
/// the wire still refuses the `RELEASE` in place of `COMMIT`.
#[idempotent(key = key, scope = none)]
#[retryable(max = 3, deadline_ms = 10000)]
async fn local_marked_as_test(conn: &mut AsyncPgConnection, key: &str) -> Result<i64, AppError> {
    insert_effect(conn, "sp-test-flag", 1).await?;
    AnsiTransactionManager::begin_transaction(conn).await?;
    insert_effect(conn, "sp-test-flag", 2).await?;
    AnsiTransactionManager::transaction_manager_status_mut(conn).set_test_transaction_flag();
    Ok(1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_savepoint_local_open_savepoint_marked_as_test() {
    let env = env(1).await;
    let r = local_marked_as_test(&env.pool, "sp-test-flag").await;
    let (effects, records) = (
        env.effects("sp-test-flag").await,
        records_of(&env, "sp-test-flag").await,
    );
    assert!(matches_idem(&r, "SavepointOpen"), "{r:?}");
    assert_eq!((effects, records), (0, 0));
    no_session_left_in_a_transaction(&env, "test flag").await;
    healthy(&env, &env.pool, "sp-test-flag-after", 1).await;
}

/// Local mode: `ROLLBACK` by hand with a savepoint open, then a write
/// that would run in autocommit. It never goes out (the wire refuses what a
/// body sends after ending idem's transaction; before that guard it was
/// committed, and the call said so): nothing is committed, and the call
/// says that.
#[idempotent(key = key, scope = none)]
#[retryable(max = 3, deadline_ms = 10000)]
async fn local_rollback_then_autocommit(
    conn: &mut AsyncPgConnection,
    key: &str,
) -> Result<i64, AppError> {
    insert_effect(conn, "sp-autocommit", 1).await?;
    AnsiTransactionManager::begin_transaction(conn).await?;
    conn.batch_execute("ROLLBACK").await?;
    insert_effect(conn, "sp-autocommit", 2).await?;
    Ok(1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_savepoint_local_rollback_then_autocommit_write() {
    let env = env(1).await;
    let r = local_rollback_then_autocommit(&env.pool, "sp-autocommit").await;
    assert_eq!(
        env.effects("sp-autocommit").await,
        0,
        "the write after the body's ROLLBACK"
    );
    assert_eq!(records_of(&env, "sp-autocommit").await, 0);
    assert!(
        matches!(
            &r,
            Err(AppError::Idem(idem::Error::TransactionEnded {
                committed: false
            }))
        ),
        "nothing committed, the call says {r:?}"
    );
    no_session_left_in_a_transaction(&env, "autocommit").await;
}

// ---------------------------------------------------------------------------
// External mode
// ---------------------------------------------------------------------------

/// Phase 3 with `depth` savepoints left open (an effect in each), then
/// `by_hand`; counts its runs (the outside call).
#[idempotent(key = key, operation = "sp.ext", fingerprint(key), mode = external, scope = none)]
#[retryable(max = 3, deadline_ms = 10000)]
async fn external_open(
    db: &mut Deferred<'_>,
    key: &str,
    depth: u32,
    by_hand: &str,
    runs: &AtomicU32,
) -> Result<String, AppError> {
    runs.fetch_add(1, Ordering::SeqCst);
    let conn = db.conn().await?;
    diesel::sql_query("UPDATE payments SET amount = amount + 1 WHERE id = 1")
        .execute(conn)
        .await?;
    insert_effect(conn, key, 0).await?;
    for level in 0..depth {
        AnsiTransactionManager::begin_transaction(conn).await?;
        insert_effect(conn, key, i64::from(level) + 1).await?;
    }
    if !by_hand.is_empty() {
        conn.batch_execute(by_hand).await?;
    }
    Ok("receipt".to_owned())
}

/// A plain transaction that updates the row every external call above
/// locks: it must not wait for a lock a failed call left behind.
#[retryable(max = 3, deadline_ms = 3000)]
async fn touch_payment(conn: &mut AsyncPgConnection, runs: &AtomicU32) -> Result<(), AppError> {
    runs.fetch_add(1, Ordering::SeqCst);
    diesel::sql_query("UPDATE payments SET amount = amount + 1000 WHERE id = 1")
        .execute(conn)
        .await?;
    Ok(())
}

async fn external_case(env: &Env, key: &str, depth: u32, by_hand: &str) {
    let what = format!("{key}: depth {depth}, {by_hand:?}");
    let runs = AtomicU32::new(0);
    let r = external_open(&env.pool, key, depth, by_hand, &runs).await;
    assert!(matches_idem(&r, "SavepointOpen"), "{what}: {r:?}");
    assert_eq!(calls(&runs), 1, "{what}: not replayed: {r:?}");
    assert_eq!(env.effects(key).await, 0, "{what}: {r:?}");
    // Held, as after any phase 3 that did not commit.
    let state = env.state(key).await;
    assert!(
        matches!(state.as_deref(), Some("unknown") | Some("in_progress")),
        "{what}: {state:?}"
    );
    no_session_left_in_a_transaction(env, &format!("{what}: {r:?}")).await;
    let again = external_open(&env.pool, key, 0, "", &runs).await;
    assert!(again.is_err(), "{what}: the key is held: {again:?}");
    assert_eq!(calls(&runs), 1, "{what}: the outside call is not repeated");
    assert_eq!(env.effects(key).await, 0, "{what}");
    // No lock of the failed call is left: a plain update of the row it
    // locked goes through at its first attempt.
    let touches = AtomicU32::new(0);
    touch_payment(&env.pool, &touches)
        .await
        .unwrap_or_else(|e| panic!("{what}: {e:?}"));
    assert_eq!(calls(&touches), 1, "{what}: waited on a lock left behind");
}

async fn external_env() -> Env {
    let env = env(2).await;
    env.client
        .batch_execute("INSERT INTO payments VALUES (1, 1, 0, 'CNY')")
        .await
        .unwrap();
    // Both connections made and idle.
    let a = env.pool.get().await.unwrap();
    let b = env.pool.get().await.unwrap();
    drop((a, b));
    env
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_savepoint_external_open_at_depths() {
    let env = external_env().await;
    for depth in 1..=3u32 {
        external_case(&env, &format!("sp-ext-depth-{depth}"), depth, "").await;
        external_case(
            &env,
            &format!("sp-ext-rollback-to-{depth}"),
            depth,
            "ROLLBACK TO SAVEPOINT diesel_savepoint_1",
        )
        .await;
    }
    assert_eq!(
        env.scalar("SELECT amount FROM payments WHERE id = 1").await,
        6000,
        "only the plain updates committed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_savepoint_external_open_then_released_by_hand() {
    let env = external_env().await;
    external_case(
        &env,
        "sp-ext-release",
        1,
        "RELEASE SAVEPOINT diesel_savepoint_1",
    )
    .await;
    external_case(
        &env,
        "sp-ext-release-3",
        3,
        "RELEASE SAVEPOINT diesel_savepoint_1",
    )
    .await;
}
