//! A hostile pass on the compensation jobs: handlers that end their
//! transaction by hand, panic, hang, or lose their connection or their
//! COMMIT's answer; ladders and delays past the calendar; forged kinds,
//! keys and payloads; operators racing workers. Everything is counted in
//! the database (`effects` rows, `idem_jobs` rows), never in a `Round`.

use std::panic::AssertUnwindSafe;

use futures_util::FutureExt;
use idem::jobs::enqueue_after;

use super::*;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A job whose payload is not its key.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Note {
    key: String,
    text: String,
}

impl Job for Note {
    const KIND: &'static str = "note";
    fn key(&self) -> String {
        self.key.clone()
    }
}

/// A decision that writes its own row (`effects`, key `mark`) and then
/// enqueues `job` after `delay`: the job must exist exactly when the row does.
#[retryable(max = 3, deadline_ms = 10000)]
async fn decide_after(
    conn: &mut AsyncPgConnection,
    mark: &str,
    job: &Compensate,
    delay: Duration,
) -> Result<Enqueued, AppError> {
    record_effect(conn, mark, "decision").await?;
    Ok(enqueue_after(conn, job, delay).await?)
}

#[retryable(max = 3, deadline_ms = 10000)]
async fn decide_note(
    conn: &mut AsyncPgConnection,
    mark: &str,
    job: &Note,
) -> Result<Enqueued, AppError> {
    record_effect(conn, mark, "decision").await?;
    Ok(enqueue(conn, job).await?)
}

/// A decision that enqueues, holds its transaction open a moment so that
/// others overlap it, then commits or rolls back.
#[retryable(max = 8, deadline_ms = 20000)]
async fn decide_then(
    conn: &mut AsyncPgConnection,
    job: &Compensate,
    commit: bool,
) -> Result<Enqueued, AppError> {
    use diesel_async::RunQueryDsl;
    let enqueued = enqueue(conn, job).await?;
    diesel::sql_query("SELECT pg_sleep(0.05)")
        .execute(conn)
        .await?;
    if commit {
        Ok(enqueued)
    } else {
        Err(AppError::Refused("changed my mind".into()))
    }
}

/// `count(*)` of the rows of `idem_jobs` of `key`.
async fn job_rows(env: &Env, key: &str) -> i64 {
    env.client
        .query_one("SELECT count(*) FROM idem_jobs WHERE key = $1", &[&key])
        .await
        .expect("count jobs")
        .get(0)
}

/// Run rounds, making due jobs due now before each, and waiting `pause`
/// after each (past a short lease, when one is set).
async fn drive(env: &Env, worker: &Worker, rounds: usize, pause: Duration) {
    for _ in 0..rounds {
        env.make_due_now().await;
        let _ = worker.run_once().await;
        tokio::time::sleep(pause).await;
    }
}

// ---------------------------------------------------------------------------
// Handlers that end their own transaction.

/// A worker whose handler writes its effect, then runs `sql` by hand on
/// the run's connection.
fn hand_worker(pool: &Pool, sql: &'static str) -> Worker {
    Worker::new(pool.clone())
        .lease(ms(300))
        .ladder(Ladder::new([ms(10), ms(10), ms(10)]))
        .handle(move |conn, job: &Compensate| {
            async move {
                record_effect(conn, &job.key, "").await?;
                conn.batch_execute(sql).await?;
                Ok::<_, AppError>(())
            }
            .scope_boxed()
        })
}

/// Found: a handler's `COMMIT` by hand was answered `TransactionEnded {
/// committed: true }` and sent up the ladder like any failure, and every
/// run committed its effect again (4 rows, then dead). Such a job is now
/// dead at its first run, with that error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_a_handler_that_commits_by_hand_applies_its_effect_once_per_run() {
    let env = env().await;
    enqueue_new(&env, "hand-commit").await;
    let worker = hand_worker(&env.pool, "COMMIT");
    drive(&env, &worker, 6, ms(350)).await;
    let jobs = env.jobs("hand-commit").await;
    // The docs: the handler's writes and the job's end commit together or
    // not at all. The effect was committed by the handler's own COMMIT;
    // the failure that followed sent the job up the ladder, and every run
    // committed its effect again.
    assert_eq!(
        env.effects("hand-commit").await,
        1,
        "one job, its effect committed once per run; jobs: {jobs:?}"
    );
    assert_eq!(jobs.len(), 1, "{jobs:?}");
    assert_eq!((jobs[0].0.as_str(), jobs[0].1), ("dead", 1), "{jobs:?}");
    assert!(
        jobs[0]
            .2
            .as_deref()
            .is_some_and(|e| e.contains("some of what it wrote was committed")),
        "{jobs:?}"
    );
}

