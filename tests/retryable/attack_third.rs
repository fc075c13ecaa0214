//! Third hostile pass over how idem decides whether a body's own `COMMIT`
//! ran (18d32b1, 129e458, 5ebefe1): the text scan of
//! `idem-runtime/src/pool/wire/says.rs`, unanswered requests on a closed
//! connection, and the `ROLLBACK` queued behind a running statement. Every
//! effect is counted on a side connection; idem's answer is never trusted.
//!
//! The `found_` tests failed when written: an `END` behind a literal (or
//! quoted name) holding `--` or `/*` was not read as a commit, so it was
//! answered "nothing committed" or replayed over what it committed; and a
//! lost connection under a statement whose text merely holds the word
//! `commit` was no longer replayed but answered `TransactionEnded {
//! committed: true }` while nothing committed. Fixed: statements are found
//! as PostgreSQL's lexer finds them (literals, quoted names, comments),
//! and only a statement's first word reads as a commit.

use super::attack_dropped::{items_in, proxied};
use super::attack_savepoint::no_session_left_in_a_transaction;
use super::*;
use idem_testing::proxy::{Fault, Proxy};

/// `END` statements PostgreSQL 15 runs as a `COMMIT`, behind a literal or
/// quoted name holding `--` or `/*`, which the scan reads as a comment
/// opening there (each with its own marker for the proxy).
const HIDDEN_ENDS: [(&str, &str); 4] = [
    ("SELECT 'hidden-end-a --'; END", "hidden-end-a"),
    ("SELECT '/static/*' AS hidden_end_b; END", "hidden_end_b"),
    ("SELECT $$hidden-end-c --$$; END", "hidden-end-c"),
    ("SELECT 1 AS \"hidden-end-d /*\"; END", "hidden-end-d"),
];

/// Sanity check of the premise, on a side connection: each of
/// [`HIDDEN_ENDS`] commits the open transaction on PostgreSQL. Holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hidden_end_texts_commit_on_postgres() {
    let env = env(1).await;
    for (n, (end, _)) in HIDDEN_ENDS.into_iter().enumerate() {
        let id = 40 + n as i64;
        let client = side_connection(env.db.url()).await;
        client
            .batch_execute(&format!("BEGIN; INSERT INTO items VALUES ({id})"))
            .await
            .unwrap();
        client.batch_execute(end).await.unwrap();
        client.batch_execute("ROLLBACK").await.unwrap();
        assert_eq!(items_in(&env, &id.to_string()).await, 1, "{end:?}");
    }
}

/// Whether the body returns `Ok` or its own error after the dropped end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Then {
    Ok,
    OwnError,
}

/// Writes item `id + attempt`; on the first attempt sends `end` with the
/// proxy holding its answer 1.5 s (armed on `pattern`), drops it after
/// 50 ms and ends as `then` says. `commit_timeout_ms` is 300.
#[retryable(max = 4, deadline_ms = 8000, commit_timeout_ms = 300)]
async fn dropped_end_then(
    conn: &mut AsyncPgConnection,
    id: i64,
    end: &str,
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
            tokio::time::timeout(Duration::from_millis(50), conn.batch_execute(end)).await;
        assert!(dropped.is_err(), "the held answer outlasts the timeout");
        if then == Then::OwnError {
            return Err(AppError::InsufficientFunds);
        }
    }
    Ok(())
}

/// Whether a call answered `TransactionEnded { committed: true }`.
fn ended_committed<T>(r: &Result<T, AppError>) -> bool {
    matches!(
        r,
        Err(AppError::Idem(idem::Error::TransactionEnded {
            committed: true
        }))
    )
}

/// Found, and fixed: each of [`HIDDEN_ENDS`], its answer held past
/// `commit_timeout_ms`, dropped by the body, which then returns `Ok` or its
/// own error. Promise (docs/retryable.md "Transaction control is idem's"):
/// a body that ends the transaction itself gets `TransactionEnded {
/// committed }`, never `Ok`, never "nothing committed" after its `COMMIT`
/// (the public docs name no exception for `END`). idem answers
/// `RolledBack` or the body's own error; the item is committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_hidden_end_held_past_timeout_is_answered_as_not_committed() {
    let env = env(1).await;
    let (proxy, pool) = proxied(&env).await;
    let mut wrong = Vec::new();
    let mut id = 1000;
    for (end, pattern) in HIDDEN_ENDS {
        for then in [Then::Ok, Then::OwnError] {
            let calls = AtomicU32::new(0);
            let r = dropped_end_then(&pool, id, end, pattern, then, &proxy, &calls).await;
            let ids = format!("{}, {}, {}, {}", id + 1, id + 2, id + 3, id + 4);
            let committed = items_in(&env, &ids).await;
            if !(ended_committed(&r) && count(&calls) == 1 && committed == 1) {
                wrong.push(format!(
                    "{end:?} then {then:?}: answered {r:?} after {} call(s), {committed} \
                     item(s) committed",
                    count(&calls)
                ));
            }
            id += 10;
        }
    }
    no_session_left_in_a_transaction(&env, "hidden END held").await;
    assert!(wrong.is_empty(), "{wrong:#?}");
}

