//! Failures climb the ladder (default 5 s, 30 s, 2 min), then the job dies
//! with its last error; a requeue runs it again; the counts.

use std::sync::atomic::AtomicBool;

use idem::jobs::{dead, enqueue_after, requeue, stats, Requeued};

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_ladder_waits_5s_30s_2min_then_the_job_dies() {
    let env = env().await;
    assert_eq!(Ladder::default().steps(), Ladder::DEFAULT_STEPS);
    enqueue_new(&env, "a").await;
    let calls = Calls::default();
    // The worker's own default ladder, not one built by the test.
    let calls_in = calls.clone();
    let worker = worker(&env.pool, move |_| {
        calls_in.tick();
        Some(format!("call {}", calls_in.get()))
    });

    for (run, step_ms) in [(1, 5_000), (2, 30_000), (3, 120_000)] {
        let round = worker.run_once().await.expect("round");
        assert_eq!(
            (round.claimed, round.retried),
            (1, 1),
            "run {run}: {round:?}"
        );
        assert_eq!(
            env.jobs("a").await,
            [("due".to_owned(), run, Some(format!("refused: call {run}")))]
        );
        // Stored in database time: due exactly one step after the failure.
        assert_eq!(step_waited(&env, "a").await, step_ms, "run {run}");
        // Not due before its step: a poll now finds nothing.
        assert_eq!(worker.run_once().await.expect("round").claimed, 0);
        env.make_due_now().await;
    }
    let round = worker.run_once().await.expect("round");
    assert_eq!(round.dead, 1, "{round:?}");
    assert_eq!(
        env.jobs("a").await,
        [("dead".to_owned(), 4, Some("refused: call 4".to_owned()))]
    );
    assert_eq!(calls.get(), 4);
    assert_eq!(env.effects("a").await, 0, "every failed run rolled back");
    // Dead stays dead: due-time games do not bring it back.
    env.make_due_now().await;
    assert_eq!(worker.run_once().await.expect("round").claimed, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scaled_ladder_really_waits_its_steps() {
    let env = env().await;
    let calls = Calls::default();
    let seen = calls.clone();
    let worker = worker(&env.pool, move |_| {
        seen.tick();
        (seen.get() <= 2).then(|| "not yet".to_owned())
    })
    .ladder(Ladder::default().scaled(0.03)); // 150 ms, 900 ms, 3.6 s
    let started = Instant::now();
    enqueue_new(&env, "a").await;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(worker.run(async move {
        let _ = stopped.await;
    }));
    env.until("SELECT count(*) FROM effects", 1).await;
    let took = started.elapsed();
    let _ = stop.send(());
    task.await.expect("no panic").expect("run");
    assert_eq!(calls.get(), 3);
    assert!(took >= Duration::from_millis(1050), "{took:?}");
    assert_eq!(env.effects("a").await, 1);
    assert_eq!(env.scalar("SELECT count(*) FROM idem_jobs").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_job_is_requeued_and_runs_again() {
    let env = env().await;
    let broken = Arc::new(AtomicBool::new(true));
    let flag = Arc::clone(&broken);
    // No steps: the first failure kills the job.
    let worker = worker(&env.pool, move |_| {
        flag.load(Ordering::SeqCst)
            .then(|| "the payment provider is down".to_owned())
    })
    .ladder(Ladder::new([]));
    let id = enqueue_new(&env, "a").await;
    assert_eq!(worker.run_once().await.expect("round").dead, 1);

    let mut conn = env.pool.get().await.expect("conn");
    let listed = dead(&mut conn, Some("compensate"), 10).await.expect("dead");
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].id, id);
    assert_eq!(listed[0].key, "a");
    assert_eq!(listed[0].attempts, 1);
    assert_eq!(
        listed[0].last_error,
        "refused: the payment provider is down"
    );
    assert_eq!(
        serde_json::from_value::<Compensate>(listed[0].payload.clone()).expect("payload"),
        Compensate::new("a")
    );
    assert!(dead(&mut conn, Some("other"), 10)
        .await
        .expect("dead")
        .is_empty());

    assert_eq!(
        requeue(&mut conn, id).await.expect("requeue"),
        Requeued::Due
    );
    assert_eq!(
        env.jobs("a").await,
        [(
            "due".to_owned(),
            1,
            Some("refused: the payment provider is down".to_owned())
        )],
        "due again, last error kept; the run count is every run's token and stays"
    );
    assert_eq!(
        env.scalar("SELECT ladder_from::bigint FROM idem_jobs WHERE key = 'a'")
            .await,
        1,
        "the ladder starts afresh from here"
    );
    broken.store(false, Ordering::SeqCst);
    assert_eq!(worker.run_once().await.expect("round").done, 1);
    assert_eq!(env.effects("a").await, 1);
    assert_eq!(
        requeue(&mut conn, id).await.expect("requeue"),
        Requeued::NotDead
    );

    // A dead job whose (kind, key) has a live one again stays dead.
    broken.store(true, Ordering::SeqCst);
    let dead_b = enqueue_new(&env, "b").await;
    assert_eq!(worker.run_once().await.expect("round").dead, 1);
    // Dead jobs leave the unique index: deciding again writes a new one.
    enqueue_new(&env, "b").await;
    assert_eq!(
        requeue(&mut conn, dead_b).await.expect("requeue"),
        Requeued::LiveExists
    );
    let states: Vec<String> = env.jobs("b").await.into_iter().map(|j| j.0).collect();
    assert_eq!(states, ["dead", "due"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requeued_job_climbs_the_whole_ladder_again() {
    let env = env().await;
    // One step: the second failure kills the job.
    let worker = worker(&env.pool, |_| Some("down".to_owned()))
        .ladder(Ladder::new([Duration::from_secs(3600)]));
    let id = enqueue_new(&env, "a").await;
    assert_eq!(worker.run_once().await.expect("round").retried, 1);
    env.make_due_now().await;
    assert_eq!(worker.run_once().await.expect("round").dead, 1);
    let mut conn = env.pool.get().await.expect("conn");
    assert_eq!(
        requeue(&mut conn, id).await.expect("requeue"),
        Requeued::Due
    );
    // The third run is the first failure of its new ladder: it waits the
    // first step instead of dying.
    assert_eq!(worker.run_once().await.expect("round").retried, 1);
    assert_eq!(
        env.jobs("a").await,
        [("due".to_owned(), 3, Some("refused: down".to_owned()))]
    );
    assert_eq!(step_waited(&env, "a").await, 3_600_000);
    env.make_due_now().await;
    assert_eq!(worker.run_once().await.expect("round").dead, 1);
    assert_eq!(env.jobs("a").await[0].1, 4);
}

#[retryable(max = 4, deadline_ms = 30000)]
async fn decide_later(conn: &mut AsyncPgConnection, key: &str) -> Result<(), AppError> {
    enqueue_after(conn, &Compensate::new(key), Duration::from_secs(3600)).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_count_what_the_table_holds() {
    let env = env().await;
    for key in ["due-1", "due-2", "dead", "running"] {
        enqueue_new(&env, key).await;
    }
    decide_later(&env.pool, "later").await.expect("enqueue");
    // One dies (no steps), the others are set up by hand.
    let killer = worker(&env.pool, |job| {
        (job.key == "dead").then(|| "no".to_owned())
    })
    .ladder(Ladder::new([]));
    env.client
        .execute(
            "UPDATE idem_jobs SET state = 'running', locked_until = now() + interval '1 minute'
             WHERE key = 'running'",
            &[],
        )
        .await
        .expect("hold one");
    env.client
        .execute(
            "UPDATE idem_jobs SET run_at = now() + interval '1 hour' WHERE key LIKE 'due-%'",
            &[],
        )
        .await
        .expect("later");
    env.client
        .execute(
            "UPDATE idem_jobs SET run_at = now() WHERE key = 'dead'",
            &[],
        )
        .await
        .expect("due");
    assert_eq!(killer.run_once().await.expect("round").dead, 1);
    env.client
        .execute(
            "UPDATE idem_jobs SET run_at = now() - interval '10 seconds' WHERE key = 'due-1'",
            &[],
        )
        .await
        .expect("overdue");

    let mut conn = env.pool.get().await.expect("conn");
    let got = stats(&mut conn).await.expect("stats");
    let counted = |state: &'static str| {
        let env = &env;
        async move {
            env.client
                .query_one("SELECT count(*) FROM idem_jobs WHERE state = $1", &[&state])
                .await
                .expect("count")
                .get::<_, i64>(0)
        }
    };
    assert_eq!(
        (got.due, got.running, got.dead),
        (
            counted("due").await,
            counted("running").await,
            counted("dead").await
        )
    );
    assert_eq!((got.due, got.running, got.dead), (3, 1, 1));
    let overdue = got.oldest_due.expect("due-1 is overdue");
    assert!(
        overdue >= Duration::from_secs(10) && overdue < Duration::from_secs(60),
        "{overdue:?}"
    );
}
