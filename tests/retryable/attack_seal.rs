//! A hostile pass on the seal (nothing a body sends after ending idem's
//! transaction goes out) and the sever (the connection a body took away is
//! closed wherever it is held). Tests named `found_..` showed defects, fixed
//! since (each says what it saw).
use super::attack_savepoint::no_session_left_in_a_transaction;
use super::*;
use futures_util::future::{join, join_all};

/// Correct SQL sent by hand, request by request (`{5}`: base + 5, an item
/// a savepoint undoes; a leading `!`: the request fails, as meant).
const BY_HAND: [&[&str]; 5] = [
    &[
        "SAVEPOINT s1; INSERT INTO items VALUES ({5}); SAVEPOINT s2; \
         INSERT INTO items VALUES ({6}); ROLLBACK TO SAVEPOINT s2; RELEASE SAVEPOINT s2; \
         ROLLBACK TO SAVEPOINT s1; RELEASE SAVEPOINT s1",
        "SAVEPOINT x",
        "!INSERT INTO items VALUES ({0})",
        "ROLLBACK TO SAVEPOINT x",
        "INSERT INTO items VALUES ({7})",
        "ROLLBACK TO SAVEPOINT x; RELEASE SAVEPOINT x",
    ],
    &[
        "DECLARE cur CURSOR FOR SELECT id FROM items ORDER BY id",
        "FETCH 1 FROM cur; MOVE FORWARD ALL IN cur",
        "CLOSE cur",
    ],
    &["LISTEN seal_chan", "NOTIFY seal_chan, 'x'", "UNLISTEN *"],
    &[
        "DO $$ BEGIN INSERT INTO items VALUES ({5}); PERFORM 1 / 0; \
       EXCEPTION WHEN division_by_zero THEN NULL; END $$",
    ],
    &[
        "PREPARE seal_p(bigint) AS SELECT $1 + 1",
        "EXECUTE seal_p(1); DEALLOCATE seal_p",
    ],
];

/// The shapes of a correct body (no transaction control of its own)
/// between its first write (`base`) and its last (`base + 2`): 0 nested
/// savepoints rolled back, 1 a failed statement in one, 2 a pipeline of 40
/// reads and a batch, 3 a statement future dropped mid-flight, then
/// [`BY_HAND`]. What it writes at `base + 5..` is never committed.
async fn middle(conn: &mut AsyncPgConnection, shape: usize, base: i64) -> Result<(), AppError> {
    match shape {
        0 => {
            let outer = conn
                .transaction::<(), DieselError, _>(async |c| {
                    insert_item(c, base + 5).await?;
                    let inner = c
                        .transaction::<(), DieselError, _>(async |c| {
                            insert_item(c, base + 6).await?;
                            Err(DieselError::RollbackTransaction)
                        })
                        .await;
                    assert!(inner.is_err());
                    c.transaction::<(), DieselError, _>(async |c| {
                        insert_item(c, base + 7).await.map(drop)
                    })
                    .await?;
                    Err(DieselError::RollbackTransaction)
                })
                .await;
            assert!(outer.is_err());
        }
        1 => {
            let dup = conn
                .transaction::<usize, DieselError, _>(async |c| insert_item(c, base).await)
                .await;
            assert!(dup.is_err(), "a duplicate key fails");
        }
        2 => {
            let shared: &AsyncPgConnection = conn;
            let reads = (0..40).map(|_| async move {
                let mut c = shared;
                sql::<BigInt>("SELECT count(*) FROM items")
                    .get_result::<i64>(&mut c)
                    .await
            });
            let (reads, batch) = join(join_all(reads), async move {
                let mut c = shared;
                c.batch_execute("SELECT 1; SELECT 2").await
            })
            .await;
            batch?;
            reads.into_iter().try_for_each(|r| r.map(drop))?;
        }
        3 => {
            let query = diesel::sql_query("SELECT pg_sleep(0.3)");
            let cut = tokio::time::timeout(Duration::from_millis(30), query.execute(conn));
            assert!(cut.await.is_err(), "dropped mid-flight");
        }
        n => {
            for request in BY_HAND[n - 4] {
                let sql = ["0", "5", "6", "7"]
                    .iter()
                    .fold(request.to_string(), |q, k| {
                        let id = base + k.parse::<i64>().unwrap();
                        q.replace(&format!("{{{k}}}"), &id.to_string())
                    });
                let done = conn.batch_execute(sql.trim_start_matches('!')).await;
                assert_eq!(done.is_err(), sql.starts_with('!'), "{sql}: {done:?}");
            }
        }
    }
    Ok(())
}

