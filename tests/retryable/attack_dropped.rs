//! Hostile tests of the dropped-transaction-statement fix (18d32b1): bodies
//! that drop a future of diesel-async's transaction manager while its
//! statement is unanswered, at the top level (`COMMIT`, `ROLLBACK` sent by
//! `AnsiTransactionManager` itself) and at two savepoint depths, then
//! return `Ok`, a plain error or a replayable one. Every effect is counted
//! on a side connection; idem's answer is never trusted.
//!
//! The `found_` tests failed when written: the loop read how the
//! transaction ended while the answer to the body's own `COMMIT` was still
//! on its way, so an error the body returned next was replayed, stored as
//! the key's outcome or answered as is, with the `COMMIT`'s writes in the
//! database; and a `COMMIT` still unanswered at the commit timeout was
//! reported rolled back. The loop now waits for what the body sent to be
//! answered first (up to the commit timeout), and an unanswered request
//! that may commit counts as committed.

use super::attack_savepoint::no_session_left_in_a_transaction;
use super::*;
use diesel_async::{AnsiTransactionManager, TransactionManager};
use idem_testing::proxy::{Fault, Proxy};

/// A proxy in front of the test database's pool URL (PgBouncer's under
/// `IDEM_TEST_VIA=pgbouncer`), and a pool of one connection through it.
pub(super) async fn proxied(env: &Env) -> (Proxy, Pool) {
    let proxy = Proxy::start(env.db.pool_url()).await.unwrap();
    let pool = build_pool_with(
        proxy.url(),
        &PoolConfig {
            max_size: 1,
            wait_timeout: Duration::from_secs(10),
            pooler: test_pool::pooler(&env.db),
            ..Default::default()
        },
    )
    .expect("a pool");
    (proxy, pool)
}

/// Items `ids` (an SQL list) that committed.
pub(super) async fn items_in(env: &Env, ids: &str) -> i64 {
    env.scalar_i64(&format!("SELECT count(*) FROM items WHERE id IN ({ids})"))
        .await
}

/// Has diesel-async's manager send `COMMIT` (depth 1: idem's transaction)
/// with the proxy holding its answer `hold` (armed here, so that no
/// statement of idem's is the one held), and drops it after 50 ms.
async fn drop_manager_commit(conn: &mut AsyncPgConnection, proxy: &Proxy, hold: Duration) {
    proxy.arm("COMMIT\0", Fault::HoldAnswer(hold));
    let dropped = tokio::time::timeout(
        Duration::from_millis(50),
        AnsiTransactionManager::commit_transaction(conn),
    )
    .await;
    assert!(dropped.is_err(), "the held answer outlasts the timeout");
}

/// How a body ends after dropping its manager's `COMMIT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Then {
    Ok,
    OwnError,
    LostRace,
}

/// Writes item `id + attempt`, then (on the first attempt only) gives
/// diesel-async's own `commit_transaction` (depth 1: a `COMMIT`) 50 ms
/// while the proxy holds its answer, and ends as `then` says.
#[retryable(max = 4, deadline_ms = 5000)]
async fn commits_by_hand_then(
    conn: &mut AsyncPgConnection,
    id: i64,
    then: Then,
    proxy: &Proxy,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    let call = calls.fetch_add(1, Ordering::SeqCst) + 1;
    insert_item(conn, id + i64::from(call)).await?;
    if call == 1 {
        drop_manager_commit(conn, proxy, Duration::from_millis(400)).await;
        match then {
            Then::Ok => {}
            Then::OwnError => return Err(AppError::InsufficientFunds),
            Then::LostRace => return Err(lost_a_race()),
        }
    }
    Ok(())
}

