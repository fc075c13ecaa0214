//! A hostile pass on session 34's two changes: the session-key check that
//! polls tokio-postgres's cancel request once (b1ef75c), and the cancel a
//! failing `ROLLBACK` now sends (d73e31d). Effects are counted in the
//! database. Tests named `found_..` reproduced a defect this pass found,
//! fixed since.
use super::attack_savepoint::no_session_left_in_a_transaction;
use super::attack_seal::{lock_free_within, pool_serves};
use super::*;
use diesel_async::{AnsiTransactionManager, TransactionManager};
use futures_util::future::{join, join3};
use idem::pool::PooledConnection;
use std::sync::atomic::AtomicBool;

fn replaced<T>(r: &Result<T, AppError>) -> bool {
    matches!(r, Err(AppError::Idem(idem::Error::ConnectionReplaced)))
}

fn ended<T>(r: &Result<T, AppError>) -> Option<bool> {
    match r {
        Err(AppError::Idem(idem::Error::TransactionEnded { committed })) => Some(*committed),
        _ => None,
    }
}

/// Adds 1 to counter `id`, naps `nap_ms` in the transaction; its backend.
#[retryable(max = 4, deadline_ms = 8000)]
async fn bump(
    conn: &mut AsyncPgConnection,
    id: i64,
    nap_ms: i64,
    calls: &AtomicU32,
) -> Result<i32, AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    diesel::sql_query("UPDATE counters SET n = n + 1 WHERE id = $1")
        .bind::<BigInt, _>(id)
        .execute(conn)
        .await?;
    if nap_ms > 0 {
        diesel::sql_query(format!("SELECT pg_sleep({nap_ms} / 1000.0)"))
            .execute(conn)
            .await?;
    }
    Ok(backend_pid(conn).await?)
}

/// A pool of one, 60 calls: every fifth, its idle backend was terminated
/// before the call; every seventh, its backend is terminated while the body
/// naps (the attempt's `ROLLBACK` then fails and, since d73e31d, cancels
/// through the dead backend's key while the replay connects). Never a
/// `ConnectionReplaced` on the connection idem lent; every call `Ok`, each
/// counted once in the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_of_one_never_reads_its_own_connection_as_swapped() {
    let env = env(1).await;
    let calls = AtomicU32::new(0);
    let mut last = bump(&env.pool, 1, 0, &calls).await.expect("first call");
    for i in 1..60 {
        if i % 5 == 0 && i % 7 != 0 {
            env.client
                .query_one("SELECT pg_terminate_backend($1)", &[&last])
                .await
                .unwrap();
            env.wait_for_backend_to_exit(last).await;
        }
        let r = if i % 7 == 0 {
            let (r, ()) = join(
                bump(&env.pool, 1, 400, &calls),
                env.terminate_when_sleeping(last),
            )
            .await;
            r
        } else {
            bump(&env.pool, 1, 0, &calls).await
        };
        assert!(!replaced(&r), "call {i}: a false ConnectionReplaced");
        last = r.unwrap_or_else(|e| panic!("call {i}: {e:?}"));
    }
    assert_eq!(env.counter(1).await.0, 60, "each call committed once");
    env.assert_pool_clean().await;
}

/// What a storm answered, and what it committed (counter 2).
#[derive(Debug, Default)]
struct Storm {
    ok: i64,
    unknown: i64,
    replaced: i64,
    savepoint_open: i64,
    other: Vec<String>,
    committed: i64,
}