/// Every shape, under every isolation level: committed once, with exactly
/// its own two writes; nothing is refused, nothing replayed, and the pool
/// of one is clean after each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn correct_bodies_never_trip_the_seal() {
    let env = env(1).await;
    let mut bad = vec![];
    let levels = [
        Isolation::ReadCommitted,
        Isolation::RepeatableRead,
        Isolation::Serializable,
    ];
    for (l, isolation) in levels.into_iter().enumerate() {
        for shape in 0..4 + BY_HAND.len() {
            let base = 1000 + 100 * l as i64 + 10 * shape as i64;
            let calls = AtomicU32::new(0);
            let policy = RetryPolicy::new()
                .isolation(isolation)
                .max_attempts(3)
                .deadline(Duration::from_secs(10));
            let calls_ref = &calls;
            let result: Result<(), AppError> = retry(&env.pool, policy, "correct", |conn| {
                async move {
                    calls_ref.fetch_add(1, Ordering::SeqCst);
                    insert_item(conn, base).await?;
                    middle(conn, shape, base).await?;
                    insert_item(conn, base + 2).await?;
                    Ok(())
                }
                .scope_boxed()
            })
            .await;
            let items = items_from(&env, base).await;
            if result.is_err() || items != [base, base + 2] || count(&calls) != 1 {
                bad.push(format!(
                    "{isolation:?}/{shape:?}: {result:?}, items {items:?}, {} calls",
                    count(&calls)
                ));
            }
            env.assert_pool_clean().await;
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// Attempt 1 deadlocks inside a savepoint and returns that error.
#[retryable(max = 3, deadline_ms = 10000)]
async fn deadlock_in_savepoint(conn: &mut AsyncPgConnection, id: i64) -> Result<u32, AppError> {
    insert_item(conn, id).await?;
    if attempt_no() == 1 {
        conn.transaction::<(), AppError, _>(async |c| fail_with(c, RetryCause::Deadlock).await)
            .await?;
    }
    Ok(attempt_no())
}

#[retryable(max = 3, deadline_ms = 10000)]
async fn fails_at_commit(conn: &mut AsyncPgConnection, calls: &AtomicU32) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    diesel::sql_query("INSERT INTO trips_at_commit VALUES (1)")
        .execute(conn)
        .await?;
    Ok(())
}

/// Failures of a correct body the loop promises to replay still are:
/// a deadlock inside a savepoint returned as the body's error, and a
/// serialization failure raised by idem's own `COMMIT` (which ends the
/// transaction on the server, after idem unguarded it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn correct_failures_are_still_replayed_under_the_seal() {
    let env = env(1).await;
    assert_eq!(deadlock_in_savepoint(&env.pool, 500).await.unwrap(), 2);
    assert_eq!(items_from(&env, 500).await, [500]);
    env.client
        .batch_execute(
            "CREATE SEQUENCE trip; CREATE TABLE trips_at_commit (id bigint);
             CREATE FUNCTION trip() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
                 IF nextval('trip') = 1 THEN
                     RAISE EXCEPTION 'at commit' USING ERRCODE = 'serialization_failure';
                 END IF; RETURN NULL; END $$;
             CREATE CONSTRAINT TRIGGER trip AFTER INSERT ON trips_at_commit
                 DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION trip();",
        )
        .await
        .unwrap();
    let calls = AtomicU32::new(0);
    fails_at_commit(&env.pool, &calls).await.unwrap();
    assert_eq!(count(&calls), 2, "replayed once");
    assert_eq!(
        env.scalar_i64("SELECT count(*) FROM trips_at_commit").await,
        1
    );
    env.assert_pool_clean().await;
}