/// Writes item `id + attempt`; on the first attempt sends `end` while the
/// proxy forwards it and cuts the connection (the server commits, the
/// answer never comes), and returns the connection error.
#[retryable(max = 4, deadline_ms = 8000)]
async fn cut_end(
    conn: &mut AsyncPgConnection,
    id: i64,
    end: &str,
    pattern: &str,
    proxy: &Proxy,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    let call = calls.fetch_add(1, Ordering::SeqCst) + 1;
    insert_item(conn, id + i64::from(call)).await?;
    if call == 1 {
        proxy.arm(pattern, Fault::CutAfter);
        conn.batch_execute(end).await?;
    }
    Ok(())
}

/// Found, and fixed: each of [`HIDDEN_ENDS`] reaches the server, which commits, and
/// the connection is cut before the answer. Promise: a body that ends the
/// transaction itself "is never replayed: what it committed by hand would
/// be written again"; "a request still unanswered when the connection
/// closes counts as committed". idem replays it as a lost connection and
/// answers `Ok`: both attempts' items are committed (a double effect).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_hidden_end_with_connection_cut_is_replayed_twice_written() {
    let env = env(1).await;
    let (proxy, pool) = proxied(&env).await;
    let mut wrong = Vec::new();
    let mut id = 2000;
    for (end, pattern) in HIDDEN_ENDS {
        let calls = AtomicU32::new(0);
        let r = cut_end(&pool, id, end, pattern, &proxy, &calls).await;
        let ids = format!("{}, {}, {}, {}", id + 1, id + 2, id + 3, id + 4);
        let committed = items_in(&env, &ids).await;
        // Behind PgBouncer a cut `END` may never reach the server: "may have".
        let pooled = env.db.via().is_transaction_pooling();
        let ran = committed == 1 || (pooled && committed == 0);
        if !(ended_committed(&r) && count(&calls) == 1 && ran) {
            wrong.push(format!(
                "{end:?}: answered {r:?} after {} call(s), {committed} item(s) committed",
                count(&calls)
            ));
        }
        id += 10;
    }
    no_session_left_in_a_transaction(&env, "hidden END cut").await;
    assert!(wrong.is_empty(), "{wrong:#?}");
}

/// Writes item `id + attempt`; on the first attempt runs `end` through the
/// extended protocol (`sql_query(..).execute`), with the proxy holding its
/// answer 1.5 s (`cut`: cutting the connection after it instead), and
/// drops it after 50 ms (or returns its error). `commit_timeout_ms` is 300.
#[retryable(max = 4, deadline_ms = 8000, commit_timeout_ms = 300)]
async fn extended_end(
    conn: &mut AsyncPgConnection,
    id: i64,
    end: &str,
    pattern: &str,
    cut: bool,
    proxy: &Proxy,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    let call = calls.fetch_add(1, Ordering::SeqCst) + 1;
    insert_item(conn, id + i64::from(call)).await?;
    if call == 1 {
        if cut {
            proxy.arm(pattern, Fault::CutAfter);
            diesel::sql_query(end).execute(conn).await?;
        } else {
            proxy.arm(pattern, Fault::HoldAnswer(Duration::from_millis(1500)));
            let run = diesel::sql_query(end).execute(conn);
            let dropped = tokio::time::timeout(Duration::from_millis(50), run).await;
            assert!(dropped.is_err(), "the held answer outlasts the timeout");
        }
    }
    Ok(())
}

