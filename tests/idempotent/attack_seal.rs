//! A hostile pass on the seal (f668a94) and the sever (4b876a4) through
//! `#[idempotent]`: a correct body never trips the seal, in local mode or
//! in external mode's phases; a body that ends idem's transaction by hand
//! must never get a record. Tests named `found_..` showed defects, fixed
//! since (each says what it saw).

use super::attack_ext::records_of;
use super::attack_savepoint::no_session_left_in_a_transaction;
use super::attack_swap::pid;
use super::*;
use futures_util::future::{join, join_all};

/// A correct body: its effect, a nested savepoint rolled back (a write in
/// it), a failed statement undone to a savepoint, pipelined reads, a
/// statement whose future it dropped mid-flight, its effect again.
async fn correct_middle(conn: &mut AsyncPgConnection, tag: &str) -> Result<(), AppError> {
    insert_effect(conn, tag, 1).await?;
    let undone = format!("{tag}-undone");
    let rolled = conn
        .transaction::<(), diesel::result::Error, _>(async |c| {
            insert_effect(c, &undone, 1).await.map_err(|_| {
                diesel::result::Error::QueryBuilderError("the undone write failed".into())
            })?;
            let failed = c
                .transaction::<(), diesel::result::Error, _>(async |c| {
                    c.batch_execute("SELECT 1 / 0").await
                })
                .await;
            assert!(failed.is_err());
            Err(diesel::result::Error::RollbackTransaction)
        })
        .await;
    assert!(rolled.is_err());
    let shared: &AsyncPgConnection = conn;
    let reads = (0..5).map(|_| async move {
        let mut c = shared;
        c.batch_execute("SELECT count(*) FROM effects").await
    });
    for r in join_all(reads).await {
        r?;
    }
    let dropped = tokio::time::timeout(
        Duration::from_millis(20),
        diesel::sql_query("SELECT pg_sleep(0.2)").execute(conn),
    )
    .await;
    assert!(dropped.is_err());
    insert_effect(conn, tag, 2).await?;
    Ok(())
}

#[idempotent(key = key, scope = none, fingerprint(key))]
#[retryable(max = 3, deadline_ms = 10000)]
async fn correct_local(
    conn: &mut AsyncPgConnection,
    key: &str,
    calls: &AtomicU32,
) -> Result<i64, AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    correct_middle(conn, key).await?;
    Ok(2)
}

#[idempotent(key = key, operation = "seal.ext.ok", fingerprint(key), mode = external, scope = none)]
#[retryable(max = 3, deadline_ms = 10000)]
async fn correct_external(
    db: &mut Deferred<'_>,
    key: &str,
    calls: &AtomicU32,
) -> Result<String, AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    let conn = db.conn().await?;
    correct_middle(conn, key).await?;
    Ok("receipt".to_owned())
}

/// Local mode and external mode (claim, body, outcome record): a correct
/// body with savepoints, a failed statement, pipelining and a dropped
/// future commits its two effects once, with its record; the repeat
/// replays (body not run again); the pool of one is not left sealed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn correct_bodies_commit_once_and_replay_under_the_seal() {
    let env = env(1).await;
    for external in [false, true] {
        let key = format!("seal-ok-{external}");
        let runs = AtomicU32::new(0);
        let (first, again) = if external {
            let a = correct_external(&env.pool, &key, &runs).await;
            let b = correct_external(&env.pool, &key, &runs).await;
            (a.map(|v| v.replayed), b.map(|v| v.replayed))
        } else {
            let a = correct_local(&env.pool, &key, &runs).await;
            let b = correct_local(&env.pool, &key, &runs).await;
            (a.map(|v| v.replayed), b.map(|v| v.replayed))
        };
        assert!(
            matches!((&first, &again), (Ok(false), Ok(true))),
            "external {external}: {first:?} then {again:?}"
        );
        assert_eq!(calls(&runs), 1, "external {external}: the body ran once");
        assert_eq!(env.effects(&key).await, 2, "external {external}");
        assert_eq!(env.effects(&format!("{key}-undone")).await, 0);
        assert_eq!(env.state(&key).await.as_deref(), Some("completed"));
        no_session_left_in_a_transaction(&env, &key).await;
    }
}

/// External phase 3: the body writes its effect in the outcome's
/// transaction, then commits it by hand and returns `Ok`.
#[idempotent(key = key, operation = "seal.ext.commit", fingerprint(key), mode = external, scope = none)]
#[retryable(max = 3, deadline_ms = 10000)]
async fn ext_commits_by_hand(
    db: &mut Deferred<'_>,
    key: &str,
    calls: &AtomicU32,
) -> Result<String, AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    let conn = db.conn().await?;
    insert_effect(conn, key, 1).await?;
    conn.batch_execute("COMMIT").await?;
    Ok("receipt".to_owned())
}