/// Found, and fixed (see the module's doc). What was found:
/// A body that has diesel-async's manager send `COMMIT` (its future
/// dropped before the answer) and then returns a replayable error (a
/// version race it reports with `lost_race`) must get `TransactionEnded {
/// committed: true }` and never be replayed: "a body that runs `COMMIT` ..
/// itself gets `TransactionEnded`, never `Ok`, and is never replayed: what
/// it committed by hand would be written again". idem read the
/// wire's transaction marks at once on the error path (the `COMMIT`'s
/// answer is still in flight), finds no end, closes the connection as a
/// lost track of the depth and replays: the second attempt commits too, and
/// the call answers `Ok` with both attempts' writes in the database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_dropped_manager_commit_then_lost_race_is_replayed() {
    let env = env(1).await;
    let (proxy, pool) = proxied(&env).await;
    let calls = AtomicU32::new(0);
    let r = commits_by_hand_then(&pool, 700, Then::LostRace, &proxy, &calls).await;
    let committed = items_in(&env, "701, 702, 703, 704").await;
    no_session_left_in_a_transaction(&env, "lost race after a dropped COMMIT").await;
    assert!(
        matches!(
            r,
            Err(AppError::Idem(idem::Error::TransactionEnded {
                committed: true
            }))
        ) && count(&calls) == 1
            && committed == 1,
        "answered {r:?} after {} call(s), {committed} item(s) committed (item 701 by the \
         body's own COMMIT)",
        count(&calls)
    );
}

/// Found, and fixed (see the module's doc). What was found:
/// The same body returning an error of its own: the promise is
/// `TransactionEnded { committed: true }` (its own error is not the answer
/// once it ended the transaction). idem answered the body's error, which
/// reads as "nothing happened", while item 801 is committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_dropped_manager_commit_then_own_error_hides_the_commit() {
    let env = env(1).await;
    let (proxy, pool) = proxied(&env).await;
    let calls = AtomicU32::new(0);
    let r = commits_by_hand_then(&pool, 800, Then::OwnError, &proxy, &calls).await;
    let committed = items_in(&env, "801, 802").await;
    assert!(
        matches!(
            r,
            Err(AppError::Idem(idem::Error::TransactionEnded {
                committed: true
            }))
        ),
        "answered {r:?} after {} call(s), {committed} item(s) committed",
        count(&calls)
    );
}

/// The same body returning `Ok`, with the default `commit_timeout_ms`: idem
/// waits for the `COMMIT`'s answer and says `TransactionEnded { committed:
/// true }`, not replayed. Holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_manager_commit_then_ok_is_transaction_ended() {
    let env = env(1).await;
    let (proxy, pool) = proxied(&env).await;
    let calls = AtomicU32::new(0);
    let r = commits_by_hand_then(&pool, 900, Then::Ok, &proxy, &calls).await;
    assert!(
        matches!(
            r,
            Err(AppError::Idem(idem::Error::TransactionEnded {
                committed: true
            }))
        ),
        "{r:?}"
    );
    assert_eq!(count(&calls), 1);
    assert_eq!(items_in(&env, "901, 902").await, 1);
    no_session_left_in_a_transaction(&env, "Ok after a dropped COMMIT").await;
}

/// Writes item `id`, then has diesel-async's manager send `COMMIT` (its
/// future dropped after 50 ms, the answer held 1.5 s), then returns `Ok`;
/// `commit_timeout_ms` is 300.
#[retryable(max = 4, deadline_ms = 5000, commit_timeout_ms = 300)]
async fn commits_by_hand_short_timeout(
    conn: &mut AsyncPgConnection,
    id: i64,
    proxy: &Proxy,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    insert_item(conn, id).await?;
    drop_manager_commit(conn, proxy, Duration::from_millis(1500)).await;
    Ok(())
}

/// Found, and fixed (see the module's doc). What was found:
/// When the dropped `COMMIT`'s answer takes longer than
/// `commit_timeout_ms`, idem's settle wait gives up and answers
/// `Error::RolledBack` ("nothing was committed"), though the `COMMIT` ran
/// on the server and item 1001 is there. An unanswered request that may be
/// a `COMMIT` is an unknown outcome (`CommitUnknown`) or
/// `TransactionEnded { committed: true }` ("a request still unanswered
/// when the connection closes counts as committed"), never "rolled back".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_dropped_manager_commit_past_commit_timeout_answers_rolled_back() {
    let env = env(1).await;
    let (proxy, pool) = proxied(&env).await;
    let calls = AtomicU32::new(0);
    let r = commits_by_hand_short_timeout(&pool, 1001, &proxy, &calls).await;
    let committed = items_in(&env, "1001").await;
    let says_nothing_committed = matches!(
        r,
        Err(AppError::Idem(
            idem::Error::RolledBack
                | idem::Error::SavepointOpen
                | idem::Error::TransactionEnded { committed: false }
        ))
    );
    assert!(
        !(says_nothing_committed && committed == 1),
        "answered {r:?} (nothing committed) but item 1001 is committed"
    );
}

