//! Hostile pass (helper, session 71) on the rule "a handler that swaps its
//! lent connection is dead" (docs/jobs.md), in the cases attack_jobs4 left
//! out: handlers of one round (run at once, `join_all`) that exchange their
//! lent connections with each other, in a ring of two or three, each
//! writing through its neighbour's (that job's open transaction) and
//! returning `Ok`, an error or a panic; an exchange undone before
//! returning; a lent connection moved into a spawned task that keeps
//! writing after the handler returned. Every outcome is read from the
//! database (effect rows, `idem_jobs`, `pg_stat_activity`, `pg_locks`, a
//! `FOR UPDATE NOWAIT` on the job rows), never from the worker's `Round`.

use std::collections::HashSet;
use std::sync::Mutex;

use tokio::sync::Barrier;

use super::attack_jobs4::{dead_for_swapping, effects_by, no_open_transaction_left};
use super::*;

/// How a handler of the ring ends, once it has written through its
/// neighbour's connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Ok,
    Err,
    Panic,
}

/// The rendezvous of a ring's handlers: each leaves the connection it was
/// lent in its seat, and takes its left neighbour's.
struct Table {
    barrier: Barrier,
    seats: Mutex<Vec<Option<AsyncPgConnection>>>,
}

impl Table {
    fn new(n: usize) -> Arc<Self> {
        Arc::new(Table {
            barrier: Barrier::new(n),
            seats: Mutex::new((0..n).map(|_| None).collect()),
        })
    }
    fn len(&self) -> usize {
        self.seats.lock().unwrap().len()
    }
    fn put(&self, seat: usize, conn: AsyncPgConnection) {
        let old = self.seats.lock().unwrap()[seat].replace(conn);
        assert!(old.is_none(), "seat {seat} taken");
    }
    fn take(&self, seat: usize) -> AsyncPgConnection {
        self.seats.lock().unwrap()[seat]
            .take()
            .expect("a seat left")
    }
    async fn wait(&self) {
        self.barrier.wait().await;
    }
}

/// What a handler of the ring sends through its neighbour's connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Act {
    /// Its effect, `theirs`.
    Write,
    /// `COMMIT`: the neighbour's transaction, job hold and all.
    Commit,
    /// `ROLLBACK`: the same, undone.
    Rollback,
    /// Nothing.
    Nothing,
}

