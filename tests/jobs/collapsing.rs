//! A collapsed enqueue is followed by a run that starts after its decision
//! committed, whatever the worker was doing meanwhile: the deciding
//! transaction is held open across a whole run, across the end of a run
//! (then committed or rolled back), committed in the middle of a run, in
//! the middle of a run that fails past the ladder, and two deciders race.
//!
//! Every decision writes a `decisions` row in its own transaction, beside
//! its enqueue; every run's handler writes, in the run's transaction, how
//! many decisions of its key it saw (`observed`). What a test asserts is
//! read from those tables and `idem_jobs`: the last committed run of a key
//! saw every committed decision, and no job is left over.

use std::sync::atomic::{AtomicBool, AtomicI32};

use diesel::sql_types::Integer;
use idem::{Isolation, RetryPolicy};
use tokio::sync::Notify;

use super::*;

const TABLES: &str = "
CREATE TABLE decisions (key text NOT NULL, n integer NOT NULL);
CREATE TABLE observed (
    key       text        NOT NULL,
    decisions bigint      NOT NULL,
    at        timestamptz NOT NULL DEFAULT clock_timestamp()
)";

/// The advisory lock a gated handler waits on while the test holds it.
const GATE: i64 = 0x636f_6c6c;

/// How long any wait of these tests may take before it counts as a hang.
const PATIENCE: Duration = Duration::from_secs(30);

async fn env_with_tables() -> Env {
    let env = env().await;
    env.client.batch_execute(TABLES).await.expect("tables");
    env
}

/// A deciding transaction, held open after its enqueue until released.
#[derive(Default)]
struct Hold {
    /// Its backend, for `pg_stat_activity`.
    pid: AtomicI32,
    /// Its enqueue returned.
    enqueued: AtomicBool,
    release: Notify,
    /// Released to roll back instead of committing.
    roll_back: AtomicBool,
}

impl Hold {
    /// A decision that commits as soon as it enqueued.
    fn released() -> Arc<Hold> {
        let hold = Arc::new(Hold::default());
        hold.release.notify_one();
        hold
    }

    fn commit(&self) {
        self.release.notify_one();
    }

    fn roll_back(&self) {
        self.roll_back.store(true, Ordering::SeqCst);
        self.release.notify_one();
    }
}

/// Decision `n` on `key`: its row and its enqueue, then held until released.
/// One attempt only, so that no replay hides what happened.
#[retryable(max = 1, deadline_ms = 30000)]
async fn decide_held(
    conn: &mut AsyncPgConnection,
    key: &str,
    n: i32,
    hold: &Hold,
) -> Result<Enqueued, AppError> {
    hold.pid.store(backend(conn).await?, Ordering::SeqCst);
    record_decision(conn, key, n).await?;
    let enqueued = enqueue(conn, &Compensate::new(key)).await?;
    hold.enqueued.store(true, Ordering::SeqCst);
    hold.release.notified().await;
    if hold.roll_back.load(Ordering::SeqCst) {
        return Err(AppError::Refused("the decision rolled back".into()));
    }
    Ok(enqueued)
}

/// The backend of `conn`, for `pg_stat_activity`.
async fn backend(conn: &mut AsyncPgConnection) -> Result<i32, diesel::result::Error> {
    use diesel_async::RunQueryDsl;
    diesel::select(diesel::dsl::sql::<Integer>("pg_backend_pid()"))
        .get_result(conn)
        .await
}

async fn record_decision(
    conn: &mut AsyncPgConnection,
    key: &str,
    n: i32,
) -> Result<(), diesel::result::Error> {
    use diesel_async::RunQueryDsl;
    diesel::sql_query("INSERT INTO decisions (key, n) VALUES ($1, $2)")
        .bind::<Text, _>(key)
        .bind::<Integer, _>(n)
        .execute(conn)
        .await
        .map(drop)
}

/// In a run: how many decisions of `key` it sees.
async fn observe(conn: &mut AsyncPgConnection, key: &str) -> Result<(), diesel::result::Error> {
    use diesel_async::RunQueryDsl;
    diesel::sql_query(
        "INSERT INTO observed (key, decisions) SELECT $1, count(*) FROM decisions WHERE key = $1",
    )
    .bind::<Text, _>(key)
    .execute(conn)
    .await
    .map(drop)
}