/// Ends idem's transaction with `end`, then (after `nap`) writes again,
/// or panics (`nap` of an hour).
#[retryable(max = 3, deadline_ms = 5000)]
async fn ends_and_goes_on(
    conn: &mut AsyncPgConnection,
    end: &str,
    nap: Duration,
    id: i64,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    insert_item(conn, id).await?;
    conn.batch_execute(end).await?;
    if nap == PANIC {
        panic!("the body panics after ending the transaction");
    }
    tokio::time::sleep(nap).await;
    let _ = insert_item(conn, id + 1).await;
    Ok(())
}

const PANIC: Duration = Duration::from_secs(3600);

/// A bare `UPDATE` in a call: attempts it took.
#[retryable(max = 3, deadline_ms = 5000)]
async fn plain_bump(conn: &mut AsyncPgConnection, calls: &AtomicU32) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    bump_counter_3_in(conn).await?;
    Ok(())
}

/// The next call on the pool of one, and a bare checkout, work at once.
pub(super) async fn pool_serves(env: &Env, what: &str) {
    let calls = AtomicU32::new(0);
    let r = plain_bump(&env.pool, &calls).await;
    assert!(r.is_ok() && count(&calls) == 1, "{what}: {r:?}");
    env.assert_pool_clean().await;
    no_session_left_in_a_transaction(env, what).await;
}

/// Sealed connections never go back: a body that ended the transaction by
/// hand and then went on, failed, panicked or was cancelled (at many points
/// of its call, by a timeout around it), or a `COMMIT` left unanswered,
/// leaves a pool of one that serves the next call at its first attempt;
/// nothing after the end is committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_sealed_connection_goes_back_to_the_pool() {
    let env = env(1).await;
    let mut id = 2000;
    for end in ["ROLLBACK", "COMMIT", "ROLLBACK AND CHAIN", "BEGIN"] {
        let calls = AtomicU32::new(0);
        let r = ends_and_goes_on(&env.pool, end, Duration::ZERO, id, &calls).await;
        let said = matches!(r, Err(AppError::Idem(idem::Error::TransactionEnded { .. })));
        assert!(said && count(&calls) == 1, "{end}: {r:?}");
        let kept = if end == "COMMIT" { 1 } else { 0 };
        assert_eq!(items_from(&env, id).await.len(), kept, "{end}");
        pool_serves(&env, end).await;
        id += 10;
    }
    // A panic after the end, in a task of its own.
    let pool = env.pool.clone();
    let panicked = tokio::spawn(async move {
        let calls = AtomicU32::new(0);
        ends_and_goes_on(&pool, "COMMIT", PANIC, 2100, &calls).await
    })
    .await;
    assert!(panicked.is_err_and(|e| e.is_panic()));
    assert_eq!(items_from(&env, 2100).await, [2100], "committed by hand");
    pool_serves(&env, "panic").await;
    // Cancelled around the end, and while the body naps after it.
    for (i, cancel_ms) in [0u64, 1, 2, 3, 5, 8, 12, 20, 40, 80]
        .into_iter()
        .enumerate()
    {
        for end in ["ROLLBACK", "ROLLBACK AND CHAIN"] {
            let calls = AtomicU32::new(0);
            let nap = Duration::from_millis(30);
            let call = ends_and_goes_on(&env.pool, end, nap, 3000 + 10 * i as i64, &calls);
            let _ = tokio::time::timeout(Duration::from_millis(cancel_ms), call).await;
            pool_serves(&env, &format!("{end} cancelled after {cancel_ms} ms")).await;
        }
    }
    assert_eq!(
        env.scalar_i64("SELECT count(*) FROM items WHERE id >= 3000")
            .await,
        0
    );
    // A `COMMIT` unanswered past `commit_timeout_ms`.
    let r = unanswered_commit(&env.pool).await;
    let unknown = matches!(r, Err(AppError::Idem(idem::Error::CommitUnknown { .. })));
    assert!(unknown, "{r:?}");
    pool_serves(&env, "commit unanswered").await;
}