/// A worker whose handler of [`Compensate`] writes `lent` through the
/// connection it was lent; the first run of each key of `ring` then puts
/// that connection on the table (a fresh one of its own in its place),
/// swaps in its left neighbour's, does `act` through it (in the
/// neighbour's job's transaction, still open: no handler of the ring has
/// returned yet), and, with `undo`, hands it back and swaps its own lent
/// connection in again before ending as `ring` says. Any other key, and a
/// later run, just writes `lent` and returns `Ok`.
fn ring_worker(env: &Env, ring: &[(&'static str, End)], undo: bool) -> Worker {
    let acts: Vec<_> = ring
        .iter()
        .map(|&(key, end)| (key, Act::Write, end))
        .collect();
    acting_ring_worker(env, &acts, undo)
}

/// [`ring_worker`], each handler of the ring doing what its [`Act`] says.
fn acting_ring_worker(env: &Env, ring: &[(&'static str, Act, End)], undo: bool) -> Worker {
    let ring: Vec<(&'static str, Act, End)> = ring.to_vec();
    let table = Table::new(ring.len());
    let first: Arc<Mutex<HashSet<String>>> = Arc::default();
    let url = env.db.url().to_owned();
    Worker::new(env.pool.clone())
        .ladder(Ladder::new([Duration::ZERO; 3]))
        .handle(move |conn, job: &Compensate| {
            let seat = ring
                .iter()
                .position(|(key, _, _)| *key == job.key)
                .filter(|_| first.lock().unwrap().insert(job.key.clone()));
            let act = seat.map(|s| ring[s].1);
            let end = seat.map(|s| ring[s].2);
            let (table, url) = (Arc::clone(&table), url.clone());
            async move {
                record_effect(conn, &job.key, "lent").await?;
                let (Some(seat), Some(act), Some(end)) = (seat, act, end) else {
                    return Ok(());
                };
                let left = (seat + table.len() - 1) % table.len();
                let spare = AsyncPgConnection::establish(&url).await.expect("connect");
                table.put(seat, std::mem::replace(conn, spare));
                table.wait().await;
                let spare = std::mem::replace(conn, table.take(left));
                table.wait().await;
                let wrote = match act {
                    Act::Write => record_effect(conn, &job.key, "theirs").await,
                    Act::Commit => conn.batch_execute("COMMIT").await,
                    Act::Rollback => conn.batch_execute("ROLLBACK").await,
                    Act::Nothing => Ok(()),
                };
                table.wait().await;
                if undo {
                    table.put(left, std::mem::replace(conn, spare));
                    table.wait().await;
                    drop(std::mem::replace(conn, table.take(seat)));
                } else {
                    drop(spare);
                }
                wrote?;
                match end {
                    End::Ok => Ok(()),
                    End::Err => Err(AppError::Refused("after the exchange".into())),
                    End::Panic => panic!("after the exchange"),
                }
            }
            .scope_boxed()
        })
}

/// No session of the test database but the test's own holds a lock on
/// `idem_jobs` or `effects`, or an advisory lock; no job row is locked
/// (row locks do not show in `pg_locks`: each is taken `NOWAIT`).
async fn no_lock_left(env: &Env) {
    env.until(
        "SELECT count(*) FROM pg_locks
         WHERE pid <> pg_backend_pid()
           AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
           AND (locktype = 'advisory'
                OR relation IN ('idem_jobs'::regclass, 'effects'::regclass))",
        0,
    )
    .await;
    env.client
        .batch_execute("BEGIN; SELECT id FROM idem_jobs FOR UPDATE NOWAIT; ROLLBACK")
        .await
        .expect("a job row is still locked");
}

/// One round of `worker`, within 30 s: a hang is a finding.
async fn round_within(worker: &Worker) -> idem::jobs::Round {
    tokio::time::timeout(Duration::from_secs(30), worker.run_once())
        .await
        .expect("the round hung")
        .expect("round")
}

/// Every job of `ring` exchanges its lent connection with its neighbour
/// in one round beside a plain job: each is dead for swapping, none of
/// their writes commits (neither through their own lent connection nor
/// through the neighbour's), no session is left in a transaction and no
/// lock is left; the plain job is done once; a later round claims none
/// of them.
async fn exchange(ring: &[(&'static str, End)]) {
    let env = env().await;
    for (key, _) in ring {
        enqueue_new(&env, key).await;
    }
    enqueue_new(&env, "plain").await;
    let worker = ring_worker(&env, ring, false);
    let round = round_within(&worker).await;
    assert_eq!(round.claimed, ring.len() + 1, "{round:?}");
    for (key, end) in ring {
        dead_for_swapping(&env, key).await;
        assert_eq!(effects_by(&env, key, "lent").await, 0, "{key} ({end:?})");
        assert_eq!(effects_by(&env, key, "theirs").await, 0, "{key} ({end:?})");
    }
    assert_eq!(env.effects("plain").await, 1);
    assert!(env.jobs("plain").await.is_empty());
    no_open_transaction_left(&env).await;
    no_lock_left(&env).await;
    env.make_due_now().await;
    let again = round_within(&worker).await;
    assert_eq!(again.claimed, 0, "{again:?}");
    for (key, _) in ring {
        dead_for_swapping(&env, key).await;
        assert_eq!(env.effects(key).await, 0, "{key}");
    }
    assert_eq!(
        env.scalar("SELECT count(*) FROM effects").await,
        1,
        "the plain job's effect only"
    );
    // The pool (8 connections, some discarded with the swaps) runs on.
    let keys: Vec<String> = (0..12).map(|i| format!("later-{i}")).collect();
    for key in &keys {
        enqueue_new(&env, key).await;
    }
    let plain = super::worker(&env.pool, |_| None);
    let mut done = 0;
    while done < keys.len() {
        let round = round_within(&plain).await;
        assert!(round.claimed > 0, "{round:?}");
        done += round.claimed;
    }
    for key in &keys {
        assert_eq!(env.effects(key).await, 1, "{key}");
        assert!(env.jobs(key).await.is_empty(), "{key}");
    }
    no_open_transaction_left(&env).await;
}

/// Two handlers exchange their lent connections, write through each
/// other's and return `Ok`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack5_two_handlers_exchanging_connections_and_returning_ok_are_dead() {
    exchange(&[("a", End::Ok), ("b", End::Ok)]).await;
}

/// The same, one of them returning an error after the exchange.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack5_an_exchange_where_one_handler_fails_leaves_both_dead() {
    exchange(&[("a", End::Ok), ("b", End::Err)]).await;
}

/// Three handlers in a ring, each with its left neighbour's connection
/// (the middle job's transaction holds the first's write, and so on),
/// ending `Ok`, with an error and with a panic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack5_a_ring_of_three_exchanging_connections_is_all_dead() {
    exchange(&[("x", End::Ok), ("y", End::Err), ("z", End::Panic)]).await;
}

/// Two handlers exchange their lent connections, write through each
/// other's (in the other job's open transaction), exchange them back and
/// return, one `Ok`, one an error: no swap shows at the return (each slot
/// holds the session it was lent), so neither is dead; the `Ok` job is done
/// and the failed one run again. What each wrote went with the other's
/// transaction: the failed run's write through its neighbour's connection
/// committed with the neighbour's end (a write of a failed run, committed,
/// and written again by the next run: `b` twice in all), and the done
/// job's write through the failed one's connection rolled back with it
/// (`a`'s job gone, its `theirs` write never committed).
///
/// Found by the pass: docs/jobs.md promised the handler's writes and the
/// job's end "commit together or not at all" without saying that the swap
/// check is made at the return; a write through another job's lent
/// connection goes with that job's transaction, as one through any
/// connection of the handler's own goes with its own. Documented since
/// (the check compares the session in the slot at the return; a swap
/// undone before it counts as none); pinned here as documented.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack5_an_exchange_undone_before_returning_writes_with_the_other_job() {
    let env = env().await;
    for key in ["a", "b", "plain"] {
        enqueue_new(&env, key).await;
    }
    let worker = ring_worker(&env, &[("a", End::Ok), ("b", End::Err)], true);
    let round = round_within(&worker).await;
    assert_eq!(round.claimed, 3, "{round:?}");
    no_open_transaction_left(&env).await;
    no_lock_left(&env).await;
    assert!(env.jobs("a").await.is_empty(), "{:?}", env.jobs("a").await);
    let jobs = env.jobs("b").await;
    let [(state, 1, Some(error))] = &jobs[..] else {
        panic!("{jobs:?}")
    };
    assert_eq!(state, "due", "{error}");
    assert!(error.contains("after the exchange"), "{error}");
    // `a`'s job committed `a`'s lent write and `b`'s write through it.
    assert_eq!(effects_by(&env, "a", "lent").await, 1);
    assert_eq!(effects_by(&env, "b", "theirs").await, 1);
    // `b`'s rolled back `b`'s lent write and `a`'s write through it.
    assert_eq!(effects_by(&env, "a", "theirs").await, 0);
    assert_eq!(effects_by(&env, "b", "lent").await, 0);
    env.make_due_now().await;
    let again = round_within(&worker).await;
    assert_eq!(again.claimed, 1, "{again:?}");
    assert!(env.jobs("b").await.is_empty());
    assert_eq!(effects_by(&env, "b", "lent").await, 1);
    assert_eq!(env.effects("b").await, 2, "a failed run's write committed");
    assert_eq!(env.effects("plain").await, 1);
}

/// The jobs of `ring` enqueued and run in one round of
/// [`acting_ring_worker`]: each claimed, no session left in a transaction,
/// no lock left.
async fn acting_round(ring: &[(&'static str, Act, End)], undo: bool) -> (Env, Worker) {
    let env = env().await;
    for (key, _, _) in ring {
        enqueue_new(&env, key).await;
    }
    let worker = acting_ring_worker(&env, ring, undo);
    let round = round_within(&worker).await;
    assert_eq!(round.claimed, ring.len(), "{round:?}");
    no_open_transaction_left(&env).await;
    no_lock_left(&env).await;
    (env, worker)
}

/// One handler `COMMIT`s its neighbour's transaction (the neighbour's job
/// hold and `lent` write) through the connection it took from it; the
/// neighbour does nothing through the one it took. Without `undo` both are
/// dead for swapping; with it (each lent connection back in its slot at
/// the return) the one that acted runs normally (done, its effect once)
/// and its neighbour, whose transaction was ended behind its back, is dead
/// all the same (the wire of its session saw the `COMMIT`). Either way the
/// neighbour's `lent` write committed exactly once and is not run again.
async fn commits_the_neighbours_transaction(undo: bool) {
    let ring = [("a", Act::Commit, End::Ok), ("b", Act::Nothing, End::Ok)];
    let (env, worker) = acting_round(&ring, undo).await;
    if undo {
        assert!(env.jobs("a").await.is_empty(), "{:?}", env.jobs("a").await);
        assert_eq!(env.effects("a").await, 1);
        let jobs = env.jobs("b").await;
        assert_eq!(
            jobs.iter().map(|j| (j.0.as_str(), j.1)).collect::<Vec<_>>(),
            [("dead", 1)],
            "{jobs:?}"
        );
    } else {
        dead_for_swapping(&env, "a").await;
        dead_for_swapping(&env, "b").await;
        assert_eq!(env.effects("a").await, 0);
    }
    assert_eq!(effects_by(&env, "b", "lent").await, 1);
    env.make_due_now().await;
    assert_eq!(round_within(&worker).await.claimed, 0);
    assert_eq!(env.effects("b").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack5_committing_the_neighbours_transaction_through_its_connection() {
    commits_the_neighbours_transaction(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack5_committing_the_neighbours_transaction_and_handing_it_back() {
    commits_the_neighbours_transaction(true).await;
}

/// One handler `ROLLBACK`s its neighbour's transaction (the job hold and
/// `lent` write) through the connection it took from it, and both hand the
/// connections back before returning `Ok`: no swap shows, but the
/// neighbour's wire saw its transaction ended, so its run fails as one
/// that ended it itself with nothing committed (its job due again, not
/// ended without its effect), and the next run writes the effect once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack5_rolling_back_the_neighbours_transaction_and_handing_it_back() {
    let ring = [("a", Act::Rollback, End::Ok), ("b", Act::Nothing, End::Ok)];
    let (env, worker) = acting_round(&ring, true).await;
    assert!(env.jobs("a").await.is_empty(), "{:?}", env.jobs("a").await);
    assert_eq!(env.effects("a").await, 1);
    let jobs = env.jobs("b").await;
    let [(state, 1, Some(error))] = &jobs[..] else {
        panic!("{jobs:?}")
    };
    assert_eq!(state, "due", "{error}");
    assert!(error.contains("ended idem's transaction itself"), "{error}");
    assert_eq!(env.effects("b").await, 0);
    env.make_due_now().await;
    let again = round_within(&worker).await;
    assert_eq!(again.claimed, 1, "{again:?}");
    assert!(env.jobs("b").await.is_empty());
    assert_eq!(env.effects("b").await, 1);
}

/// One handler leaves its lent connection for another and returns `Ok` at
/// once (a fresh connection in its slot): its job is dead and that
/// connection closed. The other, later, swaps the closed connection in
/// for its own lent one (dropped), tries to write through it, and returns
/// `Ok`: dead too, its write refused, nothing of either committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack5_a_connection_left_behind_by_a_finished_run_is_dead_in_another() {
    let env = env().await;
    for key in ["leaves", "takes"] {
        enqueue_new(&env, key).await;
    }
    let url = env.db.url().to_owned();
    let left: Arc<Mutex<Option<AsyncPgConnection>>> = Arc::default();
    let refused: Arc<Mutex<Option<String>>> = Arc::default();
    let (left2, refused2) = (Arc::clone(&left), Arc::clone(&refused));
    let worker = Worker::new(env.pool.clone())
        .ladder(Ladder::new([Duration::ZERO; 3]))
        .handle(move |conn, job: &Compensate| {
            let (url, left, refused) = (url.clone(), Arc::clone(&left2), Arc::clone(&refused2));
            async move {
                record_effect(conn, &job.key, "lent").await?;
                if job.key == "leaves" {
                    let fresh = AsyncPgConnection::establish(&url).await.expect("connect");
                    *left.lock().unwrap() = Some(std::mem::replace(conn, fresh));
                    return Ok(());
                }
                // Until the other run has ended (its job dead), read on a
                // connection of this handler's own: a fixed wait is too
                // short on a loaded machine.
                use diesel_async::RunQueryDsl;
                let mut own = AsyncPgConnection::establish(&url).await.expect("connect");
                let ended = "SELECT 1 FROM idem_jobs WHERE key = 'leaves' AND state = 'dead'";
                for _ in 0..600 {
                    if diesel::sql_query(ended).execute(&mut own).await? == 1 {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                let theirs = left.lock().unwrap().take().expect("left behind");
                drop(std::mem::replace(conn, theirs));
                if let Err(e) = record_effect(conn, &job.key, "theirs").await {
                    *refused.lock().unwrap() = Some(e.to_string());
                }
                Ok::<_, AppError>(())
            }
            .scope_boxed()
        });
    let round = round_within(&worker).await;
    assert_eq!(round.claimed, 2, "{round:?}");
    dead_for_swapping(&env, "leaves").await;
    dead_for_swapping(&env, "takes").await;
    let refused = refused.lock().unwrap().clone();
    assert!(refused.is_some(), "the write through a closed connection");
    assert_eq!(
        env.scalar("SELECT count(*) FROM effects").await,
        0,
        "{refused:?}"
    );
    no_open_transaction_left(&env).await;
    no_lock_left(&env).await;
    env.make_due_now().await;
    assert_eq!(round_within(&worker).await.claimed, 0);
    assert_eq!(env.scalar("SELECT count(*) FROM effects").await, 0);
}

/// What the task a handler moved its lent connection into saw.
#[derive(Debug)]
struct Spawned {
    /// Writes answered without an error.
    wrote: usize,
    /// The first error a write got, if any.
    failed: Option<String>,
    /// How its `COMMIT` at the end was answered.
    commit: Result<(), String>,
}

/// A handler that moves its lent connection into a spawned task (a fresh
/// one of its own in its place), which writes once before the handler
/// returns and keeps writing after, then sends `COMMIT`; `fails` says
/// whether the handler returns an error rather than `Ok`. The job is dead
/// for swapping; the connection the task holds is closed by idem (the job's
/// transaction with it: no session is left in a transaction while the
/// task still holds the connection object), so nothing the task wrote
/// commits, its `COMMIT` included; the plain job of the round is done once.
///
/// With `commit_first` the task sends `COMMIT` right after its first write,
/// before the handler returns (the job's hold, the `lent` write and that
/// first write commit: the handler's business, and the job is dead, not
/// run again), and goes on writing, each write on its own now: idem's
/// close still stops it (an error before its 50 writes are in), and every
/// write it saw answered committed once (one more at most: the write
/// under way when the connection was closed).
async fn moved_into_a_task(fails: bool, commit_first: bool) {
    let env = env().await;
    enqueue_new(&env, "moved").await;
    enqueue_new(&env, "plain").await;
    let url = env.db.url().to_owned();
    type Task = tokio::task::JoinHandle<(Spawned, AsyncPgConnection)>;
    let task: Arc<Mutex<Option<Task>>> = Arc::default();
    let spawned = Arc::clone(&task);
    let worker = Worker::new(env.pool.clone())
        .ladder(Ladder::new([Duration::ZERO; 3]))
        .handle(move |conn, job: &Compensate| {
            let (url, spawned) = (url.clone(), Arc::clone(&spawned));
            async move {
                record_effect(conn, &job.key, "lent").await?;
                if job.key != "moved" {
                    return Ok(());
                }
                let fresh = AsyncPgConnection::establish(&url).await.expect("connect");
                let mut lent = std::mem::replace(conn, fresh);
                let (first, written) = tokio::sync::oneshot::channel();
                let key = job.key.clone();
                let handle = tokio::spawn(async move {
                    let mut seen = Spawned {
                        wrote: 0,
                        failed: None,
                        commit: Ok(()),
                    };
                    let mut first = Some(first);
                    for _ in 0..50 {
                        match record_effect(&mut lent, &key, "spawned").await {
                            Ok(()) => seen.wrote += 1,
                            Err(e) => {
                                seen.failed = Some(e.to_string());
                                break;
                            }
                        }
                        if let Some(first) = first.take() {
                            if commit_first {
                                lent.batch_execute("COMMIT").await.expect("commit");
                            }
                            let _ = first.send(());
                        }
                        // Committed, as fast as it can: to race idem's close.
                        if !commit_first {
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    }
                    seen.commit = lent
                        .batch_execute("COMMIT")
                        .await
                        .map_err(|e| e.to_string());
                    (seen, lent)
                });
                *spawned.lock().unwrap() = Some(handle);
                written.await.expect("the task wrote once");
                match fails {
                    true => Err(AppError::Refused("failed after the move".into())),
                    false => Ok(()),
                }
            }
            .scope_boxed()
        });
    let round = round_within(&worker).await;
    assert_eq!(round.claimed, 2, "{round:?}");
    let handle = task.lock().unwrap().take().expect("the task");
    let (seen, lent) = tokio::time::timeout(Duration::from_secs(30), handle)
        .await
        .expect("the task hung")
        .expect("no panic");
    // Still held by the task: its session is gone all the same.
    no_open_transaction_left(&env).await;
    no_lock_left(&env).await;
    dead_for_swapping(&env, "moved").await;
    assert!(seen.wrote >= 1, "{seen:?}");
    assert!(seen.failed.is_some(), "{seen:?}");
    assert!(seen.commit.is_err(), "{seen:?}");
    let spawned = effects_by(&env, "moved", "spawned").await;
    eprintln!("{seen:?}; {spawned} spawned writes committed");
    if commit_first {
        let wrote = i64::try_from(seen.wrote).unwrap();
        assert!(
            (wrote..=wrote + 1).contains(&spawned),
            "{spawned}: {seen:?}"
        );
        assert_eq!(effects_by(&env, "moved", "lent").await, 1, "{seen:?}");
    } else {
        assert_eq!(spawned, 0, "{seen:?}");
        assert_eq!(effects_by(&env, "moved", "lent").await, 0, "{seen:?}");
    }
    let before = env.effects("moved").await;
    drop(lent);
    no_open_transaction_left(&env).await;
    assert_eq!(env.effects("plain").await, 1);
    assert!(env.jobs("plain").await.is_empty());
    env.make_due_now().await;
    assert_eq!(round_within(&worker).await.claimed, 0);
    assert_eq!(env.effects("moved").await, before, "nothing more");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack5_a_lent_connection_moved_into_a_task_that_writes_on_commits_nothing() {
    moved_into_a_task(false, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack5_a_lent_connection_moved_into_a_task_and_an_error_commits_nothing() {
    moved_into_a_task(true, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack5_a_task_committing_a_moved_lent_connection_is_stopped_by_the_close() {
    moved_into_a_task(false, true).await;
}
