//! Session 46: a statement the body pipelined behind its own `ROLLBACK`,
//! still running when the seal refuses the next write. It runs outside
//! idem's transaction and commits on its own, so its answer decides whether
//! the key is held; the seal now cancels it and reads that answer before it
//! closes the connection (`Wire::stops_behind_end`). Counted in the
//! database.
use super::kit::*;
use super::*;

/// `ROLLBACK`, then a write that only comes after a sleep (the cancel
/// reaches it in the sleep).
const LATE_WRITE: &str =
    "ROLLBACK; SELECT pg_sleep(0.5); INSERT INTO effects (tag, n) VALUES ('{k}', 2)";
const LONG_LATE_WRITE: &str =
    "ROLLBACK; SELECT pg_sleep(5); INSERT INTO effects (tag, n) VALUES ('{k}', 2)";
/// `ROLLBACK`, then a write done before a cancel could reach it.
const WRITE: &str = "ROLLBACK; INSERT INTO effects (tag, n) VALUES ('{k}', 2)";

/// Found (fixed): the body queues `ROLLBACK; SELECT pg_sleep(0.5); INSERT ..`
/// and a write behind it (polled once, or awaited), then returns `Ok` or a
/// plain error. The seal refused the second write and closed the
/// connection at once; idem's `ROLLBACK` then failed and it cancelled what
/// the backend still ran, unseen: the `INSERT` never ran, yet the key was
/// held `unknown` over nothing (12 of 12 calls: the statement, unanswered
/// on a closed connection, had to count as committed). Without the sleep,
/// the same race held a key over nothing now and then
/// (`attack_session39`'s `found_pipelined_rollback_..`, 2 of 6 runs). Now
/// the refused write waits for the statement's answer, the statement
/// cancelled at once: nothing is held, the call answers `TransactionEnded {
/// committed: false }` well within `commit_timeout_ms` (3 s; the awaited
/// write behind a 5 s sleep included), and the repeat runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_a_write_behind_a_rollback_cancelled_unseen_held_the_key_over_nothing() {
    let env = env(2).await;
    if env.db.via().is_transaction_pooling() {
        return; // no cancel behind a transaction pooler (documented)
    }
    #[rustfmt::skip]
    let cases: &[(&'static [A], u8)] = &[(&[Q(LATE_WRITE), Q(N3)], PLAIN), (&[Q(LATE_WRITE), Q(N3)], OK),
        (&[Q(LONG_LATE_WRITE), Ms(50), W(N3)], PLAIN), (&[Q(LONG_LATE_WRITE), Ms(50), W(N3)], OK)];
    let mut bad = Vec::new();
    for (key, ans, took) in spawned_calls(&env, "wb", cases, 3).await {
        let what = format!("{key} {ans} in {took:?}");
        if env.effects(&key).await != 0 {
            bad.push(format!("{what}: something committed"));
        }
        if let Some(rec) = env.record(&key).await {
            bad.push(format!("{what}: held {rec:?} over nothing"));
        }
        if !ans.contains("TransactionEnded { committed: false") || took.as_millis() > 2500 {
            bad.push(what.clone());
        }
        let again = one(&env.pool, V::Rc, &key, &EMPTY, None).await;
        if env.effects(&key).await != 1 {
            bad.push(format!("{what}: the repeat did not run once: {again}"));
        }
    }
    bad.extend(hygiene(&env, &env.pool, "wb").await);
    verdict(&bad);
}

/// The same shapes with the write done before the cancel could reach it:
/// it committed on its own, the call answers `committed: true`, and the
/// key is held over it (the repeat is refused), whichever way the body
/// ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_behind_a_rollback_that_committed_holds_the_key() {
    let env = env(2).await;
    #[rustfmt::skip]
    let cases: &[(&'static [A], u8)] = &[(&[W(WRITE), Q(N3)], PLAIN), (&[W(WRITE), Q(N3)], OK),
        (&[W(WRITE), W(N3)], FINAL)];
    let mut bad = Vec::new();
    for (key, ans, _) in spawned_calls(&env, "wc", cases, 3).await {
        let ns = (
            n_of(&env, &key, 1).await,
            n_of(&env, &key, 2).await,
            n_of(&env, &key, 3).await,
        );
        if ns != (0, 1, 0) || !ans.contains("TransactionEnded { committed: true") {
            bad.push(format!("{key} {ans}: n1/n2/n3 {ns:?}, not 0/1/0"));
        }
        if env.record(&key).await.is_none() {
            bad.push(format!("{key} {ans}: committed, no hold"));
        }
        let again = one(&env.pool, V::Rc, &key, &EMPTY, None).await;
        if env.effects(&key).await != 1 {
            bad.push(format!("{key} {ans}: the repeat ran: {again}"));
        }
    }
    bad.extend(hygiene(&env, &env.pool, "wc").await);
    verdict(&bad);
}