/// Eight callers, 15 calls each, on a pool of two, a killer terminating
/// every backend of the pool every 120 ms.
async fn storm(env: &Env) -> Storm {
    let stop = AtomicBool::new(false);
    let calls = AtomicU32::new(0);
    let caller = |_| async {
        let mut rs = vec![];
        for _ in 0..15 {
            rs.push(bump(&env.pool, 2, 20, &calls).await);
        }
        rs
    };
    let mut killed: Vec<i32> = vec![];
    let killer = async {
        while !AtomicBool::load(&stop, Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(120)).await;
            // Not once more after the callers are done: a kill then closes
            // an idle pooled connection under the pool check below, which
            // checks out without idem's retry of a connection broken idle.
            if AtomicBool::load(&stop, Ordering::SeqCst) {
                break;
            }
            let rows = env
                .client
                .query(
                    "SELECT pid, pg_terminate_backend(pid) FROM pg_stat_activity \
                     WHERE datname = current_database() AND pid <> pg_backend_pid()",
                    &[],
                )
                .await
                .unwrap();
            killed = rows.iter().map(|r| r.get(0)).collect();
        }
    };
    let work = async {
        let all = futures_util::future::join_all((0..8).map(caller)).await;
        stop.store(true, Ordering::SeqCst);
        all
    };
    let (all, ()) = join(work, killer).await;
    // The last kill may still be under way as the last caller finishes
    // (`pg_terminate_backend` only signals): until its backends are gone,
    // an idle pooled connection may be one of them and not know it yet.
    let until = Instant::now() + Duration::from_secs(10);
    let alive = "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1)";
    while env
        .client
        .query_one(alive, &[&killed])
        .await
        .unwrap()
        .get::<_, i64>(0)
        > 0
    {
        assert!(Instant::now() < until, "killed backends never went");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let before = env.counter(2).await.0;
    let mut s = Storm::default();
    for r in all.into_iter().flatten() {
        match r {
            Ok(_) => s.ok += 1,
            Err(AppError::Idem(idem::Error::CommitUnknown { .. })) => s.unknown += 1,
            Err(AppError::Idem(idem::Error::ConnectionReplaced)) => s.replaced += 1,
            Err(AppError::Idem(idem::Error::SavepointOpen)) => s.savepoint_open += 1,
            Err(e) => s.other.push(format!("{e:?}")),
        }
    }
    s.committed = before;
    env.client
        .batch_execute("UPDATE counters SET n = 0 WHERE id = 2")
        .await
        .unwrap();
    no_session_left_in_a_transaction(env, "kills on a small pool").await;
    s
}

/// Under the storm no call answers `ConnectionReplaced` (the key check
/// never misreads a connection the pool made, killed or fresh), and every
/// call that answered `Ok` committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_callers_and_kills_on_a_small_pool_never_read_as_swapped() {
    let env = env(2).await;
    let s = storm(&env).await;
    assert!(s.replaced == 0 && s.committed >= s.ok, "{s:?}");
    env.assert_pool_clean().await;
}

/// Fixed. docs/retryable.md "A savepoint left open": `SavepointOpen` means
/// "nothing commits". A body that opens no savepoint, whose `COMMIT` is
/// answered (committed) just before its backend is terminated, gets
/// `SavepointOpen`: `Tx::send_commit` (idem-runtime/src/tx/mod.rs:300)
/// asks `still_open`, which is true when the connection is closed
/// (`PoolableConnection::is_broken` includes `is_closed()`, tx/mod.rs:505).
/// Seen under the storm: `ok` 117, `committed` 119, 2 `SavepointOpen`.
/// `still_open` now asks diesel-async's transaction manager alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_a_commit_followed_by_a_kill_answers_savepoint_open() {
    let env = env(2).await;
    for round in 0..3 {
        let s = storm(&env).await;
        assert!(
            s.savepoint_open == 0 && s.committed <= s.ok + s.unknown,
            "round {round}: {s:?}"
        );
    }
}

/// What a body swaps in for the connection it was lent.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    /// `AsyncPgConnection::establish` on the URL (sslmode prefer).
    Establish,
    /// The same with `sslmode=disable`: a bare cancel request of its own.
    EstablishNoTls,
    /// A checkout of a second idem pool on an odd URL (`localhost`,
    /// `application_name`, `options`).
    OtherPool,
    /// A second checkout of the same pool.
    SamePool,
}

enum Hand {
    Own(AsyncPgConnection),
    Pooled(PooledConnection),
}

impl Hand {
    fn conn(&mut self) -> &mut AsyncPgConnection {
        match self {
            Hand::Own(c) => c,
            Hand::Pooled(c) => c,
        }
    }
}

fn with_params(url: &str, params: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{params}")
}

