//! A body that drops a nested `conn.transaction(..)` while one of its
//! transaction statements (`SAVEPOINT`, `RELEASE SAVEPOINT`, `ROLLBACK TO
//! SAVEPOINT`) is unanswered: diesel-async's manager then no longer knows
//! how deep the transaction is. Found by an audit of the suite's timing:
//! idem's `COMMIT` or `ROLLBACK` went through that manager, which panicked
//! in a debug build ("Tried to execute a transaction SQL on transaction
//! manager that was previously cancled") and, in a release one, sent its
//! statement at the depth it believed. Now the call answers as for a
//! savepoint left open: nothing committed, the connection closed, not
//! replayed; or the body's own error, with nothing committed.

use super::attack_savepoint::no_session_left_in_a_transaction;
use super::*;
use idem_testing::proxy::{Fault, Proxy};

/// Writes item `id`, then gives a nested transaction (which writes item
/// `id + 1`, then commits, or fails when `inner_fails`) 50 ms, while the
/// proxy holds one of its statements 300 ms; then answers `Ok`, or
/// `InsufficientFunds` when `fails`.
#[retryable(max = 4, deadline_ms = 5000)]
async fn drops_a_savepoint_statement(
    conn: &mut AsyncPgConnection,
    id: i64,
    inner_fails: bool,
    fails: bool,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    insert_item(conn, id).await?;
    let inner = tokio::time::timeout(
        Duration::from_millis(50),
        conn.transaction::<_, AppError, _>(async |c| {
            insert_item(c, id + 1).await?;
            if inner_fails {
                return Err(AppError::InsufficientFunds);
            }
            Ok(())
        }),
    )
    .await;
    assert!(inner.is_err(), "the held statement outlasts the timeout");
    if fails {
        return Err(AppError::InsufficientFunds);
    }
    Ok(())
}

/// Writes item `id` and commits.
#[retryable(max = 4, deadline_ms = 5000)]
async fn writes(conn: &mut AsyncPgConnection, id: i64) -> Result<(), AppError> {
    insert_item(conn, id).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_savepoint_statement_dropped_unanswered_commits_nothing() {
    let env = env(1).await;
    let proxy = Proxy::start(env.db.url()).await.unwrap();
    let pool = pool_of_one(proxy.url());
    let hold = Duration::from_millis(300);
    let mut id = 600;
    // The first statement that contains the pattern: `SAVEPOINT` is the
    // nested transaction's first.
    for (statement, inner_fails) in [
        ("SAVEPOINT", false),
        ("RELEASE SAVEPOINT", false),
        ("ROLLBACK TO SAVEPOINT", true),
    ] {
        for fault in [Fault::HoldRequest(hold), Fault::HoldAnswer(hold)] {
            for fails in [false, true] {
                id += 10;
                let case = format!("{statement} ({fault:?}, body fails: {fails})");
                proxy.arm(statement, fault);
                let fired = proxy.fired();
                let calls = AtomicU32::new(0);
                let r = drops_a_savepoint_statement(&pool, id, inner_fails, fails, &calls).await;
                assert_eq!(proxy.fired(), fired + 1, "{case}: held");
                let expected = if fails {
                    matches!(r, Err(AppError::InsufficientFunds))
                } else {
                    matches!(r, Err(AppError::Idem(idem::Error::SavepointOpen)))
                };
                assert!(expected, "{case}: {r:?}");
                assert_eq!(count(&calls), 1, "{case}: not replayed");
                let committed = env
                    .scalar_i64(&format!(
                        "SELECT count(*) FROM items WHERE id IN ({id}, {})",
                        id + 1
                    ))
                    .await;
                assert_eq!(committed, 0, "{case}: nothing committed");
                no_session_left_in_a_transaction(&env, &case).await;
                // The pool's next connection is clean and commits.
                writes(&pool, id + 5).await.unwrap();
                assert_eq!(
                    env.scalar_i64(&format!("SELECT count(*) FROM items WHERE id = {}", id + 5))
                        .await,
                    1,
                    "{case}: the next call committed"
                );
            }
        }
    }
}