/// The outcome record never goes out after the body's own `COMMIT` (the
/// seal refuses it): `TransactionEnded { committed: true }`, not replayed,
/// the key not completed but held as outcome unknown, so the repeat does
/// not run the body again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn external_commit_by_hand_in_phase_three_leaves_the_key_held() {
    let env = env(2).await;
    let runs = AtomicU32::new(0);
    let r = ext_commits_by_hand(&env.pool, "ext-hand", &runs).await;
    assert!(
        matches_idem(&r, "TransactionEnded { committed: true }"),
        "{r:?}"
    );
    assert_eq!(calls(&runs), 1, "not replayed");
    assert_eq!(env.effects("ext-hand").await, 1, "committed by hand");
    assert_eq!(env.state("ext-hand").await.as_deref(), Some("unknown"));
    let again = ext_commits_by_hand(&env.pool, "ext-hand", &runs).await;
    assert!(again.is_err(), "{again:?}");
    assert_eq!(calls(&runs), 1, "the repeat did not run the body");
    assert_eq!(env.effects("ext-hand").await, 1);
    no_session_left_in_a_transaction(&env, "ext-hand").await;
}

/// Writes its effect (its key's advisory lock is held by idem's
/// transaction); with `sleeper`, hands idem's connection to a task that
/// runs `pg_sleep(20)` on it, swapping in one of its own.
#[idempotent(key = key, scope = none, fingerprint(key))]
#[retryable(max = 1, deadline_ms = 10000)]
async fn swaps_out_to_a_sleeper(
    conn: &mut AsyncPgConnection,
    key: &str,
    url: &str,
    sleeper: bool,
    pids: &Mutex<Vec<i32>>,
) -> Result<i64, AppError> {
    insert_effect(conn, key, 1).await?;
    if !sleeper {
        return Ok(1);
    }
    let taken_pid = pid(conn).await;
    pids.lock().unwrap().push(taken_pid);
    let mut taken = AsyncPgConnection::establish(url).await.unwrap();
    std::mem::swap(conn, &mut taken);
    let (sleeping, asleep) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let run = diesel::sql_query("SELECT pg_sleep(20)").execute(&mut taken);
        let mut run = std::pin::pin!(run);
        let _ = tokio::time::timeout(Duration::from_millis(200), &mut run).await;
        let _ = sleeping.send(());
        let _ = run.await;
    });
    let _ = asleep.await;
    Ok(1)
}

/// Fixed. docs/retryable.md ("The connection is the one lent") and
/// 4b876a4: the connection the body took away is closed "wherever it is
/// now held (a task of its own, ..), so idem's transaction rolls back and
/// its locks go at once" (before, "the key's next call waited out its
/// deadline"). Held by a task running a statement, it is not: the sever
/// closes the socket, no cancel is sent, and the backend sleeps on with
/// idem's transaction and the key's advisory lock, so the key's next call
/// waits (past 3 s here). Through PgBouncer (`client_connection_check_
/// interval` = 1 s on its server) it holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_the_keys_lock_outlives_the_sever_while_a_statement_runs() {
    let env = env(2).await;
    let pids = Mutex::new(vec![]);
    let url = env.db.pool_url().to_owned();
    let r = swaps_out_to_a_sleeper(&env.pool, "sleeper", &url, true, &pids).await;
    assert!(matches_idem(&r, "ConnectionReplaced"), "{r:?}");
    let started = Instant::now();
    let next = tokio::time::timeout(
        Duration::from_secs(3),
        swaps_out_to_a_sleeper(&env.pool, "sleeper", &url, false, &pids),
    )
    .await;
    let took = started.elapsed();
    let taken = pids.lock().unwrap().iter().next().copied().unwrap_or(0);
    env.client
        .batch_execute(&format!("SELECT pg_cancel_backend({taken})"))
        .await
        .unwrap();
    let fresh = matches!(&next, Ok(Ok(v)) if !v.replayed);
    assert!(
        fresh && env.effects("sleeper").await == 1,
        "the key's next call after {took:?}: {next:?}"
    );
}

/// `ROLLBACK` with the effect's slow `INSERT` pipelined behind it, then one
/// more statement once the end is answered (refused by the seal). A nap in
/// the `ROLLBACK`'s request holds its answer back 200 ms, so the `INSERT`
/// is written before it on a loaded machine too (written after, the seal
/// refuses it: nothing runs, and the call rightly says so).
#[idempotent(key = key, scope = none, fingerprint(key))]
#[retryable(max = 3, deadline_ms = 10000)]
async fn ends_with_the_effect_behind(
    conn: &mut AsyncPgConnection,
    key: &str,
    calls: &AtomicU32,
) -> Result<i64, AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    let shared: &AsyncPgConnection = conn;
    let (mut a, mut b, mut c) = (shared, shared, shared);
    let slow = format!("INSERT INTO effects (tag, n) SELECT '{key}', 1 FROM pg_sleep(0.3)");
    let end_then = async move {
        a.batch_execute("SELECT pg_sleep(0.2); ROLLBACK").await?;
        c.batch_execute("SELECT 1").await
    };
    let (first, second) = join(end_then, b.batch_execute(&slow)).await;
    first?;
    second?;
    Ok(1)
}