/// Swaps in `kind` at `when` (0: before writing item `id`, 1: after it, 2:
/// after it, out, back and out again, item `id + 2` written on idem's
/// connection in hand), begins a transaction on the one swapped in and
/// writes item `id + 1` there; returns `Ok`.
#[retryable(max = 3, deadline_ms = 10000)]
#[allow(clippy::too_many_arguments)]
async fn swaps_in(
    conn: &mut AsyncPgConnection,
    kind: Kind,
    when: u8,
    url: &str,
    same: &Pool,
    other: &Pool,
    id: i64,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    let mut hand = match kind {
        Kind::Establish => Hand::Own(AsyncPgConnection::establish(url).await.expect("connect")),
        Kind::EstablishNoTls => {
            let url = with_params(url, "sslmode=disable");
            Hand::Own(AsyncPgConnection::establish(&url).await.expect("connect"))
        }
        Kind::OtherPool => Hand::Pooled(other.get().await.expect("other pool")),
        Kind::SamePool => Hand::Pooled(same.get().await.expect("same pool")),
    };
    if when == 0 {
        std::mem::swap(conn, hand.conn());
    }
    // Before the swap on idem's connection; after it, autocommitted.
    insert_item(conn, id).await?;
    if when == 1 {
        std::mem::swap(conn, hand.conn());
    }
    if when == 2 {
        // Out, a write on idem's connection in hand, back, and out again.
        std::mem::swap(conn, hand.conn());
        insert_item(hand.conn(), id + 2).await?;
        std::mem::swap(conn, hand.conn());
        std::mem::swap(conn, hand.conn());
    }
    AnsiTransactionManager::begin_transaction(conn).await?;
    insert_item(conn, id + 1).await?;
    drop(hand);
    Ok(())
}

/// Every kind of connection swapped in, at every moment, is found:
/// `ConnectionReplaced` at the first attempt, nothing written on idem's
/// connection or in the transaction begun on the one swapped in commits,
/// no session is left in a transaction, and the pool serves. (`OtherPool`'s
/// odd URL also checks that its own connections are not read as swapped:
/// a call on it commits.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_swap_kind_at_every_moment_is_found() {
    let env = env(2).await;
    let url = env.db.pool_url().replace("127.0.0.1", "localhost");
    let odd = with_params(
        &url,
        "application_name=odd%20app&options=-c%20work_mem%3D8MB",
    );
    let config = PoolConfig {
        max_size: 2,
        wait_timeout: Duration::from_secs(10),
        pooler: test_pool::pooler(&env.db),
        ..PoolConfig::default()
    };
    let other = build_pool_with(&odd, &config).expect("odd pool");
    let calls = AtomicU32::new(0);
    let ok = bump(&other, 3, 0, &calls).await;
    assert!(
        ok.is_ok() && count(&calls) == 1,
        "the odd pool's own call: {ok:?}"
    );
    let mut id = 7000;
    for kind in [
        Kind::Establish,
        Kind::EstablishNoTls,
        Kind::OtherPool,
        Kind::SamePool,
    ] {
        for when in 0..3 {
            let calls = AtomicU32::new(0);
            let r = swaps_in(
                &env.pool,
                kind,
                when,
                env.db.url(),
                &env.pool,
                &other,
                id,
                &calls,
            )
            .await;
            let items = items_from(&env, id).await;
            // Written on idem's connection: nothing. On the one swapped in:
            // only an autocommitted write before the swap (when 0).
            let kept: &[i64] = if when == 0 { &[id] } else { &[] };
            assert!(
                replaced(&r) && count(&calls) == 1 && items == kept,
                "{kind:?} at {when}: {r:?} after {} calls, items {items:?}",
                count(&calls)
            );
            no_session_left_in_a_transaction(&env, &format!("{kind:?} at {when}")).await;
            pool_serves(&env, &format!("{kind:?} at {when}")).await;
            id += 10;
        }
    }
    let again = AtomicU32::new(0);
    assert!(
        bump(&other, 3, 0, &again).await.is_ok(),
        "the odd pool serves"
    );
}

/// Row-locks counter 3, then hands idem's connection to `held` (outside the
/// call), swapping in one of its own, and naps (or panics).
#[retryable(max = 1, deadline_ms = 10000)]
async fn swaps_out_and_waits(
    conn: &mut AsyncPgConnection,
    url: &str,
    held: &Mutex<Vec<AsyncPgConnection>>,
    panics: bool,
) -> Result<(), AppError> {
    bump_counter_3_in(conn).await?;
    let mut own = AsyncPgConnection::establish(url).await.expect("connect");
    std::mem::swap(conn, &mut own);
    held.lock().unwrap().push(own);
    if panics {
        panic!("the body panics holding idem's connection elsewhere");
    }
    tokio::time::sleep(Duration::from_secs(30)).await;
    Ok(())
}