/// Wait until the test opens [`GATE`].
async fn pass_gate(conn: &mut AsyncPgConnection) -> Result<(), diesel::result::Error> {
    use diesel_async::RunQueryDsl;
    diesel::sql_query("SELECT pg_advisory_xact_lock_shared($1)")
        .bind::<BigInt, _>(GATE)
        .execute(conn)
        .await
        .map(drop)
}

type Decision = tokio::task::JoinHandle<Result<Enqueued, AppError>>;

fn spawn_decision(env: &Env, key: &'static str, n: i32, hold: &Arc<Hold>) -> Decision {
    let pool = env.pool.clone();
    let hold = Arc::clone(hold);
    tokio::spawn(async move { decide_held(&pool, key, n, &hold).await })
}

/// What the handler does, set by the test.
#[derive(Default)]
struct Knobs {
    /// Wait on [`GATE`] after observing.
    gated: AtomicBool,
    /// Fail after observing (and after the gate).
    failing: AtomicBool,
    /// The backend of the last run that started.
    pid: AtomicI32,
}

/// A worker whose handler records how many decisions of its key it sees.
fn observing_worker(pool: &Pool, knobs: &Arc<Knobs>) -> Worker {
    let knobs = Arc::clone(knobs);
    Worker::new(pool.clone()).handle(move |conn, job: &Compensate| {
        let knobs = Arc::clone(&knobs);
        async move {
            knobs.pid.store(backend(conn).await?, Ordering::SeqCst);
            observe(conn, &job.key).await?;
            if knobs.gated.load(Ordering::SeqCst) {
                pass_gate(conn).await?;
            }
            if knobs.failing.load(Ordering::SeqCst) {
                return Err(AppError::Refused("the compensation failed".into()));
            }
            Ok(())
        }
        .scope_boxed()
    })
}

impl Env {
    /// What each committed run of `key` saw, in the order they ran.
    async fn observed(&self, key: &str) -> Vec<i64> {
        self.client
            .query_one(
                "SELECT coalesce(array_agg(decisions ORDER BY at), '{}') FROM observed WHERE key = $1",
                &[&key],
            )
            .await
            .expect("read observed")
            .get(0)
    }

    async fn decisions(&self, key: &str) -> i64 {
        self.client
            .query_one("SELECT count(*) FROM decisions WHERE key = $1", &[&key])
            .await
            .expect("count decisions")
            .get(0)
    }

    /// Whether backend `pid` waits on a heavyweight lock of type `event`
    /// (`advisory`, `transactionid`, `tuple`) or, with `None`, on any.
    async fn waits(&self, pid: i32, event: Option<&str>) -> bool {
        self.client
            .query_one(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE pid = $1 AND wait_event_type = 'Lock'
                   AND ($2::text IS NULL OR wait_event = $2)",
                &[&pid, &event],
            )
            .await
            .expect("read pg_stat_activity")
            .get::<_, i64>(0)
            == 1
    }

