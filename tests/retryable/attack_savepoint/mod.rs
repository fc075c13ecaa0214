//! Hostile tests of `Error::SavepointOpen`: bodies that leave savepoints
//! open in every shape found, then touch them by hand, fail, panic or end
//! the transaction themselves. Every effect is counted in the database on a
//! side connection, and `pg_stat_activity` is read for a session left idle
//! in a transaction (which would hold the attempt's row locks).

use super::*;
use diesel_async::{AnsiTransactionManager, TransactionManager};

mod replays;

/// Items `ids` (an SQL list) that committed.
async fn items_in(env: &Env, ids: &str) -> i64 {
    env.scalar_i64(&format!("SELECT count(*) FROM items WHERE id IN ({ids})"))
        .await
}

/// No backend of the test's database stays idle inside a transaction: a
/// closed connection's backend goes within moments, one returned to the
/// pool in a transaction stays.
pub(super) async fn no_session_left_in_a_transaction(env: &Env, what: &str) {
    idem_testing::stats::no_session_idle_in_transaction(&env.client, Duration::from_secs(3))
        .await
        .unwrap_or_else(|e| panic!("{what}: after the call, {e}"));
}

fn savepoint_open(result: &Result<(), AppError>) -> bool {
    matches!(result, Err(AppError::Idem(idem::Error::SavepointOpen)))
}

/// Takes the row lock of counter 3, opens a savepoint through diesel-async,
/// writes item `id` in it (and `id + 1`, .. in each deeper one), then runs `by_hand` (SQL of its own) and
/// returns `Ok`.
#[retryable(max = 4, deadline_ms = 5000)]
async fn open_then_by_hand(
    conn: &mut AsyncPgConnection,
    id: i64,
    depth: u32,
    by_hand: &str,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    bump_counter_3_in(conn).await?;
    for level in 0..depth {
        AnsiTransactionManager::begin_transaction(conn).await?;
        insert_item(conn, id + i64::from(level)).await?;
    }
    if !by_hand.is_empty() {
        conn.batch_execute(by_hand).await?;
    }
    Ok(())
}

/// Updates counter 3 once: a call that must not wait for a lock some
/// earlier call left behind.
#[retryable(max = 4, deadline_ms = 3000)]
async fn bump_counter_3(conn: &mut AsyncPgConnection, calls: &AtomicU32) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    bump_counter_3_in(conn).await?;
    Ok(())
}

/// A pool of two with both connections made and idle.
async fn warm_pool_of_two() -> Env {
    let env = env(2).await;
    let a = env.pool.get().await.unwrap();
    let b = env.pool.get().await.unwrap();
    drop((a, b));
    env
}

/// The row lock an attempt took is gone: a later call on the pool's other
/// connection updates the row at its first attempt.
async fn lock_released(env: &Env, what: &str) {
    let calls = AtomicU32::new(0);
    let started = Instant::now();
    let before = env.counter(3).await.0;
    bump_counter_3(&env.pool, &calls)
        .await
        .unwrap_or_else(|e| panic!("{what}: the later call failed: {e:?}"));
    assert_eq!(
        count(&calls),
        1,
        "{what}: the later call waited on a lock left behind ({:?})",
        started.elapsed()
    );
    assert_eq!(env.counter(3).await.0, before + 1, "{what}");
}

/// Savepoints 1, 2 and 3 deep left open: nothing commits, one attempt, and
/// the connection leaves with its transaction and its lock.
#[tokio::test]
async fn attack_savepoints_two_and_three_deep_left_open() {
    for depth in 1..=3u32 {
        let env = warm_pool_of_two().await;
        let calls = AtomicU32::new(0);
        let id = 1000 + 10 * i64::from(depth);
        let result = open_then_by_hand(&env.pool, id, depth, "", &calls).await;
        assert!(savepoint_open(&result), "depth {depth}: {result:?}");
        assert_eq!(count(&calls), 1, "depth {depth}: not replayed");
        assert_eq!(
            items_in(&env, &format!("{id}, {}, {}", id + 1, id + 2)).await,
            0,
            "depth {depth}"
        );
        assert_eq!(env.counter(3).await.0, 0, "depth {depth}");
        no_session_left_in_a_transaction(&env, &format!("depth {depth}")).await;
        lock_released(&env, &format!("depth {depth}")).await;
        env.assert_pool_clean().await;
    }
}