/// An `END` (and `END WORK` behind a comment) run through the extended
/// protocol, its answer held past the commit timeout and dropped, or its
/// connection cut: the `Parse` text is read by statement name, so each
/// counts as committed (a cut one: may have), never replayed. Holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extended_protocol_ends_count_as_committed() {
    let env = env(1).await;
    let (proxy, pool) = proxied(&env).await;
    let mut wrong = Vec::new();
    let mut id = 3000;
    for (end, pattern) in [
        ("END /* ext-end-a */", "ext-end-a"),
        ("/* ext-end-b */ END WORK", "ext-end-b"),
    ] {
        for cut in [false, true] {
            let calls = AtomicU32::new(0);
            let r = extended_end(&pool, id, end, pattern, cut, &proxy, &calls).await;
            let ids = format!("{}, {}, {}, {}", id + 1, id + 2, id + 3, id + 4);
            let committed = items_in(&env, &ids).await;
            // A cut `END` may not run at all behind PgBouncer (which closes
            // its server connection when the client goes): "may have".
            let expected = if cut { committed <= 1 } else { committed == 1 };
            if !(ended_committed(&r) && count(&calls) == 1 && expected) {
                wrong.push(format!(
                    "{end:?} cut {cut}: answered {r:?} after {} call(s), {committed} item(s)",
                    count(&calls)
                ));
            }
            id += 10;
        }
    }
    no_session_left_in_a_transaction(&env, "extended END").await;
    assert!(wrong.is_empty(), "{wrong:#?}");
}

/// Writes item `base + attempt`, then on the first attempt runs `sleep`
/// (a statement that sleeps 30 s) and returns its error; records each
/// attempt's backend.
#[retryable(max = 4, deadline_ms = 60000)]
async fn insert_then_sleeps(
    conn: &mut AsyncPgConnection,
    base: i64,
    sleep: &str,
    pids: &Mutex<Vec<i32>>,
) -> Result<u32, AppError> {
    let attempt = attempt_no();
    let pid = backend_pid(conn).await?;
    pids.lock().unwrap().push(pid);
    insert_item(conn, base + i64::from(attempt)).await?;
    if attempt == 1 {
        diesel::sql_query(sleep).execute(conn).await?;
    }
    Ok(attempt)
}

/// Runs [`insert_then_sleeps`] with its first backend terminated while it
/// sleeps; the answer and the items committed.
async fn terminated_under(env: &Env, base: i64, sleep: &str) -> (Result<u32, AppError>, i64) {
    let pids = Mutex::new(Vec::new());
    let first = async {
        let until = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(pid) = pids.lock().unwrap().iter().next().copied() {
                return pid;
            }
            assert!(Instant::now() < until, "the body never ran");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    };
    let (r, ()) = tokio::join!(insert_then_sleeps(&env.pool, base, sleep, &pids), async {
        env.terminate_when_sleeping(first.await).await
    });
    let ids = format!("{}, {}, {}, {}", base + 1, base + 2, base + 3, base + 4);
    (r, items_in(env, &ids).await)
}

/// A backend terminated (`pg_terminate_backend`, as a failover does) while
/// a plain statement sleeps: replayed once on a fresh connection, `Ok`
/// from the second attempt, one item. Holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_plain_lost_connection_is_still_replayed_once() {
    let env = env(2).await;
    let (r, committed) = terminated_under(&env, 4000, "SELECT pg_sleep(30)").await;
    assert!(matches!(r, Ok(2)) && committed == 1, "{r:?}, {committed}");
    env.assert_pool_clean().await;
}

/// Found, and fixed (a regression of 129e458/5ebefe1): the same kill while the
/// sleeping statement's text merely holds the word `commit` in a literal
/// (`'pre-commit check'`) or `prepare` in an alias, statements that cannot
/// end a transaction (one statement per `Parse`). Promise (docs/retryable.md
/// "Replayed": "a lost connection ... replaying it is safe"; README table:
/// "its connection is replayed"). idem answers `TransactionEnded {
/// committed: true }` ("the body ended idem's transaction itself ... some of
/// what it wrote was committed"), not replayed, while nothing committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn found_lost_connection_under_a_commit_word_is_not_replayed() {
    let env = env(2).await;
    let mut wrong = Vec::new();
    for (n, sleep) in [
        "SELECT pg_sleep(30), 'pre-commit check'",
        "SELECT pg_sleep(30) AS prepare",
    ]
    .into_iter()
    .enumerate()
    {
        let base = 4100 + 10 * n as i64;
        let (r, committed) = terminated_under(&env, base, sleep).await;
        if !(matches!(r, Ok(2)) && committed == 1) {
            wrong.push(format!("{sleep:?}: answered {r:?}, {committed} item(s)"));
        }
    }
    env.assert_pool_clean().await;
    assert!(wrong.is_empty(), "{wrong:#?}");
}

