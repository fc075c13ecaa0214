//! Hostile tests of 129e458 (a body's own `COMMIT` whose answer it stopped
//! waiting for is counted: the loop waits up to `commit_timeout_ms` for
//! what the body sent to be answered, and a request still unanswered then
//! whose text may commit counts as committed) and of 18d32b1 (a nested
//! transaction dropped mid-statement). Every effect is counted on a side
//! connection; idem's answer is never trusted.
//!
//! The `found_` tests failed when written: a `COMMIT` whose text the scan
//! in `idem-runtime/src/pool/wire/says.rs` did not read as one (a `--`
//! comment ended by a carriage return, which PostgreSQL ends there and the
//! scan did not; a `;` inside a block comment, where the scan split
//! statements and then read `*/` as the first word), held past the commit
//! timeout, was answered "nothing committed" or replayed while it
//! committed; and a body's own `COMMIT` whose connection is cut right after
//! the server received it was replayed (a closed connection reads as "every
//! request answered", so the unanswered `COMMIT` is never looked at).
//!
//! Fixed: the scan finds statements as PostgreSQL's lexer finds them (a
//! `--` comment ends at `\r` too; a `;` in a comment ends nothing); the
//! requests a closed connection left unanswered are read too; and a
//! `ROLLBACK` that times out behind a statement still running is no longer
//! read as a lost connection.

use super::attack_dropped::{items_in, proxied};
use super::attack_savepoint::no_session_left_in_a_transaction;
use super::*;
use idem_testing::proxy::{Fault, Proxy};

/// Whether idem's answer says nothing was committed.
fn says_nothing_committed<T>(r: &Result<T, AppError>) -> bool {
    matches!(
        r,
        Err(AppError::Idem(
            idem::Error::RolledBack
                | idem::Error::SavepointOpen
                | idem::Error::TransactionEnded { committed: false }
        )) | Err(AppError::InsufficientFunds)
    )
}

/// A `COMMIT` the text scan did not read as one, though PostgreSQL runs
/// it as one: a `--` comment PostgreSQL ends at the carriage return.
const CR_COMMIT: &str = "-- hidden-cr\rCOMMIT";
/// The same, hidden behind a `;` inside a block comment.
const BLOCK_COMMIT: &str = "/* hidden-block ; */COMMIT";

/// How a body ends after dropping its own `COMMIT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Then {
    Ok,
    OwnError,
    LostRace,
}

/// Writes item `id + attempt`; on the first attempt sends `commit` (the
/// proxy holds its answer 1.5 s, armed on `pattern`), drops it after
/// 50 ms and ends as `then` says. `commit_timeout_ms` is 300.
#[retryable(max = 4, deadline_ms = 8000, commit_timeout_ms = 300)]
async fn hidden_commit_then(
    conn: &mut AsyncPgConnection,
    id: i64,
    commit: &str,
    pattern: &str,
    then: Then,
    proxy: &Proxy,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    let call = calls.fetch_add(1, Ordering::SeqCst) + 1;
    insert_item(conn, id + i64::from(call)).await?;
    if call == 1 {
        proxy.arm(pattern, Fault::HoldAnswer(Duration::from_millis(1500)));
        let dropped =
            tokio::time::timeout(Duration::from_millis(50), conn.batch_execute(commit)).await;
        assert!(dropped.is_err(), "the held answer outlasts the timeout");
        match then {
            Then::Ok => {}
            Then::OwnError => return Err(AppError::InsufficientFunds),
            Then::LostRace => return Err(lost_a_race()),
        }
    }
    Ok(())
}

/// Runs [`hidden_commit_then`] and returns its answer, its calls, and how
/// many of its items committed (the first attempt's is item `id + 1`).
async fn run_hidden(commit: &str, pattern: &str, then: Then, id: i64) -> (String, u32, i64) {
    let env = env(1).await;
    let (proxy, pool) = proxied(&env).await;
    let calls = AtomicU32::new(0);
    let r = hidden_commit_then(&pool, id, commit, pattern, then, &proxy, &calls).await;
    let ids = format!("{}, {}, {}, {}", id + 1, id + 2, id + 3, id + 4);
    let committed = items_in(&env, &ids).await;
    let first = items_in(&env, &format!("{}", id + 1)).await;
    no_session_left_in_a_transaction(&env, commit).await;
    let answer = format!("{r:?}");
    let calls = count(&calls);
    assert!(
        !(says_nothing_committed(&r) && committed > 0),
        "{commit:?} then {then:?}: answered {answer} (nothing committed) after {calls} \
         call(s), but {committed} item(s) committed (item {} by the body's own COMMIT: {first})",
        id + 1
    );
    assert!(
        calls == 1 && committed == 1 && answer.contains("committed: true"),
        "{commit:?} then {then:?}: answered {answer} after {calls} call(s); {committed} \
         item(s) committed (item {} by the body's own COMMIT: {first})",
        id + 1
    );
    (answer, calls, committed)
}