/// Fixed. The call says `TransactionEnded { committed: false }` ("nothing
/// was committed") and leaves the key free, while the effect sent behind
/// the body's `ROLLBACK` committed outside any transaction (the seal closed
/// the connection before its answer was read). The repeat the answer
/// invites runs the body again: two effects for one key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_a_write_behind_the_end_is_reported_uncommitted() {
    let env = env(2).await;
    let runs = AtomicU32::new(0);
    let mut said = vec![];
    for _ in 0..2 {
        let before = env.effects("behind").await;
        let r = ends_with_the_effect_behind(&env.pool, "behind", &runs).await;
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let wrote = env.effects("behind").await - before;
        said.push(format!("{r:?} ({wrote} effect)"));
        // Each call: never "nothing was committed" while its effect is there.
        let says_nothing = matches!(
            r,
            Err(AppError::Idem(idem::Error::TransactionEnded {
                committed: false
            }))
        );
        assert!(
            !(says_nothing && wrote > 0),
            "the calls said {said:?} ({} runs, {} records)",
            calls(&runs),
            records_of(&env, "behind").await
        );
    }
    no_session_left_in_a_transaction(&env, "behind").await;
}

/// Writes its effect, commits it by hand, and declines (a final error,
/// stored under the key).
#[idempotent(key = key, scope = none, fingerprint(key))]
#[retryable(max = 3, deadline_ms = 10000)]
async fn declines_after_commit(
    conn: &mut AsyncPgConnection,
    key: &str,
    calls: &AtomicU32,
) -> Result<i64, AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    insert_effect(conn, key, 1).await?;
    conn.batch_execute("COMMIT").await?;
    Err(AppError::Declined(Declined::InsufficientFunds {
        needed: 1,
    }))
}

/// The same in external mode, phase 3.
#[idempotent(key = key, operation = "seal.ext.decline", fingerprint(key), mode = external, scope = none)]
#[retryable(max = 3, deadline_ms = 10000)]
async fn ext_declines_after_commit(
    db: &mut Deferred<'_>,
    key: &str,
    calls: &AtomicU32,
) -> Result<String, AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    let conn = db.conn().await?;
    insert_effect(conn, key, 1).await?;
    conn.batch_execute("COMMIT").await?;
    Err(AppError::Declined(Declined::InsufficientFunds {
        needed: 1,
    }))
}

/// Fixed. docs/retryable.md "Transaction control is idem's": a body that
/// runs `COMMIT` itself "gets `idem::Error::TransactionEnded { committed }`,
/// never `Ok`". Returning a final error after it, it gets that decline, and
/// the decline is stored as the key's outcome (and replayed) while its
/// effect stays committed: the client is told "declined" for a request
/// whose effect happened. A body error reaches `RetryLoop::finish` as
/// `Step::Again` (store the decline next attempt), whose rollback never
/// asks whether the body ended the transaction (the `Err` arm does).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_a_decline_after_commit_by_hand_is_stored_for_the_key() {
    let env = env(2).await;
    let mut bad = vec![];
    for external in [false, true] {
        let key = format!("decline-{external}");
        let runs = AtomicU32::new(0);
        let (first, again) = if external {
            let a = ext_declines_after_commit(&env.pool, &key, &runs).await;
            let b = ext_declines_after_commit(&env.pool, &key, &runs).await;
            (format!("{:?}", a.map(drop)), format!("{:?}", b.map(drop)))
        } else {
            let a = declines_after_commit(&env.pool, &key, &runs).await;
            let b = declines_after_commit(&env.pool, &key, &runs).await;
            (format!("{:?}", a.map(drop)), format!("{:?}", b.map(drop)))
        };
        let effects = env.effects(&key).await;
        let record = env.record(&key).await;
        let ended = first.contains("TransactionEnded { committed: true }");
        let stored = record
            .as_ref()
            .is_some_and(|r| r.1.as_deref() == Some("error"));
        if !ended || stored {
            bad.push(format!(
                "external {external}: {first} then {again}; {effects} effect(s) committed, \
                 record {record:?}, {} runs",
                calls(&runs)
            ));
        }
        no_session_left_in_a_transaction(&env, &key).await;
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}