/// The savepoint left open is rolled back to by hand (it still exists, and
/// diesel-async still counts it): nothing commits.
#[tokio::test]
async fn attack_open_savepoint_rolled_back_to_by_hand() {
    let env = warm_pool_of_two().await;
    let by_hand = "ROLLBACK TO SAVEPOINT diesel_savepoint_1";
    refused_whole_by_hand(&env, 1100, 1, by_hand, "1100", "rolled back to by hand").await;
}

/// The savepoint left open is released by hand, so diesel-async's
/// `RELEASE SAVEPOINT` in place of `COMMIT` fails (no such savepoint) and
/// aborts the transaction: nothing commits, and the connection must not go
/// back to the pool in that aborted transaction ("nothing returns to the
/// pool in a transaction"; the server released its locks at the error, but
/// behind a transaction pooler the session stays pinned to its server
/// connection until the next checkout closes it).
#[tokio::test]
async fn attack_open_savepoint_released_by_hand() {
    let env = warm_pool_of_two().await;
    let by_hand = "RELEASE SAVEPOINT diesel_savepoint_1";
    refused_whole_by_hand(&env, 1200, 1, by_hand, "1200", "released by hand").await;
}

/// Three deep, and the outermost of the body's savepoints released by hand
/// (which releases the two inside it): the same failing `RELEASE`.
#[tokio::test]
async fn attack_three_deep_outermost_released_by_hand() {
    let env = warm_pool_of_two().await;
    let by_hand = "RELEASE SAVEPOINT diesel_savepoint_1";
    let ids = "1300, 1301, 1302";
    refused_whole_by_hand(&env, 1300, 3, by_hand, ids, "three deep, released by hand").await;
}

/// [`open_then_by_hand`] (`depth` savepoints from item `id` on, then
/// `by_hand`) answers `SavepointOpen` after one attempt: none of the items
/// `ids` commits, nor its update of counter 3; no session is left in a
/// transaction, the row lock is gone, and the pool is clean.
async fn refused_whole_by_hand(
    env: &Env,
    id: i64,
    depth: u32,
    by_hand: &str,
    ids: &str,
    what: &str,
) {
    let calls = AtomicU32::new(0);
    let result = open_then_by_hand(&env.pool, id, depth, by_hand, &calls).await;
    assert!(savepoint_open(&result), "{what}: {result:?}");
    assert_eq!(count(&calls), 1, "{what}");
    assert_eq!(items_in(env, ids).await, 0, "{what}");
    assert_eq!(env.counter(3).await.0, 0, "{what}");
    no_session_left_in_a_transaction(env, &format!("{what}: {result:?}")).await;
    lock_released(env, what).await;
    env.assert_pool_clean().await;
}

/// The same through the closure form, on a pool of one: the next call must
/// get a connection that is not in an aborted transaction.
#[tokio::test]
async fn attack_closure_form_open_savepoint_released_by_hand() {
    let env = env(1).await;
    let result: Result<(), AppError> = retry(&env.pool, RetryPolicy::new(), "release", |conn| {
        async move {
            insert_item(conn, 1400).await?;
            AnsiTransactionManager::begin_transaction(conn).await?;
            insert_item(conn, 1401).await?;
            conn.batch_execute("RELEASE SAVEPOINT diesel_savepoint_1")
                .await?;
            Ok(())
        }
        .scope_boxed()
    })
    .await;
    assert!(savepoint_open(&result), "{result:?}");
    assert_eq!(items_in(&env, "1400, 1401").await, 0);
    no_session_left_in_a_transaction(&env, &format!("closure form: {result:?}")).await;
    env.assert_pool_clean().await;
}

