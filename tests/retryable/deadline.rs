//! The deadline bounds every statement of an attempt: a row lock held by
//! another session, or a statement that runs long, ends the call with a typed
//! error (503) soon after its deadline, and never pins the pool.

use idem::http::HttpStatus;
use idem_testing::proxy::{Fault, Proxy};

use super::*;

const DEADLINE: Duration = Duration::from_millis(300);

#[retryable(max = 4, deadline_ms = 300)]
async fn bump(conn: &mut AsyncPgConnection, id: i64) -> Result<(), AppError> {
    diesel::sql_query("UPDATE counters SET n = n + 1 WHERE id = $1")
        .bind::<BigInt, _>(id)
        .execute(conn)
        .await?;
    Ok(())
}

/// A deadline of 2 s: the first attempt's lock wait (half the time left)
/// gives up after about 1 s, and the replay still has room on a loaded
/// machine to take the lock once the holder lets go.
#[retryable(max = 4, deadline_ms = 2000)]
async fn bump_counted(
    conn: &mut AsyncPgConnection,
    id: i64,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    diesel::sql_query("UPDATE counters SET n = n + 1 WHERE id = $1")
        .bind::<BigInt, _>(id)
        .execute(conn)
        .await?;
    Ok(())
}

/// A session outside the pool that holds row `id` of `counters` locked in
/// an open transaction, until it rolls back.
async fn hold_row(env: &Env, id: i64) -> tokio_postgres::Client {
    let holder = side_connection(env.db.url()).await;
    holder
        .batch_execute(&format!(
            "BEGIN; SELECT n FROM counters WHERE id = {id} FOR UPDATE"
        ))
        .await
        .unwrap();
    holder
}

/// Open one of `pool`'s connections and give it back: a test that times a
/// call against a short deadline should not also time the connect.
async fn warm(pool: &Pool) {
    drop(pool.get().await.expect("a connection"));
}

/// The loop gave up because time ran out: a typed error, answered 503.
fn timed_out<T: std::fmt::Debug>(result: &Result<T, AppError>) -> bool {
    match result {
        Err(AppError::Idem(err @ idem::Error::Exhausted { last_cause, .. })) => {
            matches!(last_cause.as_str(), "lock_timeout" | "deadline_exceeded")
                && err.http_status() == 503
        }
        _ => false,
    }
}