#[retryable(max = 1, deadline_ms = 5000, commit_timeout_ms = 300)]
async fn unanswered_commit(conn: &mut AsyncPgConnection) -> Result<(), AppError> {
    diesel::sql_query("INSERT INTO slow_commit VALUES (1)")
        .execute(conn)
        .await?;
    Ok(())
}

/// Ends idem's transaction with `end` and, in a request of its own sent
/// before the end is answered, asks the sequence `probe` (which no rollback
/// takes back) for a value and sleeps 2 s, then writes an item in a third.
/// `dropped`: the end (with a nap in its request) is a future dropped by a
/// timeout before its answer, the rest sent after; else all three are
/// pipelined (`&AsyncPgConnection`, diesel-async's documented pipelining).
#[retryable(max = 3, deadline_ms = 800)]
async fn ends_then_sends(
    conn: &mut AsyncPgConnection,
    end: &str,
    dropped: bool,
    id: i64,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    let insert = format!("INSERT INTO items VALUES ({id})");
    let probe = "SELECT nextval('probe'); SELECT pg_sleep(2)";
    if dropped {
        // A nap long enough that the 20 ms timer fires first on a loaded
        // machine too.
        let end = format!("{end}; SELECT pg_sleep(0.3)");
        let cut = tokio::time::timeout(Duration::from_millis(20), conn.batch_execute(&end));
        assert!(cut.await.is_err(), "dropped before its answer");
        conn.batch_execute(probe).await?;
        conn.batch_execute(&insert).await?;
        return Ok(());
    }
    let shared: &AsyncPgConnection = conn;
    let (mut a, mut b, mut c) = (shared, shared, shared);
    let ((ended, probed), inserted) = join(
        join(a.batch_execute(end), b.batch_execute(probe)),
        c.batch_execute(&insert),
    )
    .await;
    ended?;
    probed?;
    inserted?;
    Ok(())
}