/// Sanity check of the premise, on a side connection: PostgreSQL runs both
/// hidden texts as a `COMMIT` (it ends the `--` comment at `\r`; a block
/// comment's `;` splits nothing). Holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hidden_texts_commit_on_postgres() {
    let env = env(1).await;
    for (n, commit) in [CR_COMMIT, BLOCK_COMMIT].into_iter().enumerate() {
        let id = 50 + n as i64;
        let client = side_connection(env.db.url()).await;
        client
            .batch_execute(&format!("BEGIN; INSERT INTO items VALUES ({id})"))
            .await
            .unwrap();
        client.batch_execute(commit).await.unwrap();
        client.batch_execute("ROLLBACK").await.unwrap();
        assert_eq!(items_in(&env, &id.to_string()).await, 1, "{commit:?}");
    }
}

/// Found, and fixed: a `COMMIT` hidden by a `--` comment ended with `\r`, its answer
/// held past `commit_timeout_ms`, the body returning `Ok`. Promise
/// (docs/retryable.md "Hygiene"): a dropped statement still running at
/// `COMMIT` is `RolledBack` "unless its text may commit ... then
/// `TransactionEnded { committed: true }`", and "Transaction control is
/// idem's": never "nothing committed" after a `COMMIT` of the body's. idem
/// answers `RolledBack`; the item is committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_cr_comment_hidden_commit_then_ok_answers_rolled_back() {
    run_hidden(CR_COMMIT, "hidden-cr", Then::Ok, 100).await;
}

/// Found, and fixed: the same with the `COMMIT` behind a block comment holding a `;`.
/// idem answers `RolledBack`; the item is committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_block_comment_hidden_commit_then_ok_answers_rolled_back() {
    run_hidden(BLOCK_COMMIT, "hidden-block", Then::Ok, 200).await;
}

/// Found, and fixed: a hidden `COMMIT` (answer held past the commit timeout), then the
/// body returns its own error. Promise: a body that ran `COMMIT` itself
/// "gets `TransactionEnded { committed }`" and "is never replayed"; its own
/// errors are "returned at once". idem's `ROLLBACK` queues behind the held
/// `COMMIT`, times out, reads as a lost connection, and the body is
/// replayed: `Ok`, both attempts' items committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_hidden_commit_then_own_error_is_replayed() {
    run_hidden(CR_COMMIT, "hidden-cr", Then::OwnError, 300).await;
}

/// Found, and fixed: a hidden `COMMIT` (answer held past the commit timeout), then a
/// lost race. Promise: a body that ran `COMMIT` itself "is never replayed:
/// what it committed by hand would be written again". idem replays it and
/// answers `Ok`: both attempts' items are committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_hidden_commit_then_lost_race_is_replayed() {
    run_hidden(BLOCK_COMMIT, "hidden-block", Then::LostRace, 400).await;
}

/// The detected forms, held past the commit timeout the same way, with the
/// body returning `Ok`, its own error or a lost race: never "nothing
/// committed" while the item is there, never replayed. Holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detected_commits_held_past_timeout_count_as_committed() {
    let forms = [
        ("/* detected-a */ COMMIT AND NO CHAIN", "detected-a"),
        ("-- detected-b\nEND", "detected-b"),
        ("SELECT 'detected-c'; COMMIT", "detected-c"),
    ];
    let mut id = 500;
    for (commit, pattern) in forms {
        for then in [Then::Ok, Then::OwnError, Then::LostRace] {
            run_hidden(commit, pattern, then, id).await;
            id += 10;
        }
    }
}

