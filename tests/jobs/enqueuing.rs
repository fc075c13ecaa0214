//! Enqueue: one unfinished job per (kind, key), in the deciding transaction
//! or not at all, and never outside an attempt.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_collapse_into_the_unfinished_job() {
    let env = env().await;
    let first = decide(&env.pool, &Compensate::new("a"))
        .await
        .expect("enqueue");
    assert!(first.is_new(), "{first:?}");
    let again = decide(&env.pool, &Compensate::new("a"))
        .await
        .expect("enqueue");
    assert_eq!(again, Enqueued::Collapsed(first.id()));
    let other = decide(&env.pool, &Compensate::new("b"))
        .await
        .expect("enqueue");
    assert!(other.is_new() && other.id() != first.id(), "{other:?}");
    assert_eq!(env.scalar("SELECT count(*) FROM idem_jobs").await, 2);

    // Eight deciders at once: the unique index lets one write.
    let racers = (0..8).map(|_| {
        let pool = env.pool.clone();
        tokio::spawn(async move { decide(&pool, &Compensate::new("hot")).await })
    });
    let mut outcomes = Vec::new();
    for racer in racers {
        outcomes.push(racer.await.expect("no panic").expect("enqueue"));
    }
    assert_eq!(
        outcomes.iter().filter(|o| o.is_new()).count(),
        1,
        "{outcomes:?}"
    );
    assert!(
        outcomes.iter().all(|o| o.id() == outcomes[0].id()),
        "{outcomes:?}"
    );
    assert_eq!(env.jobs("hot").await.len(), 1);

    // Once the job ran, deciding again is a new job.
    let round = worker(&env.pool, |_| None).run_once().await.expect("round");
    assert_eq!(round.claimed, 3);
    assert_eq!(env.effects("hot").await, 1);
    assert_eq!(env.scalar("SELECT count(*) FROM idem_jobs").await, 0);
    let after = decide(&env.pool, &Compensate::new("hot"))
        .await
        .expect("enqueue");
    assert!(
        after.is_new() && after.id() != outcomes[0].id(),
        "{after:?}"
    );

    // A dead job does not swallow a new decision either.
    env.client
        .execute(
            "UPDATE idem_jobs SET state = 'dead', last_error = 'gave up', failed_at = now()",
            &[],
        )
        .await
        .expect("park it");
    let fresh = decide(&env.pool, &Compensate::new("hot"))
        .await
        .expect("enqueue");
    assert!(fresh.is_new(), "{fresh:?}");
    let states: Vec<String> = env.jobs("hot").await.into_iter().map(|j| j.0).collect();
    assert_eq!(states, ["dead", "due"]);
}

#[retryable(max = 4, deadline_ms = 30000)]
async fn decide_then_refuse(conn: &mut AsyncPgConnection, key: &str) -> Result<(), AppError> {
    enqueue(conn, &Compensate::new(key)).await?;
    Err(AppError::Refused("the business rule said no".into()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enqueue_rolls_back_with_its_transaction() {
    let env = env().await;
    let refused = decide_then_refuse(&env.pool, "a").await;
    assert!(matches!(refused, Err(AppError::Refused(_))), "{refused:?}");
    assert_eq!(env.scalar("SELECT count(*) FROM idem_jobs").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enqueue_outside_an_attempt_is_refused() {
    let env = env().await;
    let mut conn = AsyncPgConnection::establish(env.db.url())
        .await
        .expect("connect");
    let bare = enqueue(&mut conn, &Compensate::new("a")).await;
    assert!(
        matches!(bare, Err(EnqueueError::OutsideAttempt)),
        "{bare:?}"
    );
    // A transaction of the caller's own is not an attempt either.
    let in_tx: Result<Enqueued, EnqueueError> = conn
        .transaction(async |conn| enqueue(conn, &Compensate::new("a")).await)
        .await;
    assert!(
        matches!(in_tx, Err(EnqueueError::OutsideAttempt)),
        "{in_tx:?}"
    );
    assert_eq!(env.scalar("SELECT count(*) FROM idem_jobs").await, 0);

    let invalid = decide(&env.pool, &Compensate::new("")).await;
    assert!(
        matches!(invalid, Err(AppError::Enqueue(EnqueueError::Invalid(_)))),
        "{invalid:?}"
    );
    assert_eq!(env.scalar("SELECT count(*) FROM idem_jobs").await, 0);
}