/// Writes item `id + attempt`; on the first attempt runs `write` (binding
/// item `id + 10`) with the proxy cutting the connection right after it
/// reaches the server, and returns the connection error.
#[retryable(max = 4, deadline_ms = 8000)]
async fn cut_write(
    conn: &mut AsyncPgConnection,
    id: i64,
    write: &str,
    pattern: &str,
    proxy: &Proxy,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    let call = calls.fetch_add(1, Ordering::SeqCst) + 1;
    insert_item(conn, id + i64::from(call)).await?;
    if call == 1 {
        proxy.arm(pattern, Fault::CutAfter);
        diesel::sql_query(write)
            .bind::<BigInt, _>(id + 10)
            .execute(conn)
            .await?;
    }
    Ok(())
}

/// The proxy cuts the connection after a plain `INSERT` reached the server
/// (it runs, then meets the end of the stream and rolls back): replayed
/// once, `Ok`, only the second attempt's item. Holds; the same `INSERT`
/// with `commit` in a comment is checked by
/// [`found_cut_write_with_a_commit_word_is_not_replayed`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_cut_write_is_replayed_once() {
    let env = env(1).await;
    let (proxy, pool) = proxied(&env).await;
    let calls = AtomicU32::new(0);
    let write = "INSERT INTO items VALUES ($1) /* plain-cut */";
    let r = cut_write(&pool, 5000, write, "plain-cut", &proxy, &calls).await;
    let committed = items_in(&env, "5001, 5002, 5003, 5010").await;
    let second = items_in(&env, "5002").await;
    assert!(
        r.is_ok() && count(&calls) == 2 && committed == 1 && second == 1,
        "{r:?} after {} call(s), {committed} item(s)",
        count(&calls)
    );
    no_session_left_in_a_transaction(&env, "plain cut").await;
}

/// Found, and fixed (the same regression through a cut): an `INSERT` whose text holds
/// `commit` in a comment is cut after it reached the server, which rolls
/// it back. idem answers `TransactionEnded { committed: true }` and does
/// not replay; nothing is committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_cut_write_with_a_commit_word_is_not_replayed() {
    let env = env(1).await;
    let (proxy, pool) = proxied(&env).await;
    let calls = AtomicU32::new(0);
    let write = "INSERT INTO items VALUES ($1) /* word-cut: commit */";
    let r = cut_write(&pool, 5100, write, "word-cut", &proxy, &calls).await;
    let committed = items_in(&env, "5101, 5102, 5103, 5110").await;
    no_session_left_in_a_transaction(&env, "word cut").await;
    assert!(
        r.is_ok() && count(&calls) == 2 && committed == 1,
        "answered {r:?} after {} call(s), {committed} item(s) committed",
        count(&calls)
    );
}

/// Sleeps 5 s in a statement whose text says `commit`, under a 300 ms
/// deadline; `drop_at`: the body drops it at that point and returns
/// `Ok` (the server's `statement_timeout` still ends it).
#[retryable(max = 4, deadline_ms = 300)]
async fn sleeps_past_deadline(
    conn: &mut AsyncPgConnection,
    drop_at: Option<u64>,
) -> Result<(), AppError> {
    let sleep = diesel::sql_query("SELECT pg_sleep(5), 'commit' AS deadline_sleep");
    match drop_at {
        None => {
            sleep.execute(conn).await?;
        }
        Some(ms) => {
            let _ = tokio::time::timeout(Duration::from_millis(ms), sleep.execute(conn)).await;
        }
    }
    Ok(())
}

/// The deadline path: a statement that says `commit` cut by the call's own
/// deadline (the server's `statement_timeout` ends it), awaited or dropped
/// by the body 100 ms before: `Exhausted` as a timeout, and the one pooled
/// connection is reused, outside a transaction, its timeouts reset. Holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deadline_cut_statement_saying_commit_keeps_the_pooled_connection() {
    let env = env(1).await;
    let before = env.assert_pool_clean().await;
    for drop_at in [None, Some(200)] {
        let r = sleeps_past_deadline(&env.pool, drop_at).await;
        assert!(
            matches!(&r, Err(AppError::Idem(idem::Error::Exhausted { last_cause, .. }))
                if last_cause.is_timeout()),
            "drop at {drop_at:?}: {r:?}"
        );
        assert_eq!(env.running_after("deadline_sleep").await, 0);
        let after = env.assert_pool_clean().await;
        assert_eq!(
            after, before,
            "drop at {drop_at:?}: the connection was closed"
        );
        let mut conn = env.pool.get().await.unwrap();
        let timeout: String = sql::<Text>("SELECT current_setting('statement_timeout')")
            .get_result(&mut *conn)
            .await
            .unwrap();
        assert_eq!(timeout, "0", "drop at {drop_at:?}");
    }
}
