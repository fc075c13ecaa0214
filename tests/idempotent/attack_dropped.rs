//! Hostile tests of the dropped-transaction-statement fix (18d32b1) under
//! `#[idempotent]`: a body that drops a future of diesel-async's own
//! transaction manager (its `COMMIT`, its `SAVEPOINT`) while the statement
//! is unanswered, in local and external mode, then returns `Ok`, a final
//! error or a replayable one. Effects and records are counted on a side
//! connection. The proxy is armed from inside the body, right before the
//! dropped call, so idem's own statements are never the ones held.
//!
//! The `found_` tests failed when written: the loop read how the
//! transaction ended while the answer to the body's own `COMMIT` was still
//! on its way, so an error the body returned next was replayed, stored as
//! the key's outcome or answered as is, with the `COMMIT`'s writes in the
//! database; and a `COMMIT` still unanswered at the commit timeout was
//! reported rolled back. The loop now waits for what the body sent to be
//! answered first (up to the commit timeout), and an unanswered request
//! that may commit counts as committed.

use super::*;
use diesel_async::{AnsiTransactionManager, TransactionManager};
use idem_testing::proxy::{Fault, Proxy};

/// A test database, and a proxy in front of its pool URL (PgBouncer's
/// under `IDEM_TEST_VIA=pgbouncer`) with a pool of one through it.
pub(super) struct ProxyEnv {
    pub(super) env: Env,
    pub(super) proxy: Proxy,
    pub(super) pool: Pool,
}

pub(super) async fn proxy_env() -> ProxyEnv {
    let env = env(2).await;
    let proxy = Proxy::start(env.db.pool_url()).await.unwrap();
    let pool = build_pool_with(
        proxy.url(),
        &PoolConfig {
            max_size: 1,
            wait_timeout: Duration::from_secs(10),
            pooler: test_pool::pooler(&env.db),
            ..PoolConfig::default()
        },
    )
    .unwrap();
    ProxyEnv { env, proxy, pool }
}

/// How a body ends after dropping a `COMMIT` of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Then {
    Ok,
    Declines,
    LostRace,
}

/// Has diesel-async's manager send `COMMIT` (depth 1: idem's transaction)
/// with the proxy holding its answer 400 ms, and drops it after 50 ms.
async fn drop_manager_commit(conn: &mut AsyncPgConnection, proxy: &Proxy) {
    proxy.arm("COMMIT\0", Fault::HoldAnswer(Duration::from_millis(400)));
    let dropped = tokio::time::timeout(
        Duration::from_millis(50),
        AnsiTransactionManager::commit_transaction(conn),
    )
    .await;
    assert!(dropped.is_err(), "the held answer outlasts the timeout");
}

/// What the body returns after the drop.
pub(super) fn end(then: Then) -> Result<i64, AppError> {
    match then {
        Then::Ok => Ok(1),
        Then::Declines => Err(AppError::Declined(Declined::InsufficientFunds {
            needed: 7,
        })),
        Then::LostRace => {
            idem::attempt::lost_race();
            Err(AppError::Invalid)
        }
    }
}

/// Local mode: writes an effect, and on its first run drops the manager's
/// `COMMIT` and ends as `then` says.
#[idempotent(key = key, scope = none, fingerprint(key))]
#[retryable(max = 3, deadline_ms = 5000)]
async fn local_commits_by_hand(
    conn: &mut AsyncPgConnection,
    key: &str,
    then: Then,
    proxy: &Proxy,
    runs: &AtomicU32,
) -> Result<i64, AppError> {
    let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
    insert_effect(conn, key, i64::from(run)).await?;
    if run == 1 {
        drop_manager_commit(conn, proxy).await;
        return end(then);
    }
    Ok(1)
}

/// External mode: writes an effect (phase 2), and on its first run drops
/// the manager's `COMMIT` and ends as `then` says.
#[idempotent(key = key, mode = external, scope = none, fingerprint(key))]
#[retryable(max = 3, deadline_ms = 5000)]
async fn external_commits_by_hand(
    db: &mut Deferred<'_>,
    key: &str,
    then: Then,
    proxy: &Proxy,
    runs: &AtomicU32,
) -> Result<i64, AppError> {
    let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
    let conn = db.conn().await?;
    insert_effect(conn, key, i64::from(run)).await?;
    if run == 1 {
        drop_manager_commit(conn, proxy).await;
        return end(then);
    }
    Ok(1)
}

/// The body returning `Ok` after its own dropped `COMMIT`, in both modes:
/// `TransactionEnded { committed: true }`, not replayed, one effect, no
/// outcome stored. Holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_manager_commit_then_ok_is_transaction_ended() {
    let p = proxy_env().await;
    let (env, proxy, pool) = (&p.env, &p.proxy, &p.pool);
    for external in [false, true] {
        let key = format!("dropped-commit-ok-{external}");
        let runs = AtomicU32::new(0);
        let r = if external {
            external_commits_by_hand(pool, &key, Then::Ok, proxy, &runs).await
        } else {
            local_commits_by_hand(pool, &key, Then::Ok, proxy, &runs).await
        };
        let effects = env.effects(&key).await;
        let record = env.record(&key).await;
        let stored = record
            .as_ref()
            .is_some_and(|(state, ..)| state == "completed");
        assert!(
            matches!(
                r,
                Err(AppError::Idem(idem::Error::TransactionEnded {
                    committed: true
                }))
            ) && effects == 1
                && calls(&runs) == 1
                && !stored,
            "{key}: answered {r:?} after {} run(s), {effects} effect(s), record {record:?}",
            calls(&runs)
        );
    }
}