/// Writes item `id + 10 * attempt`, then a nested transaction that writes
/// the next item and, on the first attempt, fails with a real 40001; the
/// proxy holds its `ROLLBACK TO SAVEPOINT` past the body's 50 ms timeout,
/// and the body then returns an error of its own.
#[retryable(max = 4, deadline_ms = 5000)]
async fn inner_40001_rollback_dropped(
    conn: &mut AsyncPgConnection,
    id: i64,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    let call = calls.fetch_add(1, Ordering::SeqCst) + 1;
    let base = id + 10 * i64::from(call);
    insert_item(conn, base).await?;
    let inner = tokio::time::timeout(
        Duration::from_millis(50),
        conn.transaction::<_, AppError, _>(async |c| {
            insert_item(c, base + 1).await?;
            if call == 1 {
                fail_with(c, RetryCause::SerializationFailure).await?;
            }
            Ok(())
        }),
    )
    .await;
    match inner {
        Ok(done) => done,
        Err(_elapsed) => Err(AppError::InsufficientFunds),
    }
}

/// A serialization failure inside a savepoint whose `ROLLBACK TO` the body
/// dropped unanswered (held on the way or its answer held) is replayed,
/// and the replay is safe: the first attempt's connection is closed, so
/// none of its items commit; the second attempt's both do. Holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inner_serialization_failure_with_dropped_rollback_to_replays_safely() {
    let env = env(1).await;
    let (proxy, pool) = proxied(&env).await;
    let hold = Duration::from_millis(300);
    for (n, fault) in [Fault::HoldRequest(hold), Fault::HoldAnswer(hold)]
        .into_iter()
        .enumerate()
    {
        let id = 2000 + 100 * n as i64;
        proxy.arm("ROLLBACK TO SAVEPOINT", fault);
        let calls = AtomicU32::new(0);
        let r = inner_40001_rollback_dropped(&pool, id, &calls).await;
        assert!(r.is_ok(), "{fault:?}: {r:?}");
        assert_eq!(count(&calls), 2, "{fault:?}: replayed once");
        let first = items_in(&env, &format!("{}, {}", id + 10, id + 11)).await;
        let second = items_in(&env, &format!("{}, {}", id + 20, id + 21)).await;
        assert_eq!((first, second), (0, 2), "{fault:?}");
        no_session_left_in_a_transaction(&env, &format!("{fault:?}")).await;
    }
}

/// Writes item `id + 10 * attempt`, then on the first attempt has
/// diesel-async's manager open a savepoint (`SAVEPOINT`, held by the proxy)
/// and drops it after 50 ms, writes the next item, and reports a lost
/// version race.
#[retryable(max = 4, deadline_ms = 5000)]
async fn manager_begin_dropped_then_lost_race(
    conn: &mut AsyncPgConnection,
    id: i64,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    let call = calls.fetch_add(1, Ordering::SeqCst) + 1;
    let base = id + 10 * i64::from(call);
    insert_item(conn, base).await?;
    if call == 1 {
        let dropped = tokio::time::timeout(
            Duration::from_millis(50),
            AnsiTransactionManager::begin_transaction(conn),
        )
        .await;
        assert!(dropped.is_err(), "the held SAVEPOINT outlasts the timeout");
        insert_item(conn, base + 1).await?;
        return Err(lost_a_race());
    }
    Ok(())
}