/// The savepoint left open, then `COMMIT` by hand: what was written before
/// it committed, and the call says so.
#[tokio::test]
async fn attack_open_savepoint_then_commit_by_hand() {
    let env = warm_pool_of_two().await;
    let calls = AtomicU32::new(0);
    let result = open_then_by_hand(&env.pool, 1500, 2, "COMMIT", &calls).await;
    assert!(
        matches!(
            &result,
            Err(AppError::Idem(idem::Error::TransactionEnded {
                committed: true
            }))
        ),
        "{result:?}"
    );
    assert_eq!(count(&calls), 1, "never replayed");
    assert_eq!(
        items_in(&env, "1500, 1501").await,
        2,
        "both levels committed"
    );
    assert_eq!(env.counter(3).await.0, 1, "so did the update before them");
    no_session_left_in_a_transaction(&env, "commit by hand").await;
    env.assert_pool_clean().await;
}

/// One savepoint, a write in it, `COMMIT` by hand: both the write before
/// the savepoint and the one inside it committed.
#[retryable(max = 4, deadline_ms = 5000)]
async fn open_write_commit(
    conn: &mut AsyncPgConnection,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    insert_item(conn, 1600).await?;
    AnsiTransactionManager::begin_transaction(conn).await?;
    insert_item(conn, 1601).await?;
    conn.batch_execute("COMMIT").await?;
    Ok(())
}

#[tokio::test]
async fn attack_open_savepoint_write_then_commit_by_hand() {
    let env = env(1).await;
    let calls = AtomicU32::new(0);
    let result = open_write_commit(&env.pool, &calls).await;
    assert!(
        matches!(
            &result,
            Err(AppError::Idem(idem::Error::TransactionEnded {
                committed: true
            }))
        ),
        "{result:?}"
    );
    assert_eq!(count(&calls), 1);
    assert_eq!(items_in(&env, "1600, 1601").await, 2, "both committed");
    no_session_left_in_a_transaction(&env, "commit by hand").await;
    env.assert_pool_clean().await;
}

/// `ROLLBACK` by hand with a savepoint open (or not), then a write that
/// would run outside any transaction (autocommit) and commit at once. It
/// never goes out: the wire refuses what a body sends after ending idem's
/// transaction (before that guard it committed, and the call said so).
/// Nothing is committed, and the call says that.
#[retryable(max = 4, deadline_ms = 5000)]
async fn rollback_then_autocommit(
    conn: &mut AsyncPgConnection,
    savepoint: bool,
    id: i64,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    insert_item(conn, id).await?;
    if savepoint {
        AnsiTransactionManager::begin_transaction(conn).await?;
    }
    conn.batch_execute("ROLLBACK").await?;
    insert_item(conn, id + 1).await?;
    Ok(())
}

#[tokio::test]
async fn attack_rollback_by_hand_then_autocommit_write() {
    let env = env(1).await;
    let mut seen = Vec::new();
    for (savepoint, id) in [(true, 1700), (false, 1710)] {
        let calls = AtomicU32::new(0);
        let result = rollback_then_autocommit(&env.pool, savepoint, id, &calls).await;
        let committed = items_in(&env, &format!("{id}, {}", id + 1)).await;
        assert_eq!(
            committed, 0,
            "savepoint {savepoint}: the write after the body's ROLLBACK"
        );
        assert_eq!(count(&calls), 1, "never replayed");
        no_session_left_in_a_transaction(&env, "rollback by hand").await;
        seen.push((savepoint, format!("{result:?}")));
    }
    env.assert_pool_clean().await;
    for (savepoint, result) in &seen {
        assert_eq!(
            result, "Err(Idem(TransactionEnded { committed: false }))",
            "savepoint {savepoint}: nothing committed, the call says {result} (all: {seen:?})"
        );
    }
}