/// Found by this pass: the docs said only a statement in the same request
/// as the end still runs. The seal is set when the end's answer is read, so
/// a request written before that (pipelined, or after a future dropped
/// before its answer) goes out, and cannot be called back: after `COMMIT`
/// or `ROLLBACK` it runs outside any transaction and commits (the sequence
/// moves, the item is there); after `ROLLBACK AND CHAIN` it runs in the
/// chained transaction without idem's bounds (`pg_sleep(2)` past the 800 ms
/// deadline). The docs now say so; what holds, and is asserted, is that the
/// call never says nothing was committed when something was, and never
/// answers `Ok`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_sent_before_the_end_is_answered_run_and_are_counted() {
    let env = env(1).await;
    env.client
        .batch_execute("CREATE SEQUENCE probe")
        .await
        .unwrap();
    let mut bad = vec![];
    let mut id = 4000;
    for dropped in [false, true] {
        for end in ["ROLLBACK", "COMMIT", "ROLLBACK AND CHAIN"] {
            id += 1;
            let calls = AtomicU32::new(0);
            let r = ends_then_sends(&env.pool, end, dropped, id, &calls).await;
            let moved = env
                .scalar_i64("SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM probe")
                .await;
            let items = items_from(&env, id).await.len();
            // Never `Ok`; `committed: false` only when nothing committed.
            let told = match &r {
                Err(AppError::Idem(idem::Error::TransactionEnded { committed })) => {
                    *committed || items == 0
                }
                _ => false,
            };
            if !told || count(&calls) != 1 {
                bad.push(format!(
                    "{end} (dropped: {dropped}): {r:?}; probe at {moved}, item committed: {items}"
                ));
            }
            env.client
                .batch_execute("ALTER SEQUENCE probe RESTART")
                .await
                .unwrap();
            pool_serves(&env, end).await;
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// `ROLLBACK`, with a slow `INSERT` pipelined behind it; once the end is
/// answered, one more statement (which the seal refuses, closing the
/// connection before the `INSERT`'s answer is read).
#[retryable(max = 3, deadline_ms = 5000)]
async fn ends_with_a_slow_insert_behind(
    conn: &mut AsyncPgConnection,
    id: i64,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    let shared: &AsyncPgConnection = conn;
    let (mut a, mut b, mut c) = (shared, shared, shared);
    let slow = format!("INSERT INTO items SELECT {id} FROM pg_sleep(0.3)");
    let end_then = async move {
        a.batch_execute("ROLLBACK").await?;
        c.batch_execute("SELECT 1").await
    };
    let (first, second) = join(end_then, b.batch_execute(&slow)).await;
    first?;
    second?;
    Ok(())
}

/// Fixed. `TransactionEnded { committed }`: "`committed` is true when some
/// of what it wrote was committed", false meaning "nothing was committed"
/// (a caller may then safely send the request again). An `INSERT` sent
/// behind the body's `ROLLBACK`, before its answer, runs outside any
/// transaction and commits; the seal closes the connection at the body's
/// next write, before that `INSERT`'s answer is read, so the call said
/// `committed: false` while the item was there. A request unanswered when
/// the seal closes the connection now counts as committed; the rollback
/// then cancels it, so the item may or may not be there ("was, or may
/// have been, committed"). (When the `INSERT` is written after the end is
/// answered, the seal refuses it: nothing runs, `committed: false`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_committed_false_while_a_write_behind_the_end_committed() {
    let env = env(1).await;
    let calls = AtomicU32::new(0);
    let r = ends_with_a_slow_insert_behind(&env.pool, 4500, &calls).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let items = items_from(&env, 4500).await.len();
    no_session_left_in_a_transaction(&env, "slow insert behind").await;
    let said = match &r {
        Err(AppError::Idem(idem::Error::TransactionEnded { committed })) => Some(*committed),
        _ => None,
    };
    assert_eq!(count(&calls), 1, "never replayed");
    // Never "nothing was committed" while the item is there.
    assert!(
        said.is_some_and(|committed| committed || items == 0),
        "{r:?}, and {items} item committed"
    );
    env.assert_pool_clean().await;
}

/// Swaps idem's connection out for one of its own (autocommit), writes
/// item `id` through the slot (that one), then runs into a serialization
/// failure on idem's connection, now in its hand, and returns that error.
#[retryable(max = 3, deadline_ms = 10000)]
async fn swaps_then_fails_transiently(
    conn: &mut AsyncPgConnection,
    url: &str,
    id: i64,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    let n = calls.fetch_add(1, Ordering::SeqCst);
    let mut hand = AsyncPgConnection::establish(url).await.unwrap();
    std::mem::swap(conn, &mut hand);
    insert_item(conn, id + i64::from(n)).await?;
    fail_with(&mut hand, RetryCause::SerializationFailure).await
}

/// Fixed. docs/retryable.md "The connection is the one lent": a body that
/// swaps the connection it was lent "gets `idem::Error::ConnectionReplaced`
/// (500), not replayed" (the error's docs: "the body would do the same
/// again"). A swapping body that returns an error the server raised on
/// idem's connection (in its hand) is replayed instead, swap and all, until
/// the budget is spent: each replay's write through the connection it
/// swapped in commits again (3 items, `Exhausted`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_a_swapping_body_that_fails_transiently_is_replayed() {
    let env = env(2).await;
    let calls = AtomicU32::new(0);
    let r = swaps_then_fails_transiently(&env.pool, env.db.pool_url(), 5000, &calls).await;
    let items = items_from(&env, 5000).await;
    let replaced = matches!(r, Err(AppError::Idem(idem::Error::ConnectionReplaced)));
    no_session_left_in_a_transaction(&env, "swap then 40001").await;
    assert!(
        replaced && count(&calls) == 1 && items.len() == 1,
        "{r:?} after {} calls; items written through the swapped-in connection: {items:?}",
        count(&calls)
    );
}

