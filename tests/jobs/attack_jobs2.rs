//! A hostile pass on the compensation jobs, part 2: lost connections and
//! COMMIT answers, killed backends, several workers at once, operators
//! (requeue, discard) racing workers. Counted in the database.

use std::sync::atomic::AtomicBool;

use idem::jobs::{dead, requeue, Requeued};
use idem::operate::{discard_job, requeue_job, JobRequeue};
use idem_testing::proxy::{Fault, Proxy};

use super::*;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

async fn job_rows(env: &Env, key: &str) -> i64 {
    env.client
        .query_one("SELECT count(*) FROM idem_jobs WHERE key = $1", &[&key])
        .await
        .expect("count jobs")
        .get(0)
}

/// A worker on `pool` whose handler writes its effect; short lease and
/// ladder, so that faults are followed by runs within the test.
fn quick(pool: &Pool) -> Worker {
    worker(pool, |_| None)
        .lease(ms(200))
        .ladder(Ladder::new([ms(10), ms(10), ms(10)]))
}

/// Rounds until `key` has no job left (at most `rounds`), each past the lease.
async fn settle(env: &Env, w: &Worker, key: &str, rounds: usize) {
    for _ in 0..rounds {
        if job_rows(env, key).await == 0 {
            return;
        }
        env.make_due_now().await;
        let _ = w.run_once().await;
        tokio::time::sleep(ms(250)).await;
    }
}