/// Fixed. docs/retryable.md: "a cancelled call (its future dropped) cancels the
/// running statement and closes the connection", and the connection a body
/// took away is closed "wherever it is now held (a task of its own, ..), so
/// idem's transaction rolls back and its locks go at once". A body that
/// swapped idem's connection out and whose call is then dropped by a
/// timeout (or panics) leaves idem's transaction open on the connection it
/// took away, its row lock held as long as that is held: `Tx`'s drop
/// (idem-runtime/src/tx/mod.rs:585) closes only the connection in the slot
/// (the one swapped in, whose key it cancels with) and never asks whether
/// it is still the session idem began on, so `replaced()` (the sever of
/// the taken connection, its cancel) never runs. It now asks, and does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_a_dropped_swapping_call_leaves_its_transaction_open_elsewhere() {
    let env = env(2).await;
    let mut bad = vec![];
    for panics in [false, true] {
        let held = Arc::new(Mutex::new(Vec::new()));
        let (pool, url, h) = (env.pool.clone(), env.db.url().to_owned(), held.clone());
        let call = tokio::spawn(async move { swaps_out_and_waits(&pool, &url, &h, panics).await });
        let _ = tokio::time::timeout(Duration::from_millis(700), async {
            while held.lock().unwrap().is_empty() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        })
        .await;
        call.abort();
        let _ = call.await;
        let freed = lock_free_within(&env).await;
        // Still held by the body's side: the transaction must end anyway. A
        // closed session takes a moment to leave `pg_stat_activity` (behind
        // PgBouncer two hops, and no cancel is sent there), so poll briefly.
        let open = idem_testing::stats::no_session_idle_in_transaction(
            &env.client,
            Duration::from_secs(1),
        )
        .await;
        if !freed.as_ref().is_ok_and(|t| *t < Duration::from_secs(1)) || open.is_err() {
            bad.push(format!("panics {panics}: lock {freed:?}, {open:?}"));
        }
        held.lock().unwrap().clear();
        no_session_left_in_a_transaction(&env, "held dropped").await;
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
    assert_eq!(
        env.counter(3).await.0,
        200,
        "only the side session's writes"
    );
}

/// Writes item `id`, then ends idem's transaction with `end` after a nap and
/// pipelines a tagged 30 s sleep behind it; once the end is answered, drops
/// both and writes item `id + 1` (the seal refuses it).
#[retryable(max = 3, deadline_ms = 2000)]
async fn ends_with_a_sleep_behind(
    conn: &mut AsyncPgConnection,
    end: &str,
    tag: &str,
    id: i64,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    insert_item(conn, id).await?;
    let end = format!("SELECT pg_sleep(0.2); {end}");
    let sleep = format!("SELECT pg_sleep(30) /* {tag} */");
    let shared: &AsyncPgConnection = conn;
    let (mut a, mut b) = (shared, shared);
    let both = join(a.batch_execute(&end), b.batch_execute(&sleep));
    let _ = tokio::time::timeout(Duration::from_millis(600), both).await;
    insert_item(conn, id + 1).await?;
    Ok(())
}

/// Naps 300 ms in the transaction, then writes item `id`.
#[retryable(max = 1, deadline_ms = 5000)]
async fn naps_then_writes(conn: &mut AsyncPgConnection, id: i64) -> Result<(), AppError> {
    diesel::sql_query("SELECT pg_sleep(0.3)")
        .execute(conn)
        .await?;
    insert_item(conn, id).await?;
    Ok(())
}

