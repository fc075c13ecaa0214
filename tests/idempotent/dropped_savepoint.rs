//! Local mode when the body drops a nested `conn.transaction(..)` while
//! one of its transaction statements is unanswered (see the retryable
//! suite's `dropped_savepoint`): the record rides on a `COMMIT` that
//! diesel-async's manager, having lost track of the depth, could not be
//! trusted with. Never `Ok`, nothing committed, no record, the key free.

use super::attack_ext::records_of;
use super::attack_wire::proxy_env;
use super::*;
use idem_testing::proxy::Fault;

/// Writes its effect, then gives a nested transaction (a second effect,
/// then a commit or, with `inner_fails`, a failure) 50 ms while the proxy
/// holds one of its statements 300 ms.
#[idempotent(key = key, scope = none, fingerprint(key))]
#[retryable(max = 3, deadline_ms = 5000)]
async fn drops_a_savepoint_statement(
    conn: &mut AsyncPgConnection,
    key: &str,
    inner_fails: bool,
    drop_it: bool,
) -> Result<i64, AppError> {
    insert_effect(conn, key, 1).await?;
    if drop_it {
        let inner = tokio::time::timeout(
            Duration::from_millis(50),
            conn.transaction::<_, AppError, _>(async |c| {
                insert_effect(c, key, 2).await?;
                if inner_fails {
                    return Err(diesel::result::Error::RollbackTransaction.into());
                }
                Ok(())
            }),
        )
        .await;
        assert!(inner.is_err(), "the held statement outlasts the timeout");
    }
    Ok(1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_mode_with_a_savepoint_statement_dropped_unanswered_records_nothing() {
    let p = proxy_env().await;
    let (env, proxy, pool) = (&p.env, &p.proxy, &p.pool);
    let hold = Duration::from_millis(300);
    for (statement, inner_fails) in [
        ("SAVEPOINT", false),
        ("RELEASE SAVEPOINT", false),
        ("ROLLBACK TO SAVEPOINT", true),
    ] {
        for fault in [Fault::HoldRequest(hold), Fault::HoldAnswer(hold)] {
            let key = format!("dropped-{statement}-{fault:?}");
            proxy.arm(statement, fault);
            let fired = proxy.fired();
            let r = drops_a_savepoint_statement(pool, &key, inner_fails, true).await;
            assert_eq!(proxy.fired(), fired + 1, "{key}: held");
            assert!(
                matches!(r, Err(AppError::Idem(idem::Error::SavepointOpen))),
                "{key}: {r:?}"
            );
            assert_eq!(env.effects(&key).await, 0, "{key}: nothing committed");
            assert_eq!(records_of(env, &key).await, 0, "{key}: no record");
            // The key is free, and the pool's next connection commits.
            let again = drops_a_savepoint_statement(pool, &key, inner_fails, false).await;
            assert!(matches!(&again, Ok(v) if !v.replayed), "{key}: {again:?}");
            assert_eq!(env.effects(&key).await, 1, "{key}");
        }
    }
}