/// Side session: set counter 3 under a 2 s lock timeout; how long it took,
/// or the error.
pub(super) async fn lock_free_within(env: &Env) -> Result<Duration, String> {
    let started = Instant::now();
    env.client
        .batch_execute(
            "SET lock_timeout = '2s'; UPDATE counters SET n = n + 100 WHERE id = 3; RESET lock_timeout",
        )
        .await
        .map(|()| started.elapsed())
        .map_err(|e| format!("{e}"))
}

/// Row-locks counter 3, swaps idem's connection with a checkout of another
/// idem pool, and hands that checkout (idem's connection in it) to a task
/// that uses it 300 ms later, then drops it back to its pool.
#[retryable(max = 1, deadline_ms = 10000)]
async fn swaps_with_another_pool(
    conn: &mut AsyncPgConnection,
    other: &Pool,
    later: &Mutex<Option<tokio::task::JoinHandle<bool>>>,
) -> Result<(), AppError> {
    bump_counter_3_in(conn).await?;
    let mut checkout = other.get().await.unwrap();
    std::mem::swap(conn, &mut **checkout);
    let task = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        pid_in_tx(&mut checkout).await.is_ok()
    });
    *later.lock().unwrap() = Some(task);
    Ok(())
}

/// A backend pid, read in a transaction of its own (behind transaction
/// pooling a bare statement's `Parse` and `Bind` may reach different server
/// connections).
async fn pid_in_tx(conn: &mut AsyncPgConnection) -> Result<i32, DieselError> {
    conn.transaction::<i32, DieselError, _>(async |c| backend_pid(c).await)
        .await
}

/// Severs only what it must: while a body swaps idem's connection with a
/// checkout of a second pool, a correct call on the first pool and a
/// correct user of the second pool's other checkout go on unharmed; the
/// call answers `ConnectionReplaced`, its row lock is free at once, the
/// task's later use of the taken connection fails, and both pools serve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sever_hits_only_the_taken_connection() {
    let env = env(2).await;
    let direct = !env.db.via().is_transaction_pooling();
    let other = test_pool::test_pool(&env.db, 2, Duration::from_secs(10));
    let mut bystander = other.get().await.unwrap();
    let before = pid_in_tx(&mut bystander).await.unwrap();
    let later = Mutex::new(None);
    let calls = AtomicU32::new(0);
    let (r, correct) = join(swaps_with_another_pool(&env.pool, &other, &later), async {
        let mut conn = env.pool.get().await.unwrap();
        let read = pid_in_tx(&mut conn).await;
        drop(conn);
        (read, plain_bump_other(&env.pool, &calls).await)
    })
    .await;
    assert!(
        matches!(r, Err(AppError::Idem(idem::Error::ConnectionReplaced))),
        "{r:?}"
    );
    assert!(correct.0.is_ok() && correct.1.is_ok(), "{correct:?}");
    let freed = lock_free_within(&env).await;
    assert!(
        freed.as_ref().is_ok_and(|t| *t < Duration::from_secs(1)),
        "{freed:?}"
    );
    let task = later.lock().unwrap().take().unwrap();
    assert!(!task.await.unwrap(), "the taken connection is closed");
    let after = pid_in_tx(&mut bystander).await;
    assert!(after.is_ok(), "the bystander's connection works: {after:?}");
    if direct {
        assert_eq!(after.ok(), Some(before), "on the same backend");
    }
    drop(bystander);
    let mut again = other.get().await.unwrap();
    assert!(pid_in_tx(&mut again).await.is_ok(), "the other pool serves");
    drop(again);
    assert_eq!(env.counter(3).await.0, 100, "only the side session's write");
    assert_eq!(env.counter(2).await.0, 1, "the correct call committed once");
    assert_eq!(count(&calls), 1);
    no_session_left_in_a_transaction(&env, "two pools").await;
    env.assert_pool_clean().await;
}

#[retryable(max = 3, deadline_ms = 5000)]
async fn plain_bump_other(conn: &mut AsyncPgConnection, calls: &AtomicU32) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    diesel::sql_query("UPDATE counters SET n = n + 1 WHERE id = 2")
        .execute(conn)
        .await?;
    Ok(())
}