    /// Wait until the backend that `pid` names waits on a lock `event`.
    async fn until_waiting(&self, pid: &AtomicI32, event: &str) {
        let start = Instant::now();
        loop {
            let now = pid.load(Ordering::SeqCst);
            if now != 0 && self.waits(now, Some(event)).await {
                return;
            }
            assert!(start.elapsed() < PATIENCE, "never waited on {event}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Whether the decision's enqueue returned (true) or its backend waits
    /// on a lock first (false).
    async fn enqueued_without_waiting(&self, hold: &Hold) -> bool {
        let start = Instant::now();
        loop {
            if hold.enqueued.load(Ordering::SeqCst) {
                return true;
            }
            let pid = hold.pid.load(Ordering::SeqCst);
            if pid != 0 && self.waits(pid, None).await {
                return false;
            }
            assert!(
                start.elapsed() < PATIENCE,
                "the enqueue neither ended nor waited"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn until_enqueued(&self, hold: &Hold) {
        let start = Instant::now();
        while !hold.enqueued.load(Ordering::SeqCst) {
            assert!(start.elapsed() < PATIENCE, "the enqueue never returned");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn close_gate(&self) {
        self.client
            .execute("SELECT pg_advisory_lock($1)", &[&GATE])
            .await
            .expect("close the gate");
    }

    async fn open_gate(&self) {
        self.client
            .execute("SELECT pg_advisory_unlock($1)", &[&GATE])
            .await
            .expect("open the gate");
    }
}

/// Run rounds until one claims nothing: whatever is due has run.
async fn drain(worker: &Worker) {
    for _ in 0..10 {
        if worker.run_once().await.expect("round").claimed == 0 {
            return;
        }
    }
    panic!("jobs kept coming");
}

async fn decided(decision: Decision) -> Result<Enqueued, AppError> {
    tokio::time::timeout(PATIENCE, decision)
        .await
        .expect("the decision ended")
        .expect("no panic")
}

/// The case: the decision collapses into a due job and stays open
/// while a worker polls. The job must not run (and vanish) before the
/// decision commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enqueue_held_open_across_a_worker_round_is_not_lost() {
    let env = env_with_tables().await;
    let knobs = Arc::new(Knobs::default());
    let worker = observing_worker(&env.pool, &knobs);
    let first = decided(spawn_decision(&env, "k", 1, &Hold::released()))
        .await
        .expect("decide");
    assert!(first.is_new(), "{first:?}");

    let hold = Arc::new(Hold::default());
    let second = spawn_decision(&env, "k", 2, &hold);
    env.until_enqueued(&hold).await;
    // The worker polls while the decision is open.
    let claimed_while_open = worker.run_once().await.expect("round").claimed;
    hold.commit();
    assert_eq!(
        decided(second).await.expect("decide"),
        Enqueued::Collapsed(first.id())
    );
    drain(&worker).await;

    assert_eq!(env.decisions("k").await, 2);
    assert_eq!(
        env.observed("k").await.last(),
        Some(&2),
        "the last run saw both decisions; runs: {:?}",
        env.observed("k").await
    );
    assert!(env.jobs("k").await.is_empty());
    // Nor was a run wasted: the open decision kept the claim off the job.
    assert_eq!(claimed_while_open, 0);
    assert_eq!(env.observed("k").await, [2]);
}

/// Two deciders collapse into one due job, each held open in turn; the
/// second queues behind the first on the job's row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_open_enqueues_are_both_seen_by_a_run() {
    let env = env_with_tables().await;
    let knobs = Arc::new(Knobs::default());
    let worker = observing_worker(&env.pool, &knobs);
    let first = decided(spawn_decision(&env, "k", 1, &Hold::released()))
        .await
        .expect("decide");

    let (one, two) = (Arc::new(Hold::default()), Arc::new(Hold::default()));
    let second = spawn_decision(&env, "k", 2, &one);
    env.until_enqueued(&one).await;
    let third = spawn_decision(&env, "k", 3, &two);
    // Either returned or queued behind the second: both are open.
    env.enqueued_without_waiting(&two).await;
    let mut claimed_while_open = worker.run_once().await.expect("round").claimed;
    one.commit();
    assert_eq!(
        decided(second).await.expect("decide"),
        Enqueued::Collapsed(first.id())
    );
    env.until_enqueued(&two).await;
    claimed_while_open += worker.run_once().await.expect("round").claimed;
    two.commit();
    assert_eq!(
        decided(third).await.expect("decide"),
        Enqueued::Collapsed(first.id())
    );
    drain(&worker).await;

    assert_eq!(env.decisions("k").await, 3);
    assert_eq!(
        env.observed("k").await.last(),
        Some(&3),
        "runs: {:?}",
        env.observed("k").await
    );
    assert!(env.jobs("k").await.is_empty());
    assert_eq!(claimed_while_open, 0);
}

/// The decision collapses into a job whose run is in its handler, and is
/// still open when the run reaches its end: the run's completion waits for
/// it, then re-arms the job if it committed.
async fn held_across_the_end_of_a_run(commit: bool) {
    let env = env_with_tables().await;
    let knobs = Arc::new(Knobs::default());
    let worker = Arc::new(observing_worker(&env.pool, &knobs));
    let first = decided(spawn_decision(&env, "k", 1, &Hold::released()))
        .await
        .expect("decide");

    env.close_gate().await;
    knobs.gated.store(true, Ordering::SeqCst);
    let running = tokio::spawn({
        let worker = Arc::clone(&worker);
        async move { worker.run_once().await }
    });
    env.until_waiting(&knobs.pid, "advisory").await;

    let hold = Arc::new(Hold::default());
    let second = spawn_decision(&env, "k", 2, &hold);
    let waited = !env.enqueued_without_waiting(&hold).await;
    knobs.gated.store(false, Ordering::SeqCst);
    env.open_gate().await;
    if !waited {
        // The run's end waits for the open decision.
        env.until_waiting(&knobs.pid, "transactionid").await;
    }
    if commit {
        hold.commit();
        let second = decided(second).await.expect("decide");
        assert!(
            waited || second == Enqueued::Collapsed(first.id()),
            "{second:?}"
        );
    } else {
        hold.roll_back();
        assert!(matches!(decided(second).await, Err(AppError::Refused(_))));
    }
    let round = running.await.expect("no panic").expect("round");
    assert_eq!(round.done, 1, "{round:?}");
    drain(&worker).await;

    if commit {
        assert_eq!(env.decisions("k").await, 2);
        assert_eq!(env.observed("k").await, [1, 2], "a run after the decision");
    } else {
        // Nothing was decided, so nothing more is owed.
        assert_eq!(env.decisions("k").await, 1);
        assert_eq!(
            env.observed("k").await,
            [1],
            "no run for a rolled-back decision"
        );
    }
    assert!(env.jobs("k").await.is_empty());
    assert!(!waited, "the enqueue waited for the run's transaction");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enqueue_committed_after_a_run_ended_gets_a_run_of_its_own() {
    held_across_the_end_of_a_run(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enqueue_rolled_back_after_a_run_ended_owes_nothing() {
    held_across_the_end_of_a_run(false).await;
}

/// The decision collapses into a job whose run is in its handler and
/// commits at once; the run then commits (its handler saw only the first
/// decision) or fails past the ladder. Either way one more run follows;
/// under repeatable read, the run's end is a serialization failure instead,
/// and its replay is that run.
async fn committed_during_a_run(fail: bool, isolation: Isolation) {
    let env = env_with_tables().await;
    let knobs = Arc::new(Knobs::default());
    // No steps: the first failure would park the job as dead.
    let worker = observing_worker(&env.pool, &knobs)
        .ladder(Ladder::new([]))
        .policy(
            RetryPolicy::new()
                .deadline(Duration::from_secs(30))
                .isolation(isolation),
        );
    let worker = Arc::new(worker);
    let first = decided(spawn_decision(&env, "k", 1, &Hold::released()))
        .await
        .expect("decide");

    env.close_gate().await;
    knobs.gated.store(true, Ordering::SeqCst);
    knobs.failing.store(fail, Ordering::SeqCst);
    let running = tokio::spawn({
        let worker = Arc::clone(&worker);
        async move { worker.run_once().await }
    });
    env.until_waiting(&knobs.pid, "advisory").await;

    let hold = Hold::released();
    let second = spawn_decision(&env, "k", 2, &hold);
    let waited = !env.enqueued_without_waiting(&hold).await;
    // Committed while the run is open, unless it waits for the run.
    let queued = if waited {
        Some(second)
    } else {
        assert_eq!(
            decided(second).await.expect("decide"),
            Enqueued::Collapsed(first.id())
        );
        assert_eq!(env.decisions("k").await, 2);
        None
    };
    knobs.gated.store(false, Ordering::SeqCst);
    env.open_gate().await;
    let round = running.await.expect("no panic").expect("round");
    if let Some(second) = queued {
        decided(second).await.expect("decide");
    }
    knobs.failing.store(false, Ordering::SeqCst);
    drain(&worker).await;

    assert_eq!(env.decisions("k").await, 2);
    // A failed run's observation rolled back with it, as did that of an
    // attempt the loop replayed.
    let after = if fail || isolation != Isolation::ReadCommitted {
        vec![2]
    } else {
        vec![1, 2]
    };
    assert_eq!(
        env.observed("k").await,
        after,
        "a committed run after the decision; the first run {round:?}; jobs {:?}",
        env.jobs("k").await
    );
    assert!(env.jobs("k").await.is_empty());
    assert!(!waited, "the enqueue waited for the run's transaction");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enqueue_committed_during_a_run_gets_a_run_after_it() {
    committed_during_a_run(false, Isolation::ReadCommitted).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enqueue_committed_during_a_run_that_dies_revives_the_job() {
    committed_during_a_run(true, Isolation::ReadCommitted).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeatable_read_run_is_replayed_to_see_an_enqueue_committed_during_it() {
    committed_during_a_run(false, Isolation::RepeatableRead).await;
}