/// A body that dropped diesel-async's own `begin_transaction` (a
/// `SAVEPOINT`) mid-flight and then reports a replayable failure is
/// replayed without a panic, and nothing of the first attempt commits.
/// Holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_manager_savepoint_then_lost_race_replays_safely() {
    let env = env(1).await;
    let (proxy, pool) = proxied(&env).await;
    let hold = Duration::from_millis(300);
    for (n, fault) in [Fault::HoldRequest(hold), Fault::HoldAnswer(hold)]
        .into_iter()
        .enumerate()
    {
        let id = 3000 + 100 * n as i64;
        proxy.arm("SAVEPOINT diesel_savepoint_1", fault);
        let calls = AtomicU32::new(0);
        let r = manager_begin_dropped_then_lost_race(&pool, id, &calls).await;
        assert!(r.is_ok(), "{fault:?}: {r:?}");
        assert_eq!(count(&calls), 2, "{fault:?}");
        let first = items_in(&env, &format!("{}, {}", id + 10, id + 11)).await;
        assert_eq!(first, 0, "{fault:?}: the first attempt committed nothing");
        assert_eq!(items_in(&env, &format!("{}", id + 20)).await, 1);
        no_session_left_in_a_transaction(&env, &format!("{fault:?}")).await;
    }
}

/// Writes item `id`, then an outer `conn.transaction` (item `id + 1`) that
/// gives an inner one (item `id + 2`) 50 ms while the proxy holds its
/// `SAVEPOINT diesel_savepoint_2`, and then ends the outer one as usual.
#[retryable(max = 4, deadline_ms = 5000)]
async fn drops_at_depth_two(
    conn: &mut AsyncPgConnection,
    id: i64,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    insert_item(conn, id).await?;
    conn.transaction::<_, AppError, _>(async |c| {
        insert_item(c, id + 1).await?;
        let inner = tokio::time::timeout(
            Duration::from_millis(50),
            c.transaction::<_, AppError, _>(async |c| {
                insert_item(c, id + 2).await?;
                Ok(())
            }),
        )
        .await;
        assert!(inner.is_err(), "the held SAVEPOINT outlasts the timeout");
        Ok(())
    })
    .await
}

/// Writes item `id` and commits.
#[retryable(max = 4, deadline_ms = 5000)]
async fn writes_one(conn: &mut AsyncPgConnection, id: i64) -> Result<(), AppError> {
    insert_item(conn, id).await?;
    Ok(())
}

/// A drop at the second depth: the body's own outer `conn.transaction`
/// then ends through the manager that lost track, which in a debug build
/// panics inside the body (diesel-async's `debug_assert`, before idem has
/// control). Whatever the call answers or however it unwinds, it is never
/// `Ok` without its items committed, nothing of it commits, no session is
/// left in a transaction, and the pool of one serves the next call. Holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_savepoint_at_depth_two_commits_nothing_and_pool_recovers() {
    let env = env(1).await;
    let (proxy, pool) = proxied(&env).await;
    let pool = Arc::new(pool);
    let hold = Duration::from_millis(300);
    for (n, fault) in [Fault::HoldRequest(hold), Fault::HoldAnswer(hold)]
        .into_iter()
        .enumerate()
    {
        let id = 4000 + 100 * n as i64;
        proxy.arm("SAVEPOINT diesel_savepoint_2", fault);
        let calls = Arc::new(AtomicU32::new(0));
        let call = {
            let (pool, calls) = (pool.clone(), calls.clone());
            tokio::spawn(async move { drops_at_depth_two(&pool, id, &calls).await })
        };
        let outcome = call.await;
        let ids = format!("{id}, {}, {}", id + 1, id + 2);
        let committed = items_in(&env, &ids).await;
        let answer = match &outcome {
            Ok(r) => format!("{r:?}"),
            Err(join) => format!("panicked: {}", join.is_panic()),
        };
        assert!(
            !matches!(outcome, Ok(Ok(()))) || committed == 3,
            "{fault:?}: Ok with {committed} of 3 items"
        );
        assert_eq!(committed, 0, "{fault:?}: {answer}");
        assert_eq!(count(&calls), 1, "{fault:?}: not replayed");
        no_session_left_in_a_transaction(&env, &format!("{fault:?}")).await;
        let r = writes_one(&pool, id + 50).await;
        assert!(r.is_ok(), "{fault:?}: next call {r:?}");
        assert_eq!(items_in(&env, &format!("{}", id + 50)).await, 1);
    }
}