/// Found, and fixed (see the module's doc). A body that committed by hand
/// (diesel-async's manager's `COMMIT`, its future dropped before the
/// answer), then declines or reports a lost race, in local and external
/// mode. What was found: the decline stored under the key (every repeat
/// told "declined" for a request whose effect happened), and the lost race
/// replayed (two effects for one request; in external mode the outside
/// call would have run twice). The promise: `TransactionEnded { committed:
/// true }`, never replayed, no outcome stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_dropped_manager_commit_then_an_error_is_transaction_ended() {
    let p = proxy_env().await;
    let (env, proxy, pool) = (&p.env, &p.proxy, &p.pool);
    for external in [false, true] {
        for then in [Then::Declines, Then::LostRace] {
            let key = format!("dropped-commit-{external}-{then:?}");
            let runs = AtomicU32::new(0);
            let r = if external {
                external_commits_by_hand(pool, &key, then, proxy, &runs).await
            } else {
                local_commits_by_hand(pool, &key, then, proxy, &runs).await
            };
            let effects = env.effects(&key).await;
            let record = env.record(&key).await;
            let stored = record
                .as_ref()
                .is_some_and(|(state, ..)| state == "completed");
            assert!(
                matches!(
                    r,
                    Err(AppError::Idem(idem::Error::TransactionEnded {
                        committed: true
                    }))
                ) && effects == 1
                    && calls(&runs) == 1
                    && !stored,
                "{key}: answered {r:?} after {} run(s), {effects} effect(s), record {record:?}",
                calls(&runs)
            );
        }
    }
}

/// Has a nested `conn.transaction` (an effect `n` in it) given 50 ms while
/// the proxy holds its `SAVEPOINT` 300 ms.
async fn drop_nested(conn: &mut AsyncPgConnection, key: &str, proxy: &Proxy) {
    proxy.arm("SAVEPOINT", Fault::HoldRequest(Duration::from_millis(300)));
    let inner = tokio::time::timeout(
        Duration::from_millis(50),
        conn.transaction::<_, AppError, _>(async |c| {
            insert_effect(c, key, 2).await?;
            Ok(())
        }),
    )
    .await;
    assert!(inner.is_err(), "the held SAVEPOINT outlasts the timeout");
}

/// External mode: writes an effect, drops a nested transaction's
/// `SAVEPOINT` unanswered, and returns `Ok` (or panics, with `panics`).
#[idempotent(key = key, mode = external, scope = none, fingerprint(key))]
#[retryable(max = 3, deadline_ms = 5000)]
async fn external_drops_nested(
    db: &mut Deferred<'_>,
    key: &str,
    panics: bool,
    proxy: &Proxy,
) -> Result<i64, AppError> {
    let conn = db.conn().await?;
    insert_effect(conn, key, 1).await?;
    drop_nested(conn, key, proxy).await;
    assert!(!panics, "the body panics after the drop");
    Ok(1)
}

/// External mode's phase 3 after a dropped `SAVEPOINT`: `SavepointOpen`,
/// no effect committed, the key held as an unknown outcome; and a body
/// that panics after the same drop commits nothing either and leaves the
/// pool of one serving the next call. Holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn external_dropped_savepoint_commits_nothing_and_holds_the_key() {
    let p = proxy_env().await;
    let (env, proxy, pool) = (&p.env, &p.proxy, &p.pool);
    let key = "ext-dropped-savepoint";
    let r = external_drops_nested(pool, key, false, proxy).await;
    assert!(matches_idem(&r, "SavepointOpen"), "{r:?}");
    assert_eq!(env.effects(key).await, 0);
    assert_eq!(env.state(key).await.as_deref(), Some("unknown"));
    // A panic after the drop: the call unwinds, nothing commits.
    let p = Arc::new(p);
    let key = "ext-dropped-savepoint-panics";
    let call = {
        let p = p.clone();
        tokio::spawn(async move { external_drops_nested(&p.pool, key, true, &p.proxy).await })
    };
    let joined = call.await;
    assert!(joined.as_ref().is_err_and(|e| e.is_panic()), "{joined:?}");
    assert_eq!(p.env.effects(key).await, 0);
    let runs = AtomicU32::new(0);
    let next = local_commits_by_hand(&p.pool, "after-panic", Then::Ok, &p.proxy, &runs);
    // Its first run drops a COMMIT of its own: answered, not hung.
    let next = tokio::time::timeout(Duration::from_secs(10), next).await;
    assert!(
        matches!(
            next,
            Ok(Err(AppError::Idem(idem::Error::TransactionEnded {
                committed: true
            })))
        ),
        "the pool of one serves the next call: {next:?}"
    );
    assert_eq!(p.env.effects("after-panic").await, 1);
}