/// Found: the same with `ROLLBACK; INSERT ..`: the `INSERT` committed on
/// its own at every run. Now dead at the first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_a_handler_that_rolls_back_and_writes_applies_its_write_once_per_run() {
    let env = env().await;
    enqueue_new(&env, "hand-rollback").await;
    let worker = hand_worker(
        &env.pool,
        "ROLLBACK; INSERT INTO effects (key, worker) VALUES ('hand-rollback', 'after')",
    );
    drive(&env, &worker, 6, ms(350)).await;
    let jobs = env.jobs("hand-rollback").await;
    let after = env
        .scalar("SELECT count(*) FROM effects WHERE worker = 'after'")
        .await;
    assert_eq!(
        after, 1,
        "the write after the ROLLBACK committed on its own, once per run; jobs: {jobs:?}"
    );
    assert_eq!((jobs[0].0.as_str(), jobs[0].1), ("dead", 1), "{jobs:?}");
}

// ---------------------------------------------------------------------------
// Ladders and delays past the calendar.

/// Found: a ladder step of `Duration::MAX` (documented for a step too long)
/// never recorded the failure; see the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_a_ladder_step_of_duration_max_never_records_the_failure() {
    let env = env().await;
    enqueue_new(&env, "far-step").await;
    // Documented: "a step too long for a Duration is Duration::MAX".
    let ladder = Ladder::default().scaled(f64::MAX);
    assert_eq!(ladder.steps()[0], Duration::MAX);
    let worker = worker(&env.pool, |_| Some("cannot".to_owned()))
        .lease(ms(100))
        .ladder(ladder);
    // Four rounds, each past the lease (and not made due by hand, as
    // `drive` does: the wait is what is checked).
    for _ in 0..4 {
        let _ = worker.run_once().await;
        tokio::time::sleep(ms(150)).await;
    }
    // A failed run makes its job due again after the ladder's next step,
    // with its last error: one run, then a wait that never ends.
    assert_eq!(
        env.jobs("far-step").await,
        [("due".to_owned(), 1, Some("refused: cannot".to_owned()))]
    );
    // Found: the step was written as `now() + i64::MAX ms`, out of range,
    // and the failure was never recorded. It now counts as a thousand years.
    let far = "SELECT count(*) FROM idem_jobs WHERE key = 'far-step' \
               AND run_at > now() + interval '999 years'";
    assert_eq!(env.scalar(far).await, 1);
}

/// Found: `enqueue_after` with a delay past PostgreSQL's calendar failed
/// with "interval out of range" and took the decision down with it. A
/// delay past a thousand years now counts as a thousand.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_enqueue_after_a_delay_past_the_calendar_loses_the_decision() {
    let env = env().await;
    let job = Compensate::new("far-delay");
    let result = decide_after(&env.pool, "mark-far", &job, Duration::from_secs(u64::MAX)).await;
    let decided = env.effects("mark-far").await;
    let jobs = job_rows(&env, "far-delay").await;
    // The job is accepted as a Duration: the decision commits, the job
    // waits (practically for ever). What happens: `interval out of
    // range`, the whole decision rolled back.
    assert_eq!(
        (decided, jobs),
        (1, 1),
        "enqueue_after(Duration::MAX-ish): {result:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_a_job_due_in_a_century_is_not_claimed_and_one_due_in_the_past_is() {
    let env = env().await;
    let century = Duration::from_secs(100 * 365 * 86_400);
    decide_after(&env.pool, "m1", &Compensate::new("later"), century)
        .await
        .expect("decide");
    enqueue_new(&env, "past").await;
    env.client
        .execute(
            "UPDATE idem_jobs SET run_at = now() - interval '30 years' WHERE key = 'past'",
            &[],
        )
        .await
        .expect("backdate");
    let w = worker(&env.pool, |_| None);
    for _ in 0..3 {
        w.run_once().await.expect("round");
    }
    assert_eq!(env.effects("past").await, 1);
    assert_eq!(job_rows(&env, "past").await, 0);
    assert_eq!(env.effects("later").await, 0);
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM idem_jobs WHERE key = 'later' AND state = 'due'
             AND run_at > now() + interval '99 years'"
        )
        .await,
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_an_immediate_enqueue_collapsing_into_a_delayed_one_still_waits() {
    let env = env().await;
    let job = Compensate::new("hour");
    let first = decide_after(&env.pool, "m1", &job, Duration::from_secs(3600))
        .await
        .expect("first");
    let second = decide(&env.pool, &job).await.expect("second");
    assert!(first.is_new() && !second.is_new(), "{first:?} {second:?}");
    let w = worker(&env.pool, |_| None);
    assert_eq!(w.run_once().await.expect("round").claimed, 0);
    assert_eq!(env.effects("hour").await, 0);
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM idem_jobs WHERE key = 'hour' AND collapsed = 1
             AND run_at > now() + interval '59 minutes'"
        )
        .await,
        1
    );
}