/// Any of idem's own errors that a client should retry later (503).
fn busy<T: std::fmt::Debug>(result: &Result<T, AppError>) -> bool {
    matches!(result, Err(AppError::Idem(err)) if err.http_status() == 503)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_row_locked_by_another_session_cannot_pin_the_pool() {
    const POOL: usize = 3;
    let env = env(POOL).await;
    let holder = hold_row(&env, 1).await;
    // Connected before the clock starts: a connect slowed by a loaded
    // machine counts against the 300 ms deadline.
    warm(&env.pool).await;

    let started = Instant::now();
    let result = tokio::time::timeout(Duration::from_secs(10), bump(&env.pool, 1))
        .await
        .expect("the call ended: its lock wait is bounded by its deadline");
    let elapsed = started.elapsed();
    assert!(timed_out(&result), "{result:?}");
    assert!(
        elapsed < DEADLINE * 5,
        "{elapsed:?} for a {DEADLINE:?} deadline"
    );

    // More calls than connections, all on the locked row; an unrelated read
    // through the same pool goes through meanwhile.
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..POOL + 2 {
        let pool = env.pool.clone();
        calls.spawn(async move { bump(&pool, 1).await });
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    let read_started = Instant::now();
    let read = tokio::time::timeout(Duration::from_secs(3), async {
        let mut conn = env.pool.get().await.expect("a connection");
        // In a transaction, as everything on a pooled connection should be:
        // behind transaction pooling (IDEM_TEST_VIA=pgbouncer) a bare
        // statement's Parse and Bind may reach different server connections.
        conn.transaction::<i64, DieselError, _>(async |conn| {
            sql::<BigInt>("SELECT n FROM counters WHERE id = 2")
                .get_result::<i64>(conn)
                .await
        })
        .await
    })
    .await
    .expect("an unrelated read got a connection while the row stays locked");
    assert_eq!(read.unwrap(), 0);
    let read_took = read_started.elapsed();
    let all_ended = tokio::time::timeout(Duration::from_secs(10), async {
        let mut results = Vec::new();
        while let Some(joined) = calls.join_next().await {
            results.push(joined.unwrap());
        }
        results
    })
    .await
    .expect("every call ended");
    for result in &all_ended {
        assert!(busy(result), "{result:?}");
    }
    assert!(read_took < Duration::from_secs(3), "{read_took:?}");

    // The lock is released: the row holds exactly the one call made now.
    holder.batch_execute("ROLLBACK").await.unwrap();
    bump(&env.pool, 1).await.unwrap();
    assert_eq!(
        env.counter(1).await.0,
        1,
        "only the call after the release wrote"
    );
    env.assert_pool_clean().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lock_held_briefly_is_waited_for_or_replayed() {
    let env = env(2).await;

    // Released after 100 ms: well within the wait the attempt allows.
    let holder = hold_row(&env, 1).await;
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        holder.batch_execute("ROLLBACK").await.unwrap();
    });
    let calls = AtomicU32::new(0);
    bump_counted(&env.pool, 1, &calls).await.unwrap();
    release.await.unwrap();
    assert_eq!(count(&calls), 1, "one attempt: it waited for the lock");
    assert_eq!(env.counter(1).await.0, 1);

    // Released only once the second attempt runs: the first one's lock wait
    // gave up (lock_timeout, a share of the deadline) and was replayed.
    let holder = hold_row(&env, 2).await;
    let calls = Arc::new(AtomicU32::new(0));
    let release = {
        let calls = calls.clone();
        tokio::spawn(async move {
            let until = Instant::now() + Duration::from_secs(3);
            while count(&calls) < 2 && Instant::now() < until {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            holder.batch_execute("ROLLBACK").await.unwrap();
        })
    };
    let result = bump_counted(&env.pool, 2, &calls).await;
    release.await.unwrap();
    result.unwrap();
    assert_eq!(
        count(&calls),
        2,
        "the lock wait gave up once and was replayed"
    );
    assert_eq!(
        env.counter(2).await.0,
        1,
        "the effect is in the database once"
    );
    env.assert_pool_clean().await;
}

#[retryable(max = 4, deadline_ms = 300)]
async fn insert_then_sleep_5s(
    conn: &mut AsyncPgConnection,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    insert_item(conn, 500 + i64::from(attempt_no())).await?;
    diesel::sql_query("SELECT pg_sleep(5)")
        .execute(conn)
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slow_statement_is_cancelled_by_the_server_at_the_deadline() {
    let env = env(2).await;
    let calls = AtomicU32::new(0);
    warm(&env.pool).await;
    let started = Instant::now();
    let result = insert_then_sleep_5s(&env.pool, &calls).await;
    let elapsed = started.elapsed();
    assert!(timed_out(&result), "{result:?}");
    assert!(
        elapsed < DEADLINE * 5,
        "{elapsed:?} for a {DEADLINE:?} deadline"
    );
    assert_eq!(count(&calls), 1, "no time was left for another attempt");
    assert_eq!(
        env.scalar_i64("SELECT count(*) FROM items WHERE id >= 500")
            .await,
        0,
        "nothing was written"
    );
    // No backend still runs the sleep.
    assert_eq!(
        env.scalar_i64(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND query LIKE '%pg_sleep(5)%' AND state = 'active' AND pid <> pg_backend_pid()"
        )
        .await,
        0
    );
    env.assert_pool_clean().await;
}

#[derive(Debug)]
struct Settings {
    pid: i32,
    statement_timeout: String,
    lock_timeout: String,
}

async fn settings(conn: &mut AsyncPgConnection) -> Result<Settings, DieselError> {
    let (pid, statement_timeout, lock_timeout) = sql::<(Integer, Text, Text)>(
        "SELECT pg_backend_pid(), current_setting('statement_timeout'), \
         current_setting('lock_timeout')",
    )
    .get_result(conn)
    .await?;
    Ok(Settings {
        pid,
        statement_timeout,
        lock_timeout,
    })
}

#[retryable(max = 4, deadline_ms = 300)]
async fn settings_inside(conn: &mut AsyncPgConnection) -> Result<Settings, AppError> {
    Ok(settings(conn).await?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_timeouts_hold_inside_the_attempt_and_never_leak_to_the_pool() {
    // One connection: every call and the check below share its backend.
    let env = env(1).await;
    warm(&env.pool).await;
    let inside = settings_inside(&env.pool).await.unwrap();
    assert_ne!(inside.statement_timeout, "0", "{inside:?}");
    assert_ne!(inside.lock_timeout, "0", "{inside:?}");
    // Also after attempts that ended on the timeouts.
    let holder = hold_row(&env, 1).await;
    assert!(timed_out(&bump(&env.pool, 1).await));
    let calls = AtomicU32::new(0);
    assert!(timed_out(&insert_then_sleep_5s(&env.pool, &calls).await));
    holder.batch_execute("ROLLBACK").await.unwrap();

    let mut conn = env.pool.get().await.unwrap();
    let after = settings(&mut conn).await.unwrap();
    assert_eq!(after.pid, inside.pid, "the same pooled connection");
    assert_eq!(after.statement_timeout, "0", "{after:?}");
    assert_eq!(after.lock_timeout, "0", "{after:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_timeouts_travel_with_begin_in_one_round_trip() {
    let db = TestDatabase::create().await.unwrap();
    let proxy = Proxy::start(db.url()).await.unwrap();
    let pool = pool_of_one(proxy.url());
    warm(&pool).await;
    // One chunk from the client holding BEGIN and both settings: one simple
    // query, one round trip. The fault itself does nothing (a zero hold).
    proxy.arm(
        "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL statement_timeout = '",
        Fault::HoldAnswer(Duration::ZERO),
    );
    let inside = settings_inside(&pool).await.unwrap();
    assert_eq!(
        proxy.fired(),
        1,
        "BEGIN went without its settings: {inside:?}"
    );
}

/// Ends idem's transaction with `end`, then asks the server for the next
/// value of `probe` (which no rollback takes back) and sleeps past the
/// deadline: statements that, after a chain, would run without idem's
/// bounds, and after a `COMMIT` or `ROLLBACK` in a transaction of their own.
/// The deadline leaves room for the fresh connect each call needs (the seal
/// closed the last one) on a loaded machine.
#[retryable(max = 4, deadline_ms = 2000)]
async fn ends_then_runs(
    conn: &mut AsyncPgConnection,
    end: &str,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    conn.batch_execute(end).await?;
    conn.batch_execute("SELECT nextval('probe'); SELECT pg_sleep(3)")
        .await?;
    Ok(())
}

/// Nothing a body sends after it ended idem's transaction reaches the
/// server (the sequence does not move), whatever the body makes of the
/// error: the call answers `TransactionEnded`, once, and the pool is clean.
#[tokio::test]
async fn what_a_body_sends_after_ending_the_transaction_never_runs() {
    let env = env(1).await;
    env.client
        .batch_execute("CREATE SEQUENCE probe; CREATE SEQUENCE same")
        .await
        .unwrap();
    for (end, committed) in [
        ("ROLLBACK AND CHAIN", false),
        ("ABORT AND CHAIN", false),
        ("COMMIT AND CHAIN", true),
        ("COMMIT", true),
        ("ROLLBACK", false),
        ("BEGIN", false),
        // In the same request as the end, a statement still runs, outside
        // any transaction, and commits: the call says so.
        ("ROLLBACK; SELECT nextval('same')", true),
    ] {
        let calls = AtomicU32::new(0);
        let result = ends_then_runs(&env.pool, end, &calls).await;
        assert!(
            matches!(&result, Err(AppError::Idem(idem::Error::TransactionEnded { committed: c })) if *c == committed),
            "{end}: {result:?}"
        );
        assert_eq!(count(&calls), 1, "{end}: never replayed");
        let moved = env
            .scalar_i64("SELECT count(*) FROM pg_sequences WHERE sequencename = 'probe' AND last_value IS NOT NULL")
            .await;
        assert_eq!(moved, 0, "{end}: a statement after the end ran");
    }
    let same = env
        .scalar_i64("SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM same")
        .await;
    assert_eq!(same, 1, "the statement sent with the end ran once");
    env.assert_pool_clean().await;
}

/// Ends idem's transaction with `ROLLBACK AND CHAIN` after a nap, and a
/// long sleep behind it in the same request: it runs in the chained
/// transaction, which has none of idem's bounds. (A request of its own
/// behind the end never goes out: the seal closes once the end is sent.)
/// Once the body stops waiting, one more statement is sent, which the seal
/// refuses, closing the connection.
#[retryable(max = 4, deadline_ms = 2000)]
async fn chains_a_sleep_then_sends(
    conn: &mut AsyncPgConnection,
    tag: &str,
) -> Result<(), AppError> {
    let both = format!("SELECT pg_sleep(0.2); ROLLBACK AND CHAIN; SELECT pg_sleep(30) /* {tag} */");
    let cut = tokio::time::timeout(Duration::from_millis(600), conn.batch_execute(&both)).await;
    assert!(cut.is_err(), "the sleep still runs");
    conn.batch_execute("SELECT 1").await?;
    Ok(())
}

/// A statement a body sent with its own end of the transaction, in the
/// same request, still runs when the seal closes the connection (the
/// server notices a closed socket only when it next writes): it is
/// cancelled, not left to run unbounded in the chained transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_body_sent_with_its_end_is_cancelled() {
    let env = env(1).await;
    let tag = "idem-test-chained-sleep";
    let started = Instant::now();
    let result = chains_a_sleep_then_sends(&env.pool, tag).await;
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert!(
        matches!(
            &result,
            Err(AppError::Idem(idem::Error::TransactionEnded { .. }))
        ),
        "{result:?}"
    );
    if env.db.via().is_transaction_pooling() {
        // No cancel goes through a transaction pooler (see
        // `Pooler::TransactionPooling`): only the call's answer is asserted.
        return;
    }
    let left = env.running_after(tag).await;
    assert_eq!(
        left, 0,
        "the sleep pipelined behind the end still runs 2 s later"
    );
}

#[retryable(max = 4, deadline_ms = 300)]
async fn quick_counted(
    conn: &mut AsyncPgConnection,
    id: i64,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    insert_item(conn, id).await?;
    Ok(())
}

/// "Waiting for a pool connection is bounded by the deadline too, and no
/// attempt begins after it": with the only connection of a pool (whose own
/// wait is 10 s) held elsewhere, a 300 ms call answers a pool timeout or an
/// exhausted deadline well before the pool's own wait, runs nothing, and
/// the pool serves the next call once the connection comes back. (From
/// session 56's hostile pass.)
#[tokio::test]
async fn the_checkout_wait_is_bounded_by_the_deadline() {
    let env = env(1).await;
    let calls = AtomicU32::new(0);
    let held = env.pool.get().await.expect("the pool's only connection");
    let started = Instant::now();
    let result = quick_counted(&env.pool, 5951, &calls).await;
    let elapsed = started.elapsed();
    drop(held);
    assert!(
        matches!(
            &result,
            Err(AppError::Idem(idem::Error::Pool(_)))
                | Err(AppError::Idem(idem::Error::Exhausted {
                    last_cause: RetryCause::DeadlineExceeded,
                    ..
                }))
        ),
        "{result:?}"
    );
    // Half the pool's own wait: what tells the two apart, with room for a
    // loaded machine.
    assert!(elapsed < Duration::from_secs(5), "{elapsed:?} for 300 ms");
    assert_eq!(AtomicU32::load(&calls, Ordering::SeqCst), 0, "no body ran");
    quick_counted(&env.pool, 5952, &calls)
        .await
        .expect("the pool serves the next call");
    let sql = "SELECT count(*) FROM items WHERE id IN (5951, 5952)";
    assert_eq!(env.scalar_i64(sql).await, 1);
    env.assert_pool_clean().await;
}