async fn proxied_pool(proxy: &Proxy) -> Pool {
    build_pool_with(
        proxy.url(),
        &PoolConfig {
            max_size: 4,
            wait_timeout: Duration::from_secs(5),
            ..PoolConfig::default()
        },
    )
    .expect("pool")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_the_answer_to_a_runs_commit_lost_applies_the_effect_once() {
    let env = env().await;
    enqueue_new(&env, "cut-after").await;
    let proxy = Proxy::start(env.db.url()).await.expect("proxy");
    let pool = proxied_pool(&proxy).await;
    proxy.arm("COMMIT\0", Fault::CutAfter);
    let w = quick(&pool);
    let _ = w.run_once().await;
    assert_eq!(proxy.fired(), 1);
    settle(&env, &w, "cut-after", 6).await;
    for _ in 0..3 {
        let _ = w.run_once().await;
    }
    assert_eq!(env.effects("cut-after").await, 1);
    assert_eq!(job_rows(&env, "cut-after").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_a_runs_commit_lost_before_the_server_applies_the_effect_once_later() {
    let env = env().await;
    enqueue_new(&env, "cut-before").await;
    let proxy = Proxy::start(env.db.url()).await.expect("proxy");
    let pool = proxied_pool(&proxy).await;
    proxy.arm("COMMIT\0", Fault::CutBefore);
    let w = quick(&pool);
    let _ = w.run_once().await;
    assert_eq!(proxy.fired(), 1);
    // (The loop learns that this COMMIT never ran and replays the run at
    // once, or records a failure: either way one effect in the end.)
    settle(&env, &w, "cut-before", 8).await;
    assert_eq!(env.effects("cut-before").await, 1);
    assert_eq!(job_rows(&env, "cut-before").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_a_connection_lost_mid_handler_and_at_the_claim_applies_once() {
    let env = env().await;
    enqueue_new(&env, "cut-mid").await;
    let proxy = Proxy::start(env.db.url()).await.expect("proxy");
    let pool = proxied_pool(&proxy).await;
    // The effect's INSERT reaches the server, then the connection is gone.
    proxy.arm("INSERT INTO effects", Fault::CutAfter);
    let w = quick(&pool);
    settle(&env, &w, "cut-mid", 10).await;
    assert_eq!(proxy.fired(), 1);
    // A claim statement that never reaches the server: the round fails,
    // nothing is claimed, the next round works.
    enqueue_new(&env, "cut-claim").await;
    proxy.arm("WITH due AS", Fault::CutBefore);
    assert!(w.run_once().await.is_err());
    assert_eq!(proxy.fired(), 2);
    assert_eq!(
        env.scalar("SELECT count(*) FROM idem_jobs WHERE key = 'cut-claim' AND state = 'due' AND attempts = 0")
            .await,
        1
    );
    settle(&env, &w, "cut-claim", 6).await;
    assert_eq!(env.effects("cut-claim").await, 1);
    assert_eq!(env.effects("cut-mid").await, 1);
    assert_eq!(job_rows(&env, "cut-mid").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_a_backend_terminated_during_the_effect_applies_it_once() {
    let env = env().await;
    enqueue_new(&env, "kill").await;
    env.client
        .execute("SELECT pg_advisory_lock(4242)", &[])
        .await
        .expect("lock");
    let w = Worker::new(env.pool.clone())
        .lease(ms(200))
        .ladder(Ladder::new([ms(10), ms(10), ms(10)]))
        .handle(|conn, job: &Compensate| {
            async move {
                use diesel_async::RunQueryDsl;
                record_effect(conn, &job.key, "").await?;
                diesel::sql_query("SELECT pg_advisory_xact_lock(4242)")
                    .execute(conn)
                    .await?;
                Ok::<_, AppError>(())
            }
            .scope_boxed()
        });
    let w = Arc::new(w);
    let first = {
        let w = Arc::clone(&w);
        tokio::spawn(async move { w.run_once().await })
    };
    env.until(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query = 'SELECT pg_advisory_xact_lock(4242)'
         AND wait_event_type = 'Lock'",
        1,
    )
    .await;
    env.client
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
             WHERE datname = current_database() AND query = 'SELECT pg_advisory_xact_lock(4242)'",
            &[],
        )
        .await
        .expect("terminate");
    env.client
        .execute("SELECT pg_advisory_unlock(4242)", &[])
        .await
        .expect("unlock");
    let _ = first.await.expect("no panic");
    settle(&env, &w, "kill", 8).await;
    assert_eq!(env.effects("kill").await, 1);
    assert_eq!(job_rows(&env, "kill").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn attack_three_workers_at_once_run_forty_jobs_once_each() {
    let env = env().await;
    for i in 0..40 {
        enqueue_new(&env, &format!("many-{i}")).await;
    }
    let mut stops = Vec::new();
    let mut runs = Vec::new();
    for n in 0..3 {
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        stops.push(tx);
        let w = worker(&env.pool, |_| None)
            .name(format!("w{n}"))
            .batch_size(3)
            .lease(ms(500));
        runs.push(tokio::spawn(w.run(async move {
            let _ = rx.await;
        })));
    }
    env.until("SELECT count(*) FROM idem_jobs", 0).await;
    for tx in stops {
        let _ = tx.send(());
    }
    for r in runs {
        r.await.expect("no panic").expect("worker");
    }
    assert_eq!(env.scalar("SELECT count(*) FROM effects").await, 40);
    assert_eq!(
        env.scalar("SELECT count(DISTINCT key) FROM effects").await,
        40
    );
}

// ---------------------------------------------------------------------------
// Dead jobs and operators.

/// A worker whose handler fails while `failing` is set: one run, then dead.
fn fragile(pool: &Pool, failing: Arc<AtomicBool>) -> Worker {
    Worker::new(pool.clone())
        .ladder(Ladder::new([]))
        .handle(move |conn, job: &Compensate| {
            let fail = failing.load(std::sync::atomic::Ordering::SeqCst);
            async move {
                record_effect(conn, &job.key, "").await?;
                if fail {
                    return Err(AppError::Refused(format!("no {}\u{1b}[2J", job.key)));
                }
                Ok(())
            }
            .scope_boxed()
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_requeue_and_discard_of_forged_live_and_twice_dead_ids() {
    let env = env().await;
    let failing = Arc::new(AtomicBool::new(true));
    let w = fragile(&env.pool, Arc::clone(&failing));
    let id = enqueue_new(&env, "d1").await;
    assert_eq!(w.run_once().await.expect("round").dead, 1);
    let mut conn = AsyncPgConnection::establish(env.db.url())
        .await
        .expect("connect");
    let listed = dead(&mut conn, Some("compensate"), 10).await.expect("dead");
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].last_error, "refused: no d1\u{1b}[2J");
    // A live job of the same key: requeue leaves the dead one dead.
    let live = enqueue_new(&env, "d1").await;
    assert_eq!(
        requeue(&mut conn, id).await.expect("requeue"),
        Requeued::LiveExists
    );
    // Requeue and discard of a live job, of forged ids: nothing changes.
    for forged in [live.as_i64(), 0, -1, i64::MAX, i64::MIN] {
        assert_eq!(
            requeue(&mut conn, forged.into()).await.expect("requeue"),
            Requeued::NotDead,
            "{forged}"
        );
        assert!(!discard_job(&env.pool, forged).await.expect("discard"));
    }
    assert_eq!(job_rows(&env, "d1").await, 2);
    // Discard twice: once.
    assert!(discard_job(&env.pool, id.as_i64()).await.expect("discard"));
    assert!(!discard_job(&env.pool, id.as_i64()).await.expect("discard"));
    assert_eq!(job_rows(&env, "d1").await, 1);
    // The live one runs (failing off) once.
    failing.store(false, std::sync::atomic::Ordering::SeqCst);
    w.run_once().await.expect("round");
    assert_eq!(env.effects("d1").await, 1);
    assert_eq!(job_rows(&env, "d1").await, 0);
    // A negative limit is an error, not a listing.
    assert!(dead(&mut conn, None, -1).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn attack_requeue_and_discard_racing_each_other_and_a_worker() {
    let env = env().await;
    let failing = Arc::new(AtomicBool::new(true));
    let w = Arc::new(fragile(&env.pool, Arc::clone(&failing)));
    for i in 0..12 {
        enqueue_new(&env, &format!("race-{i}")).await;
    }
    w.run_once().await.expect("round");
    w.run_once().await.expect("round");
    assert_eq!(
        env.scalar("SELECT count(*) FROM idem_jobs WHERE state = 'dead'")
            .await,
        12
    );
    failing.store(false, std::sync::atomic::Ordering::SeqCst);
    let ids: Vec<i64> = env
        .client
        .query("SELECT id FROM idem_jobs ORDER BY id", &[])
        .await
        .expect("ids")
        .iter()
        .map(|r| r.get(0))
        .collect();
    // A worker polling all along; for each dead job a requeue, a second
    // requeue and a discard at once.
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = {
        let w = fragile(&env.pool, Arc::clone(&failing)).poll_interval(ms(5));
        tokio::spawn(w.run(async move {
            let _ = stopped.await;
        }))
    };
    let mut outcomes = Vec::new();
    for &id in &ids {
        let (a, b, c) = tokio::join!(
            requeue_job(&env.pool, id),
            requeue_job(&env.pool, id),
            discard_job(&env.pool, id)
        );
        outcomes.push((
            id,
            a.expect("requeue"),
            b.expect("requeue"),
            c.expect("discard"),
        ));
    }
    env.until("SELECT count(*) FROM idem_jobs", 0).await;
    let _ = stop.send(());
    running.await.expect("no panic").expect("worker");
    for (id, a, b, discarded) in outcomes {
        let key = format!("race-{}", ids.iter().position(|&x| x == id).unwrap());
        let requeued = [a, b].iter().filter(|r| **r == JobRequeue::Due).count();
        assert!(requeued <= 1, "{id}: {a:?} {b:?}");
        // The failing run's effect rolled back: an effect exactly when a
        // requeue won, none when the discard did.
        assert_eq!(
            env.effects(&key).await,
            requeued as i64,
            "{id}: {a:?} {b:?} {discarded}"
        );
        assert_eq!(requeued == 1, !discarded, "{id}: {a:?} {b:?} {discarded}");
    }
}

// ---------------------------------------------------------------------------
// Replays, call shapes, the gap between claim and run.

/// A decision whose first attempt enqueues and then meets a real 40001.
#[retryable(max = 4, deadline_ms = 10000)]
async fn decide_replayed(
    conn: &mut AsyncPgConnection,
    job: &Compensate,
) -> Result<Enqueued, AppError> {
    use diesel_async::RunQueryDsl;
    let enqueued = enqueue(conn, job).await?;
    record_effect(conn, "decision", "").await?;
    if idem::attempt::current_attempt() == Some(1) {
        diesel::sql_query(
            "DO $$ BEGIN RAISE EXCEPTION 'could not serialize access' \
             USING ERRCODE = 'serialization_failure'; END $$",
        )
        .execute(conn)
        .await?;
    }
    Ok(enqueued)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_a_replayed_decision_writes_its_job_once() {
    let env = env().await;
    let r = decide_replayed(&env.pool, &Compensate::new("replayed"))
        .await
        .expect("decide");
    assert!(r.is_new(), "{r:?}");
    assert_eq!(env.effects("decision").await, 1);
    assert_eq!(
        env.scalar("SELECT count(*) FROM idem_jobs WHERE key = 'replayed' AND collapsed = 0")
            .await,
        1
    );
}

/// A decision that enqueues on a connection of its own (not the one the
/// attempt lent it) and then rolls back.
#[retryable(max = 1)]
async fn decide_elsewhere(conn: &mut AsyncPgConnection, url: &str) -> Result<(), AppError> {
    record_effect(conn, "decision-elsewhere", "").await?;
    let mut other = AsyncPgConnection::establish(url).await.expect("connect");
    enqueue(&mut other, &Compensate::new("elsewhere")).await?;
    Err(AppError::Refused("roll the decision back".into()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_an_enqueue_on_another_connection_outlives_its_rolled_back_decision() {
    let env = env().await;
    let r = decide_elsewhere(&env.pool, env.db.url()).await;
    // Found: the check passed (the task runs an attempt), the job was
    // written in autocommit on another connection, and it outlived the
    // rolled-back decision. A connection in no transaction is now refused.
    assert!(
        matches!(r, Err(AppError::Enqueue(EnqueueError::NoTransaction))),
        "{r:?}"
    );
    assert_eq!(env.effects("decision-elsewhere").await, 0);
    assert_eq!(job_rows(&env, "elsewhere").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn attack_a_lease_that_runs_out_before_the_run_starts_runs_each_job_once() {
    use diesel_async::RunQueryDsl;
    let env = env().await;
    for i in 0..4 {
        enqueue_new(&env, &format!("gap-{i}")).await;
    }
    // One connection: the round's four runs wait for it in turn, each
    // 300 ms, past their 100 ms lease.
    let narrow = build_pool_with(
        env.db.url(),
        &PoolConfig {
            max_size: 1,
            wait_timeout: Duration::from_secs(10),
            ..PoolConfig::default()
        },
    )
    .expect("pool");
    let slow = Worker::new(narrow)
        .lease(ms(100))
        .batch_size(4)
        .policy(idem::RetryPolicy::new().deadline(Duration::from_secs(10)))
        .handle(|conn, job: &Compensate| {
            async move {
                record_effect(conn, &job.key, "slow").await?;
                diesel::sql_query("SELECT pg_sleep(0.3)")
                    .execute(conn)
                    .await?;
                Ok::<_, AppError>(())
            }
            .scope_boxed()
        });
    let running = tokio::spawn(async move { slow.run_once().await });
    let fast = worker(&env.pool, |_| None);
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(3) && !running.is_finished() {
        fast.run_once().await.expect("round");
        tokio::time::sleep(ms(20)).await;
    }
    running.await.expect("no panic").expect("round");
    for _ in 0..3 {
        fast.run_once().await.expect("round");
    }
    assert_eq!(env.scalar("SELECT count(*) FROM idem_jobs").await, 0);
    for i in 0..4 {
        assert_eq!(env.effects(&format!("gap-{i}")).await, 1, "gap-{i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn attack_a_commit_held_past_the_lease_is_not_claimed_meanwhile() {
    let env = env().await;
    enqueue_new(&env, "held").await;
    let proxy = Proxy::start(env.db.url()).await.expect("proxy");
    let pool = proxied_pool(&proxy).await;
    proxy.arm("COMMIT\0", Fault::HoldRequest(ms(800)));
    let slow = worker(&pool, |_| None).lease(ms(100));
    let running = tokio::spawn(async move { slow.run_once().await });
    // Its lease has run out while its COMMIT is held.
    env.until(
        "SELECT count(*) FROM idem_jobs WHERE state = 'running' AND locked_until < now()",
        1,
    )
    .await;
    let other = worker(&env.pool, |_| None);
    let started = Instant::now();
    let mut claimed = 0;
    while started.elapsed() < ms(500) {
        claimed += other.run_once().await.expect("round").claimed;
        tokio::time::sleep(ms(20)).await;
    }
    running.await.expect("no panic").expect("round");
    assert_eq!(proxy.fired(), 1);
    assert_eq!(claimed, 0);
    assert_eq!(env.effects("held").await, 1);
    assert_eq!(job_rows(&env, "held").await, 0);
}

/// Found: one panicking handler took the other runs of its worker's round
/// down with it (`join_all`): a healthy job claimed beside it had no effect
/// and stayed `running` for its lease. The panic is now that run's failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_a_panicking_handler_strands_the_other_jobs_of_its_round() {
    use futures_util::FutureExt;
    use std::panic::AssertUnwindSafe;
    let env = env().await;
    enqueue_new(&env, "calm").await;
    enqueue_new(&env, "boom").await;
    let w = Worker::new(env.pool.clone()).handle(|conn, job: &Compensate| {
        async move {
            if job.key == "boom" {
                panic!("handler bug");
            }
            tokio::time::sleep(ms(50)).await;
            record_effect(conn, &job.key, "").await?;
            Ok::<_, AppError>(())
        }
        .scope_boxed()
    });
    let _ = AssertUnwindSafe(w.run_once()).catch_unwind().await;
    // `calm`'s handler has no fault: its effect commits with its end. What
    // happens: its run is dropped with the round, and the job stays
    // `running` until its lease (60 s) runs out.
    let calm = env.jobs("calm").await;
    assert_eq!(
        (env.effects("calm").await, calm.len()),
        (1, 0),
        "calm: {calm:?}"
    );
}
