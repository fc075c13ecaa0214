//! Hostile tests of 129e458 under `#[idempotent]`: a body that sends a
//! `COMMIT` of its own whose text the scan in
//! `idem-runtime/src/pool/wire/says.rs` did not read as one (a `--`
//! comment PostgreSQL ends at a carriage return), drops it while the proxy
//! holds its answer past `commit_timeout_ms`, and then returns `Ok`,
//! declines or reports a lost race, in local and external mode. Effects
//! and records are counted on a side connection.
//!
//! The `found_` test failed when written: the call answered "nothing
//! committed", stored the decline, or replayed the body, while its `COMMIT`
//! committed. Fixed: the scan finds statements as PostgreSQL's lexer
//! finds them (a `--` comment ends at `\r` too).

use super::attack_dropped::{end, proxy_env, Then};
use super::*;
use idem_testing::proxy::{Fault, Proxy};

/// Sends `-- hidden-cr\rCOMMIT` (a `COMMIT` to PostgreSQL, not to the
/// scan) with the proxy holding its answer 1.5 s, and drops it after
/// 50 ms.
async fn drop_hidden_commit(conn: &mut AsyncPgConnection, proxy: &Proxy) {
    proxy.arm("hidden-cr", Fault::HoldAnswer(Duration::from_millis(1500)));
    let dropped = tokio::time::timeout(
        Duration::from_millis(50),
        conn.batch_execute("-- hidden-cr\rCOMMIT"),
    )
    .await;
    assert!(dropped.is_err(), "the held answer outlasts the timeout");
}

/// Local mode: writes an effect, and on its first run drops the hidden
/// `COMMIT` and ends as `then` says.
#[idempotent(key = key, scope = none, fingerprint(key))]
#[retryable(max = 3, deadline_ms = 8000, commit_timeout_ms = 300)]
async fn local_hidden_commit(
    conn: &mut AsyncPgConnection,
    key: &str,
    then: Then,
    proxy: &Proxy,
    runs: &AtomicU32,
) -> Result<i64, AppError> {
    let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
    insert_effect(conn, key, i64::from(run)).await?;
    if run == 1 {
        drop_hidden_commit(conn, proxy).await;
        return end(then);
    }
    Ok(1)
}

/// External mode: writes an effect (phase 2), and on its first run drops
/// the hidden `COMMIT` and ends as `then` says.
#[idempotent(key = key, mode = external, scope = none, fingerprint(key))]
#[retryable(max = 3, deadline_ms = 8000, commit_timeout_ms = 300)]
async fn external_hidden_commit(
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
        drop_hidden_commit(conn, proxy).await;
        return end(then);
    }
    Ok(1)
}

/// Found, and fixed: a body that committed by hand (a `COMMIT` the text scan misses,
/// its answer held past `commit_timeout_ms`), then returns `Ok`, declines
/// or reports a lost race, in local and external mode. The promise (README
/// "Migrating from 0.2", docs/retryable.md "Transaction control is
/// idem's"): `TransactionEnded { committed: true }`, never replayed, no
/// outcome stored. Every case is checked and the failures listed together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_hidden_commit_past_timeout_is_misreported() {
    let p = proxy_env().await;
    let (env, proxy, pool) = (&p.env, &p.proxy, &p.pool);
    let mut wrong = Vec::new();
    for external in [false, true] {
        for then in [Then::Ok, Then::Declines, Then::LostRace] {
            let key = format!("hidden-commit-{external}-{then:?}");
            let runs = AtomicU32::new(0);
            let r = if external {
                external_hidden_commit(pool, &key, then, proxy, &runs).await
            } else {
                local_hidden_commit(pool, &key, then, proxy, &runs).await
            };
            let effects = env.effects(&key).await;
            let record = env.record(&key).await;
            let stored = record
                .as_ref()
                .is_some_and(|(state, ..)| state == "completed");
            let right = matches!(
                r,
                Err(AppError::Idem(idem::Error::TransactionEnded {
                    committed: true
                }))
            ) && effects == 1
                && calls(&runs) == 1
                && !stored;
            if !right {
                wrong.push(format!(
                    "{key}: answered {r:?} after {} run(s), {effects} effect(s), record {record:?}",
                    calls(&runs)
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}
