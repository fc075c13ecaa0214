//! A body that runs transaction control by hand (`COMMIT`, `ROLLBACK`,
//! `BEGIN`, `PREPARE TRANSACTION`): the loop sees it on the wire, never
//! reports it committed, and never replays what the body committed itself.

use std::sync::atomic::{AtomicU32, Ordering};

use diesel_async::{AsyncConnection, SimpleAsyncConnection};
use idem::retry::retry;
use idem::RetryPolicy;
use scoped_futures::ScopedFutureExt;

use super::{record_effect, AppError, Env};

/// What a body does after its first effect.
#[derive(Debug, Clone, Copy)]
enum ByHand {
    /// `ROLLBACK`, then `Ok`.
    Rollback,
    /// `COMMIT`, then a lost race on the first attempt (a replay would write
    /// the effect again).
    CommitThenLoseARace,
    /// `COMMIT AND CHAIN`, then a swallowed failure, then `Ok`.
    CommitAndChainThenSwallow,
    /// `ROLLBACK; BEGIN`, a second effect, then `Ok`.
    RollbackBeginThenWrite,
    /// A `PREPARE TRANSACTION` that fails (prepared transactions are off),
    /// swallowed, then `Ok`: the server ended the transaction.
    SwallowedPrepare,
    /// A `COMMIT` of its own that fails (a deferred unique check), swallowed,
    /// then `Ok`: its error arrives before the status that says the
    /// transaction is over.
    SwallowedFailedCommit,
}

async fn run(env: &Env, by_hand: ByHand) -> (Result<(), AppError>, u32) {
    let cell = format!("by_hand/{by_hand:?}");
    let runs = AtomicU32::new(0);
    let policy = RetryPolicy::new().max_attempts(3);
    let outcome = retry(&env.pool, policy, "by_hand", |conn| {
        let (cell, runs) = (&cell, &runs);
        async move {
            let attempt = runs.fetch_add(1, Ordering::SeqCst) + 1;
            record_effect(conn, cell, attempt).await?;
            match by_hand {
                ByHand::Rollback => conn.batch_execute("ROLLBACK").await?,
                ByHand::CommitThenLoseARace => {
                    conn.batch_execute("COMMIT").await?;
                    if attempt == 1 {
                        idem::attempt::lost_race();
                        return Err(AppError::Versioned(idem::VersionedError::Stale {
                            expected: 1,
                            actual: 2,
                        }));
                    }
                }
                ByHand::CommitAndChainThenSwallow => {
                    conn.batch_execute("COMMIT AND CHAIN").await?;
                    let _ = conn.batch_execute("SELECT 1 / 0").await;
                }
                ByHand::RollbackBeginThenWrite => {
                    conn.batch_execute("ROLLBACK; BEGIN").await?;
                    record_effect(conn, cell, attempt).await?;
                }
                ByHand::SwallowedPrepare => {
                    let _ = conn.batch_execute("PREPARE TRANSACTION 'by_hand'").await;
                }
                ByHand::SwallowedFailedCommit => {
                    conn.batch_execute("INSERT INTO deferred_unique VALUES (1), (1)")
                        .await?;
                    let _ = conn.batch_execute("COMMIT").await;
                }
            }
            Ok(())
        }
        .scope_boxed()
    })
    .await;
    (outcome, runs.load(Ordering::SeqCst))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_ends_its_transaction_is_never_ok_nor_replayed() {
    let env = Env::new().await;
    for (by_hand, committed, effects) in [
        (ByHand::Rollback, false, 0),
        (ByHand::CommitThenLoseARace, true, 1),
        (ByHand::CommitAndChainThenSwallow, true, 1),
        (ByHand::RollbackBeginThenWrite, false, 0),
        (ByHand::SwallowedPrepare, false, 0),
        (ByHand::SwallowedFailedCommit, false, 0),
    ] {
        let (outcome, runs) = run(&env, by_hand).await;
        let cell = format!("by_hand/{by_hand:?}");
        assert!(
            matches!(
                &outcome,
                Err(AppError::Idem(idem::Error::TransactionEnded { committed: c })) if *c == committed
            ),
            "{by_hand:?}: {outcome:?}"
        );
        assert_eq!(runs, 1, "{by_hand:?}: not replayed");
        assert_eq!(env.effects(&cell).await, effects, "{by_hand:?}");
    }
    // The pool is clean afterwards: no connection left in a transaction.
    let mut conn = env.pool.get().await.expect("a checkout");
    let in_tx: Result<(), diesel::result::Error> = conn
        .transaction(async |c| c.batch_execute("SELECT 1").await)
        .await;
    assert!(in_tx.is_ok(), "{in_tx:?}");
}

/// A statement whose future the body dropped still runs when the body
/// returns `Ok`: idem waits for it up to `commit_timeout`, then cancels it
/// with its transaction, and says so; no `COMMIT` is sent behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_still_running_at_commit_is_rolled_back() {
    use diesel_async::RunQueryDsl;
    let env = Env::new().await;
    let policy = RetryPolicy::new()
        .max_attempts(3)
        .deadline(std::time::Duration::from_secs(10))
        .commit_timeout(std::time::Duration::from_millis(300));
    let outcome: Result<(), AppError> = retry(&env.pool, policy, "dropped", |conn| {
        async move {
            record_effect(conn, "dropped", 1).await?;
            let slow = diesel::sql_query("SELECT pg_sleep(3)").execute(conn);
            // Sent, then dropped unanswered. A prepared statement goes out
            // after its own round trip (Parse): 500 ms, not 50, so that a
            // loaded machine still sends the sleep before the drop.
            let _ = tokio::time::timeout(std::time::Duration::from_millis(500), slow).await;
            Ok(())
        }
        .scope_boxed()
    })
    .await;
    assert!(
        matches!(outcome, Err(AppError::Idem(idem::Error::RolledBack))),
        "{outcome:?}"
    );
    assert_eq!(env.effects("dropped").await, 0);
}