/// Writes item `id + attempt`, then on the first attempt runs `COMMIT`
/// itself while the proxy forwards it and cuts the connection (the server
/// commits; the answer never comes), and returns the connection error
/// (`?`) or, with `swallow`, `Ok`.
#[retryable(max = 4, deadline_ms = 8000)]
async fn own_commit_cut(
    conn: &mut AsyncPgConnection,
    id: i64,
    swallow: bool,
    proxy: &Proxy,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    let call = calls.fetch_add(1, Ordering::SeqCst) + 1;
    insert_item(conn, id + i64::from(call)).await?;
    if call == 1 {
        proxy.arm("COMMIT /* own-cut */", Fault::CutAfter);
        let cut = conn.batch_execute("COMMIT /* own-cut */").await;
        if !swallow {
            cut?;
        }
    }
    Ok(())
}

/// Found, and fixed: a body's own `COMMIT` (plain text, read as one) reaches the
/// server and its connection is lost before the answer; the body returns
/// the connection error, or swallows it and returns `Ok`. Promise: "a body
/// that runs `COMMIT` ... itself .. is never replayed", and "a request
/// still unanswered then whose text may commit counts as committed". idem
/// sees a closed connection as settled, never looks at the unanswered
/// `COMMIT`, and replays it as a lost connection: `Ok`, both attempts'
/// items committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_own_commit_with_connection_cut_is_replayed() {
    let env = env(1).await;
    let (proxy, pool) = proxied(&env).await;
    let mut wrong = Vec::new();
    for (n, swallow) in [false, true].into_iter().enumerate() {
        let id = 700 + 10 * n as i64;
        let calls = AtomicU32::new(0);
        let r = own_commit_cut(&pool, id, swallow, &proxy, &calls).await;
        let ids = format!("{}, {}, {}, {}", id + 1, id + 2, id + 3, id + 4);
        let committed = items_in(&env, &ids).await;
        // Behind PgBouncer the cut may come before it passed the `COMMIT`
        // on: then nothing ran, and "may have been committed" still holds.
        let pooled = env.db.via().is_transaction_pooling();
        let right = matches!(
            r,
            Err(AppError::Idem(idem::Error::TransactionEnded {
                committed: true
            }))
        ) && count(&calls) == 1
            && (committed == 1 || (pooled && committed == 0));
        if !right {
            wrong.push(format!(
                "swallow {swallow}: answered {r:?} after {} call(s), {committed} item(s) \
                 committed (item {} by the body's own COMMIT)",
                count(&calls),
                id + 1
            ));
        }
    }
    no_session_left_in_a_transaction(&env, "own COMMIT cut").await;
    assert!(wrong.is_empty(), "{wrong:#?}");
}

/// Writes item `id`, drops a `pg_sleep(5)` after 50 ms, and returns its
/// own error; `commit_timeout_ms` is 300.
#[retryable(max = 4, deadline_ms = 8000, commit_timeout_ms = 300)]
async fn dropped_sleep_then_error(
    conn: &mut AsyncPgConnection,
    id: i64,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    insert_item(conn, id).await?;
    let dropped = tokio::time::timeout(
        Duration::from_millis(50),
        conn.batch_execute("SELECT pg_sleep(5) /* unanswered-sleep */"),
    )
    .await;
    assert!(dropped.is_err(), "the sleep outlasts the timeout");
    Err(AppError::InsufficientFunds)
}

/// Found, and fixed: a dropped non-commit statement still running when the body
/// returns its own error. The settle wait is bounded by
/// `commit_timeout_ms`, but then idem's `ROLLBACK` (queued behind the
/// sleep) times out too, idem closes the connection itself and reads that
/// as a lost connection: the body's own error, which "is returned at once,
/// after `ROLLBACK`", is replayed until the budget is spent and answered
/// `Exhausted { last_cause: ConnectionLost }` (the body ran 4 times).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_dropped_sleep_then_own_error_is_replayed_as_connection_lost() {
    let env = env(1).await;
    let calls = AtomicU32::new(0);
    let started = Instant::now();
    let r = dropped_sleep_then_error(&env.pool, 800, &calls).await;
    let took = started.elapsed();
    assert_eq!(items_in(&env, "800").await, 0);
    assert_eq!(env.running_after("unanswered-sleep").await, 0);
    no_session_left_in_a_transaction(&env, "dropped sleep").await;
    env.assert_pool_clean().await;
    assert!(
        matches!(r, Err(AppError::InsufficientFunds)) && count(&calls) == 1,
        "answered {r:?} after {} call(s) in {took:?}",
        count(&calls)
    );
    assert!(took < Duration::from_millis(2500), "took {took:?}");
}
