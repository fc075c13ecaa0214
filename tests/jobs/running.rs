//! A run: the handler's effect and the job's completion commit together,
//! under the retry loop; an open run is never claimed again.

use idem::attempt::current_attempt;

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_effect_and_the_completion_commit_together() {
    let env = env().await;
    enqueue_new(&env, "ok").await;
    enqueue_new(&env, "bad").await;
    let worker = worker(&env.pool, |job| {
        (job.key == "bad").then(|| "cannot compensate bad".to_owned())
    });
    let round = worker.run_once().await.expect("round");
    assert_eq!(
        (round.claimed, round.done, round.retried),
        (2, 1, 1),
        "{round:?}"
    );

    // Done: effect committed, job gone.
    assert_eq!(env.effects("ok").await, 1);
    assert!(env.jobs("ok").await.is_empty());
    // Failed: the effect the handler wrote rolled back with it; the job is
    // due again, its failure recorded.
    assert_eq!(env.effects("bad").await, 0);
    assert_eq!(
        env.jobs("bad").await,
        [(
            "due".to_owned(),
            1,
            Some("refused: cannot compensate bad".to_owned())
        )]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_attempt_applies_the_effect_once() {
    use diesel_async::RunQueryDsl;
    let env = env().await;
    enqueue_new(&env, "a").await;
    let calls = Calls::default();
    let seen = calls.clone();
    let worker = Worker::new(env.pool.clone()).handle(move |conn, job: &Compensate| {
        seen.tick();
        async move {
            record_effect(conn, &job.key, "").await?;
            if current_attempt() == Some(1) {
                // A real 40001 from the server, after the effect was written.
                diesel::sql_query(
                    "DO $$ BEGIN RAISE EXCEPTION 'could not serialize access' \
                     USING ERRCODE = 'serialization_failure'; END $$",
                )
                .execute(conn)
                .await?;
            }
            Ok::<_, AppError>(())
        }
        .scope_boxed()
    });
    let round = worker.run_once().await.expect("round");
    assert_eq!(round.done, 1, "{round:?}");
    assert_eq!(calls.get(), 2, "replayed once by the retry loop");
    assert_eq!(env.effects("a").await, 1);
    assert!(env.jobs("a").await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_run_is_not_claimed_again_past_its_lease() {
    use diesel_async::RunQueryDsl;
    let env = env().await;
    enqueue_new(&env, "slow").await;
    let slow = Worker::new(env.pool.clone())
        .lease(Duration::from_millis(100))
        .handle(|conn, job: &Compensate| {
            async move {
                record_effect(conn, &job.key, "slow").await?;
                diesel::sql_query("SELECT pg_sleep(0.8)")
                    .execute(conn)
                    .await?;
                Ok::<_, AppError>(())
            }
            .scope_boxed()
        });
    let running = tokio::spawn(async move { slow.run_once().await });
    // The lease runs out while the run's transaction is open: another
    // worker polling all along claims nothing.
    // Once the handler sleeps, its transaction holds the job's row (`FOR
    // KEY SHARE`, which no claim passes).
    env.until(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
         AND query = 'SELECT pg_sleep(0.8)' AND state = 'active'",
        1,
    )
    .await;
    env.until(
        "SELECT count(*) FROM idem_jobs WHERE state = 'running' AND locked_until < now()",
        1,
    )
    .await;
    let other = worker(&env.pool, |_| None);
    let started = Instant::now();
    let mut claimed = 0;
    while started.elapsed() < Duration::from_millis(500) {
        claimed += other.run_once().await.expect("round").claimed;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(claimed, 0);
    let round = running.await.expect("no panic").expect("round");
    assert_eq!(round.done, 1, "{round:?}");
    assert_eq!(env.effects("slow").await, 1);
    assert!(env.jobs("slow").await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_that_does_not_decode_dies_at_once() {
    let env = env().await;
    env.client
        .execute(
            "INSERT INTO idem_jobs (kind, key, payload) VALUES ('compensate', 'odd', '{\"nope\": 1}')",
            &[],
        )
        .await
        .expect("insert");
    let round = worker(&env.pool, |_| None).run_once().await.expect("round");
    assert_eq!(round.dead, 1, "{round:?}");
    let jobs = env.jobs("odd").await;
    assert_eq!((jobs[0].0.as_str(), jobs[0].1), ("dead", 1));
    let error = jobs[0].2.as_deref().unwrap_or_default();
    assert!(error.contains("does not decode"), "{error}");
    assert_eq!(env.effects("odd").await, 0);
}

/// A payload serde_json cannot read back (nested 200 deep, a number beyond
/// `f64`: written by hand, or before `enqueue` refused such bodies) is
/// dead at once with why, and the rest of the round runs. Before, the
/// claim's own read failed: every round failed, the jobs it had marked
/// running waited out their lease, and the due ones behind them waited.
/// The dead listing reads them too, their stored text as a JSON string,
/// marked unreadable: unlike a payload that is a JSON string (one that
/// does not decode as the job, dead too, beside them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_that_cannot_be_read_back_is_dead_and_the_round_runs() {
    let env = env().await;
    let deep = format!(
        r#"{{"key": "deep", "x": {}{}}}"#,
        "[".repeat(200),
        "]".repeat(200)
    );
    let huge = r#"{"key": "huge", "n": 1e400}"#;
    let by_hand = "INSERT INTO idem_jobs (kind, key, payload, run_at) \
                   VALUES ('compensate', $1, $2::text::jsonb, now() - interval '1 second')";
    let text = r#""{\"key\": \"text\"}""#; // a string that reads as the others
    for (key, payload) in [("deep", deep.as_str()), ("huge", huge), ("text", text)] {
        env.client
            .execute(by_hand, &[&key, &payload])
            .await
            .unwrap();
    }
    enqueue_new(&env, "ok").await;
    let round = worker(&env.pool, |_| None)
        .run_once()
        .await
        .expect("the claim");
    assert_eq!(
        (round.claimed, round.done, round.dead),
        (4, 1, 3),
        "{round:?}"
    );
    for key in ["deep", "huge", "text"] {
        let jobs = env.jobs(key).await;
        let [(state, attempts, Some(error))] = &jobs[..] else {
            panic!("{key}: {jobs:?}")
        };
        assert_eq!((state.as_str(), *attempts), ("dead", 1), "{key}");
        assert!(
            error.starts_with("the payload does not decode: "),
            "{key}: {error}"
        );
        assert_eq!(env.effects(key).await, 0);
    }
    let mut conn = env.pool.get().await.unwrap();
    let dead = idem::jobs::dead(&mut conn, Some("compensate"), 10)
        .await
        .unwrap();
    let keys: Vec<&str> = dead.iter().map(|d| d.key.as_str()).collect();
    assert_eq!(keys.len(), 3, "{keys:?}");
    for d in &dead {
        let text = d
            .payload
            .as_str()
            .expect("the stored text, as a JSON string");
        assert!(
            text.contains(&format!(r#""key": "{}""#, d.key)),
            "{text:.80}"
        );
        assert_eq!(d.payload_unreadable, d.key != "text", "{}", d.key);
    }
    let listed = idem::operate::dead_jobs(&env.pool, None, idem::operate::Page::default())
        .await
        .unwrap();
    assert_eq!(listed.len(), 3);
    for row in &listed {
        let stored = row.payload.as_str().unwrap_or_default();
        let bytes = match row.key.as_str() {
            "text" => r#""{\"key\": \"text\"}""#.len(),
            _ => stored.len(),
        };
        assert_eq!(row.payload_bytes(), bytes, "{}", row.key);
        assert_eq!(row.payload_unreadable, row.key != "text", "{}", row.key);
    }
}

/// A handler that swaps its connection (writing through one of its own,
/// which commits at once) and fails makes its job dead at its first run:
/// each run would swap again and write again (it was due again after the
/// ladder's step, its write committed each time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_swaps_its_connection_makes_its_job_dead_at_once() {
    swaps_its_connection("swap", true).await;
}

/// So does one that swaps and returns `Ok`: the job's end is not written
/// through the connection it swapped in, outside the job's transaction
/// (before, the job was deleted there and the run read as lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_swaps_its_connection_and_succeeds_makes_its_job_dead() {
    swaps_its_connection("swap-ok", false).await;
}

async fn swaps_its_connection(key: &'static str, fails: bool) {
    let env = env().await;
    enqueue_new(&env, key).await;
    let url = env.db.url().to_owned();
    let worker = Worker::new(env.pool.clone())
        .ladder(Ladder::new([Duration::ZERO; 3])) // due again at once, were it retried
        .handle(move |conn, job: &Compensate| {
            let url = url.clone();
            async move {
                let mut own = AsyncPgConnection::establish(&url).await.expect("connect");
                record_effect(&mut own, &job.key, "own").await?;
                std::mem::swap(conn, &mut own);
                match fails {
                    true => Err(AppError::Refused("failed after the swap".into())),
                    false => Ok(()),
                }
            }
            .scope_boxed()
        });
    let round = worker.run_once().await.expect("round");
    assert_eq!((round.claimed, round.dead), (1, 1), "{round:?}");
    let jobs = env.jobs(key).await;
    let [(state, 1, Some(error))] = &jobs[..] else {
        panic!("{jobs:?}")
    };
    assert_eq!(state, "dead");
    assert!(error.contains("swapped"), "{error}");
    let again = worker.run_once().await.expect("round");
    assert_eq!(again.claimed, 0, "{again:?}");
    assert_eq!(env.effects(key).await, 1, "written once");
}