// ---------------------------------------------------------------------------
// Handlers that panic or hang.

/// Found: a panicking handler left its job `running`, claimed again after
/// every lease with no error recorded, past the ladder. A panic is now the
/// run's failure, recorded as "the handler panicked: ..".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_a_handler_that_panics_is_never_failed_nor_parked() {
    let env = env().await;
    enqueue_new(&env, "boom").await;
    let w = Worker::new(env.pool.clone())
        .lease(ms(100))
        .ladder(Ladder::new([ms(10)]))
        .handle(|conn, job: &Compensate| {
            async move {
                record_effect(conn, &job.key, "").await?;
                if job.key == "boom" {
                    panic!("handler bug");
                }
                Ok::<_, AppError>(())
            }
            .scope_boxed()
        });
    // Five rounds, each past the lease: more than the ladder's two runs.
    for _ in 0..5 {
        env.make_due_now().await;
        let _ = AssertUnwindSafe(w.run_once()).catch_unwind().await;
        tokio::time::sleep(ms(150)).await;
    }
    // Nothing of a panicking run commits, and no connection is left open
    // in its transaction.
    assert_eq!(env.effects("boom").await, 0);
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
             AND state LIKE 'idle in transaction%'"
        )
        .await,
        0
    );
    // A run that does not complete is a failure: two runs (one step),
    // then dead with its last error. What happens: the job stays
    // `running`, claimed again after every lease, no error recorded.
    let jobs = env.jobs("boom").await;
    assert_eq!(
        (jobs[0].0.as_str(), jobs[0].1, jobs[0].2.as_deref()),
        ("dead", 2, Some("the handler panicked: handler bug")),
        "{jobs:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_a_handler_hanging_past_its_lease_is_not_run_twice() {
    let env = env().await;
    enqueue_new(&env, "hang").await;
    let slow = Worker::new(env.pool.clone())
        .lease(ms(100))
        .handle(|conn, job: &Compensate| {
            async move {
                record_effect(conn, &job.key, "slow").await?;
                // Client-side: no statement runs, the server sees an idle
                // transaction.
                tokio::time::sleep(ms(900)).await;
                Ok::<_, AppError>(())
            }
            .scope_boxed()
        });
    let running = tokio::spawn(async move { slow.run_once().await });
    env.until(
        "SELECT count(*) FROM idem_jobs WHERE state = 'running' AND locked_until < now()",
        1,
    )
    .await;
    let other = worker(&env.pool, |_| None);
    let started = Instant::now();
    while started.elapsed() < ms(600) {
        other.run_once().await.expect("round");
        tokio::time::sleep(ms(20)).await;
    }
    running.await.expect("no panic").expect("round");
    assert_eq!(env.effects("hang").await, 1);
    assert_eq!(job_rows(&env, "hang").await, 0);
}

#[retryable(max = 1)]
async fn spawns(conn: &mut AsyncPgConnection, url: &str) -> Result<bool, AppError> {
    let _ = conn;
    let url = url.to_owned();
    let refused = tokio::spawn(async move {
        let mut other = AsyncPgConnection::establish(&url).await.expect("connect");
        matches!(
            enqueue(&mut other, &Compensate::new("outside")).await,
            Err(EnqueueError::OutsideAttempt)
        )
    })
    .await
    .expect("no panic");
    Ok(refused)
}

