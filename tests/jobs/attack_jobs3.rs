//! Hostile pass (helper, session 52) on af1382d: each claimed payload read
//! back on its own. Payloads written by hand in forms jsonb takes and
//! serde_json may not read back; a requeue of such a dead job; the dead
//! listings (`jobs::dead`, `operate::dead_jobs`) and `jobs::stats`. What
//! happened is read from `idem_jobs` and `effects`.
use super::*;

/// Write a due job of kind `compensate` by hand, `payload` as jsonb text.
async fn by_hand(env: &Env, key: &str, payload: &str) {
    let sql = "INSERT INTO idem_jobs (kind, key, payload, run_at) \
               VALUES ('compensate', $1, $2::text::jsonb, now() - interval '1 second')";
    env.client.execute(sql, &[&key, &payload]).await.unwrap();
}

/// Forms jsonb accepts: those serde_json cannot read back (numbers beyond
/// `f64` in every spelling, nested past 128) die at once with why; those
/// it reads (an underflow, a huge integer, escaped unicode, a 1 MB
/// string) run once; the round runs them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack52_every_unreadable_form_is_dead_and_the_readable_ones_run() {
    let env = env().await;
    let digits = format!("1{}", "0".repeat(400));
    let deep_obj = format!(
        r#"{{"key": "a52-deepobj", "x": {}1{}}}"#,
        r#"{"a":"#.repeat(150),
        "}".repeat(150)
    );
    let unreadable = [
        (
            "a52-negbig",
            r#"{"key": "a52-negbig", "n": -1e400}"#.to_owned(),
        ),
        (
            "a52-digits",
            format!(r#"{{"key": "a52-digits", "n": {digits}}}"#),
        ),
        (
            "a52-frac",
            format!(r#"{{"key": "a52-frac", "n": {digits}.5}}"#),
        ),
        ("a52-deepobj", deep_obj),
    ];
    let big = "x".repeat(1 << 20);
    let readable = [
        ("a52-tiny", r#"{"key": "a52-tiny", "n": 1e-400}"#.to_owned()),
        (
            "a52-long",
            r#"{"key": "a52-long", "n": 123456789012345678901234567890}"#.to_owned(),
        ),
        (
            "a52-negzero",
            r#"{"key": "a52-negzero", "n": -0}"#.to_owned(),
        ),
        (
            "a52-esc",
            r#"{"key": "a52-esc", "s": "\ud83d\ude00 \u00e9"}"#.to_owned(),
        ),
        ("a52-big", format!(r#"{{"key": "a52-big", "s": "{big}"}}"#)),
    ];
    for (key, payload) in unreadable.iter().chain(readable.iter()) {
        by_hand(&env, key, payload).await;
    }
    // A lone surrogate is refused by jsonb itself: never stored.
    let lone = env
        .client
        .execute(
            "INSERT INTO idem_jobs (kind, key, payload) VALUES ('compensate', 'lone', $1::text::jsonb)",
            &[&r#"{"key": "lone", "s": "\ud800"}"#],
        )
        .await;
    assert!(lone.is_err(), "jsonb took a lone surrogate");
    let round = worker(&env.pool, |_| None)
        .run_once()
        .await
        .expect("the claim");
    assert_eq!(
        (round.claimed, round.done, round.dead),
        (9, 5, 4),
        "{round:?}"
    );
    for (key, _) in &unreadable {
        let jobs = env.jobs(key).await;
        let [(state, 1, Some(error))] = &jobs[..] else {
            panic!("{key}: {jobs:?}")
        };
        assert_eq!(state, "dead", "{key}");
        assert!(
            error.starts_with("the payload does not decode: "),
            "{key}: {error}"
        );
        assert_eq!(env.effects(key).await, 0, "{key}");
    }
    for (key, _) in &readable {
        assert_eq!(env.effects(key).await, 1, "{key}");
        assert!(env.jobs(key).await.is_empty(), "{key}");
    }
    // Both listings read them, each as its stored text.
    let mut conn = env.pool.get().await.unwrap();
    let dead = idem::jobs::dead(&mut conn, None, 100).await.unwrap();
    assert_eq!(dead.len(), 4);
    assert!(dead.iter().all(|d| d.payload.is_string()), "{dead:.200?}");
    let stats = idem::jobs::stats(&mut conn).await.unwrap();
    assert_eq!(stats.dead, 4, "{stats:?}");
    let listed = idem::operate::dead_jobs(&env.pool, None, idem::operate::Page::default())
        .await
        .unwrap();
    assert_eq!(listed.len(), 4);
}

/// A dead unreadable job requeued (by id, and with every dead job by
/// `operate::requeue_dead_jobs`) is claimed again, dead again at once
/// with its run counted, and the good job of the same round runs: the
/// queue does not stall.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack52_a_requeued_unreadable_job_dies_again_and_the_queue_runs() {
    let env = env().await;
    by_hand(&env, "a52-rq", r#"{"key": "a52-rq", "n": 1e400}"#).await;
    let w = worker(&env.pool, |_| None);
    let round = w.run_once().await.unwrap();
    assert_eq!((round.claimed, round.dead), (1, 1), "{round:?}");
    for pass in 0..3 {
        let requeued = idem::operate::requeue_dead_jobs(&env.pool, None, 10)
            .await
            .unwrap();
        assert_eq!(requeued.len(), 1, "pass {pass}");
        assert_eq!(requeued[0].1, idem::operate::JobRequeue::Due, "pass {pass}");
        let good = format!("a52-good-{pass}");
        enqueue_new(&env, &good).await;
        let round = w.run_once().await.unwrap();
        assert_eq!(
            (round.claimed, round.done, round.dead),
            (2, 1, 1),
            "pass {pass}: {round:?}"
        );
        assert_eq!(env.effects(&good).await, 1);
        let jobs = env.jobs("a52-rq").await;
        let [(state, attempts, Some(_))] = &jobs[..] else {
            panic!("{jobs:?}")
        };
        assert_eq!((state.as_str(), *attempts), ("dead", pass + 2));
    }
    assert_eq!(env.effects("a52-rq").await, 0);
    assert_eq!(
        env.scalar("SELECT count(*) FROM idem_jobs WHERE state <> 'dead'")
            .await,
        0
    );
}