/// The cancel a failing `ROLLBACK` sends stops only what the ended
/// transaction's backend still runs: for every end (a prepared transaction
/// fails here: `max_prepared_transactions` is 0, which ends it too), the
/// tagged sleep is gone within 2 s, while a bystander session's sleep and
/// the next call on the pool of one (a fresh connection, at once) run to
/// their end. Never `Ok`; `committed: false` only when nothing committed;
/// the item written after the end never; the first item exactly after a
/// `COMMIT`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cancel_of_a_failed_rollback_stops_only_its_own_backend() {
    let env = env(1).await;
    if env.db.via().is_transaction_pooling() {
        // No cancel is sent behind a transaction pooler, and there a request
        // pipelined behind a plain `ROLLBACK` or `COMMIT` runs on a server
        // connection PgBouncer has handed back to its pool: the next client
        // given it waits behind the sleep (see `Pooler::TransactionPooling`).
        // What this test asserts holds only on a direct connection.
        return;
    }
    let bystander = side_connection(env.db.url()).await;
    let mut id = 8000;
    let ends = [
        "ROLLBACK AND CHAIN",
        "COMMIT AND CHAIN",
        "ROLLBACK",
        "COMMIT",
        "PREPARE TRANSACTION 'p34'",
    ];
    for round in 0..3 {
        for end in ends {
            let tag = format!("idem-s34-{id}");
            let calls = AtomicU32::new(0);
            let side = bystander.query_one("SELECT pg_sleep(1.5) IS NULL", &[]);
            let call = ends_with_a_sleep_behind(&env.pool, end, &tag, id, &calls);
            let (r, side) = join(
                async {
                    let r = call.await;
                    // The next user, at once, on a fresh connection.
                    (r, naps_then_writes(&env.pool, id + 5).await)
                },
                side,
            )
            .await;
            let (r, next) = r;
            assert!(
                side.is_ok(),
                "{end} ({round}): the bystander was cancelled: {side:?}"
            );
            assert!(
                next.is_ok(),
                "{end} ({round}): the next call was cancelled: {next:?}"
            );
            let items = items_from(&env, id).await;
            let committed = end.starts_with("COMMIT");
            let first = items.contains(&id);
            assert!(
                ended(&r).is_some_and(|c| c || !first) && first == committed,
                "{end} ({round}): {r:?}, items {items:?}"
            );
            assert!(!items.contains(&(id + 1)), "{end}: written after the end");
            assert!(items.contains(&(id + 5)), "{end}: the next call committed");
            assert_eq!(count(&calls), 1, "{end}: never replayed");
            let left = env.running_after(&tag).await;
            assert_eq!(left, 0, "{end}: the sleep behind the end still runs");
            no_session_left_in_a_transaction(&env, end).await;
            id += 10;
        }
    }
    pool_serves(&env, "after the ends").await;
}

/// Writes item `id`, then `PREPARE TRANSACTION` (refused here, which ends
/// the transaction) with a write of item `id + 1` pipelined behind it, both
/// awaited; returns what the pair returned, or `Ok`. A nap pipelined ahead
/// of the pair holds the end's answer back 200 ms: the seal refuses what is
/// written after the end is answered, and without the nap a worker thread
/// descheduled between sending the end and the write (seen once in CI) let
/// the answer in first, so the write was refused instead of pipelined.
#[retryable(max = 3, deadline_ms = 3000)]
async fn prepares_with_a_write_behind(
    conn: &mut AsyncPgConnection,
    id: i64,
    returns_err: bool,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    insert_item(conn, id).await?;
    let write = format!("INSERT INTO items VALUES ({})", id + 1);
    let shared: &AsyncPgConnection = conn;
    let (mut nap, mut a, mut b) = (shared, shared, shared);
    let (napped, prepared, written) = join3(
        nap.batch_execute("SELECT pg_sleep(0.2)"),
        a.batch_execute("PREPARE TRANSACTION 'p34'"),
        b.batch_execute(&write),
    )
    .await;
    napped?;
    if returns_err {
        prepared?;
        written?;
    }
    Ok(())
}

/// A failed `PREPARE TRANSACTION` ends idem's transaction (rolled back); a
/// write pipelined behind it would run outside any transaction and commit:
/// it never goes out (the seal closes once the end is sent, and a write is
/// cut after it). The call says so: `TransactionEnded { committed: false
/// }`, never `Ok`, never replayed, and neither item is there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_prepare_with_a_write_behind_holds_the_write_back() {
    let env = env(1).await;
    for (i, returns_err) in [false, true].into_iter().enumerate() {
        let id = 9000 + 10 * i as i64;
        let calls = AtomicU32::new(0);
        let r = prepares_with_a_write_behind(&env.pool, id, returns_err, &calls).await;
        let items = items_from(&env, id).await;
        assert_eq!(items, Vec::<i64>::new(), "the write behind never went out");
        assert!(
            ended(&r) == Some(false) && count(&calls) == 1,
            "returns_err {returns_err}: {r:?}, items {items:?}"
        );
        pool_serves(&env, "prepare").await;
    }
}