// ---------------------------------------------------------------------------
// Enqueue: concurrency, rollbacks, forged input, call shapes.

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn attack_sixteen_deciders_half_rolling_back_leave_one_job_counting_the_committed() {
    let env = env().await;
    let job = Compensate::new("crowd");
    let mut tasks = Vec::new();
    for i in 0..16 {
        let pool = env.pool.clone();
        let job = job.clone();
        tasks.push(tokio::spawn(async move {
            decide_then(&pool, &job, i % 2 == 0).await.is_ok()
        }));
    }
    let mut committed = 0;
    for t in tasks {
        if t.await.expect("no panic") {
            committed += 1;
        }
    }
    assert_eq!(committed, 8);
    // One job, counting each committed collapse, none of the rolled back.
    assert_eq!(job_rows(&env, "crowd").await, 1);
    assert_eq!(
        env.scalar("SELECT collapsed FROM idem_jobs WHERE key = 'crowd'")
            .await,
        7
    );
    worker(&env.pool, |_| None).run_once().await.expect("round");
    assert_eq!(env.effects("crowd").await, 1);
    assert_eq!(job_rows(&env, "crowd").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_enqueue_outside_an_attempt_writes_nothing_even_in_a_transaction() {
    let env = env().await;
    let mut conn = AsyncPgConnection::establish(env.db.url())
        .await
        .expect("connect");
    let plain = enqueue(&mut conn, &Compensate::new("outside")).await;
    assert!(
        matches!(plain, Err(EnqueueError::OutsideAttempt)),
        "{plain:?}"
    );
    // In a transaction of the caller's own, not an attempt's.
    conn.batch_execute("BEGIN").await.expect("begin");
    let in_tx = enqueue(&mut conn, &Compensate::new("outside")).await;
    assert!(
        matches!(in_tx, Err(EnqueueError::OutsideAttempt)),
        "{in_tx:?}"
    );
    conn.batch_execute("COMMIT").await.expect("commit");
    // From a task spawned inside an attempt: not the attempt's task.
    assert!(spawns(&env.pool, env.db.url()).await.expect("attempt"));
    assert_eq!(job_rows(&env, "outside").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_forged_kinds_keys_and_payloads_write_nothing() {
    let env = env().await;
    for key in [
        String::new(),
        "k".repeat(256),
        "a\0b".to_owned(),
        "a\nb".to_owned(),
        "\u{7f}".to_owned(),
        "\u{85}x".to_owned(),
        "€".repeat(86),
    ] {
        let r = decide(&env.pool, &Compensate::new(&key)).await;
        assert!(
            matches!(r, Err(AppError::Enqueue(EnqueueError::Invalid(_)))),
            "{key:?}: {r:?}"
        );
    }
    assert_eq!(env.scalar("SELECT count(*) FROM idem_jobs").await, 0);
    // At the limits: accepted, stored as given.
    for key in [
        "€".repeat(85),
        "k".repeat(255),
        "\u{202e}evil".to_owned(),
        " ".to_owned(),
    ] {
        let r = decide(&env.pool, &Compensate::new(&key)).await;
        assert!(matches!(r, Ok(Enqueued::New(_))), "{key:?}: {r:?}");
        assert_eq!(job_rows(&env, &key).await, 1, "{key:?}");
    }
    // A NUL inside the payload (not the key): jsonb refuses it; the whole
    // decision goes with it, job and decision row alike.
    let r = decide_note(
        &env.pool,
        "mark-nul",
        &Note {
            key: "nul".into(),
            text: "a\0b".into(),
        },
    )
    .await;
    assert!(r.is_err(), "{r:?}");
    assert_eq!(env.effects("mark-nul").await, 0);
    assert_eq!(job_rows(&env, "nul").await, 0);
    // A megabyte payload is written whole.
    let big = "x".repeat(1 << 20);
    decide_note(
        &env.pool,
        "mark-big",
        &Note {
            key: "big".into(),
            text: big.clone(),
        },
    )
    .await
    .expect("big");
    assert_eq!(
        env.scalar("SELECT length(payload->>'text')::bigint FROM idem_jobs WHERE key = 'big'")
            .await,
        1 << 20
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_a_second_payload_under_the_same_key_collapses_and_the_first_wins() {
    let env = env().await;
    let first = decide_note(
        &env.pool,
        "m1",
        &Note {
            key: "same".into(),
            text: "first".into(),
        },
    )
    .await
    .expect("first");
    let second = decide_note(
        &env.pool,
        "m2",
        &Note {
            key: "same".into(),
            text: "second".into(),
        },
    )
    .await
    .expect("second");
    assert_eq!((first.is_new(), second.is_new()), (true, false));
    assert_eq!(first.id(), second.id());
    let text: String = env
        .client
        .query_one(
            "SELECT payload->>'text' FROM idem_jobs WHERE key = 'same'",
            &[],
        )
        .await
        .expect("read")
        .get(0);
    assert_eq!(text, "first");
    assert_eq!(job_rows(&env, "same").await, 1);
    // Same key, another kind: a job of its own.
    decide(&env.pool, &Compensate::new("same"))
        .await
        .expect("other kind");
    assert_eq!(job_rows(&env, "same").await, 2);
}
