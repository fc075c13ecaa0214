//! Hostile pass (helper-55) on the seal's bound on the body's own `COMMIT`
//! under `Replication::Synchronous` (no cancel; a server without a
//! standby, so the no-cancel path runs), and a `COMMIT` left running at the
//! close. Split from `attack_session49`, whose helpers it uses.
use super::attack_session49::{checks, Expect, INS8, STUB8, TWICE};
use super::kit::*;
use super::*;
use idem::pool::Replication;

/// A pool that asks for a synchronous standby (none here: the no-cancel
/// path runs).
pub(super) fn sync_pool(env: &Env, size: usize) -> Pool {
    build_pool_with(
        env.db.pool_url(),
        &PoolConfig {
            max_size: size,
            wait_timeout: Duration::from_secs(60),
            replication: Replication::Synchronous,
            ..PoolConfig::default()
        },
    )
    .expect("a pool")
}

/// Held, `Replication::Synchronous` on a server without a standby: an 8 s
/// check that fails, a write behind its `COMMIT`, is held within 2 × 3 s +
/// slack (the seal waits as long again, with no cancel) over nothing
/// (documented); a 1.5 s check is read (committed:
/// held; failed: free); the body's `COMMIT` with no write after it: an 8 s
/// check is left to run (no cancel), held within 2 × 3 s, and commits
/// (n1 = 1). The 8 s check that succeeds, a write behind it, is the
/// `found_` test below.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack49_synchronous_waits_twice_the_bound() {
    let env = env_slow(2).await;
    if env.db.via().is_transaction_pooling() {
        return; // no cancel behind a transaction pooler (documented)
    }
    let pool = sync_pool(&env, 2);
    let w = |ms: u64, fail: bool| -> &'static [A] {
        Box::leak(Box::new([
            W(slow("slowc", ms, fail)),
            Q("COMMIT"),
            Ms(50),
            W(N3),
        ]))
    };
    let q = |ms: u64, fail: bool| -> &'static [A] {
        Box::leak(Box::new([W(slow("slowc", ms, fail)), Q("COMMIT"), Ms(50)]))
    };
    #[rustfmt::skip]
    let cases: Vec<Expect> = vec![
        (w(8000, true), PLAIN, Some(0), 6000, true),
        (w(1500, false), PLAIN, Some(1), 500, false),
        (w(1500, true), PLAIN, Some(0), 500, false),
        (q(8000, false), OK, Some(1), 6000, false),
        (q(1500, true), OK, Some(0), 500, false),
    ];
    verdict(&checks(&env, &pool, "sync", cases, TWICE).await);
}

/// Found (promise 5), fixed: on a `Replication::Synchronous` pool (a server with
/// no `synchronous_standby_names`, so the no-cancel path), the body
/// inserts into `slowc` (a deferred check sleeping 8 s, then succeeding),
/// queues its own `COMMIT`, then awaits (or queues) a write, and returns an
/// error (or `Ok`). As documented, the seal closes the connection at the
/// bound (3.0 s) with no cancel and the `COMMIT` counts as committed: the
/// key is held `unknown`, the repeat refused. But the `COMMIT` is then
/// cancelled anyway: 0.4 s after the answer no backend runs it, and 6 s
/// later nothing committed (n1 = 0): a hold over nothing, in 3 of 3 such keys (cases 0, 1,
/// 3) in each of 5 of 5 runs.
/// Controls: the same with a check that ignores cancels (`STUBBORN`)
/// commits (n1 = 1), so it is a cancel, not the close, that ends it; with
/// the write queued and `Ok` (case 2) idem's record rides ahead of the
/// `COMMIT` not yet written, no seal wait, and it runs on and commits. With a real synchronous standby that cancel turns the
/// `COMMIT`'s wait for the standby into a local commit, visible and not
/// replicated: what the no-cancel rule is there to prevent. Expected: the
/// `COMMIT` left running (an active backend after the answer) and n1 = 1.
/// Cause (read): after the seal's close, idem's rollback fails on the
/// closed connection and `Tx::refuse`/`rollback` calls
/// `cancel_and_discard` → `Tx::cancel_running` (tx/close.rs), whose guard
/// `waits_for_standby` asks `Wire::commit_in_flight` (wire/unanswered.rs),
/// false once the wire is `closed`: the cancel goes out. Fixed: the guard
/// asks `Wire::unanswered_may_commit`, closed or not; and the seal now waits as
/// long again before it closes (2 × 3 s here), with no cancel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_synchronous_commit_is_cancelled_after_the_seal_closes() {
    let env = env_slow(2).await;
    if env.db.via().is_transaction_pooling() {
        return; // no cancel behind a transaction pooler (documented)
    }
    env.client.batch_execute(STUBBORN).await.expect("stubborn");
    let pool = sync_pool(&env, 2);
    let running = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                   AND state = 'active' AND query = 'COMMIT'";
    #[rustfmt::skip]
    let cases: [(&'static [A], u8); 5] = [
        (&[W(INS8), Q("COMMIT"), Ms(50), W(N3)], PLAIN),
        (&[W(INS8), Q("COMMIT"), Ms(50), W(N3)], FINAL),
        (&[W(INS8), Q("COMMIT"), Q(N3)], OK),
        (&[W(INS8), Q("COMMIT"), Ms(50), D(N3)], PLAIN),
        (&[W(STUB8), Q("COMMIT"), Ms(50), W(N3)], PLAIN),
    ];
    let mut bad = Vec::new();
    for (i, (steps, end)) in cases.into_iter().enumerate() {
        let key = format!("synccancel-{i}");
        let s = probe(&env, &pool, V::Rc, &key, (steps, end), TEN * 3, 400).await;
        let left = env.scalar(running).await;
        tokio::time::sleep(Duration::from_millis(6000)).await;
        let n1 = n_of(&env, &key, 1).await;
        let what = format!(
            "{key} {steps:?} end {end}: {} in {:?} rec {:?}; COMMIT running after {left}, n1 {n1}",
            s.ans, s.took, s.rec
        );
        eprintln!("  {what}");
        if s.took > TWICE {
            bad.push(format!("{what}: slow"));
        }
        if left != 1 || n1 != 1 {
            bad.push(format!(
                "{what}: the COMMIT was cancelled (Synchronous: none is sent)"
            ));
        }
        if n1 == 0 && s.rec.is_some() {
            bad.push(format!("{what}: held over nothing"));
        }
    }
    bad.extend(hygiene(&env, &pool, "synccancel").await);
    verdict(&bad);
}

/// Held: the body inserts into a table whose deferred check outlasts the
/// wait (8 s), queues its own `COMMIT` and then a write (queued, or awaited
/// after 50 ms), and returns `Ok` or an error. The seal closes the
/// connection at the bound (no cancel: `Replication::Synchronous`, 3.0 s;
/// direct, a check that ignores the cancel: 6.0 s); the `COMMIT`, left
/// running, commits at 8 s (n1 = 1), and 8.5 s after the start the key is
/// held (`completed` where idem's record rode ahead of a `COMMIT` not yet
/// written, `unknown` otherwise) and the repeat refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack49_a_commit_left_running_at_the_close_holds_its_key() {
    let env = env_slow(2).await;
    if env.db.via().is_transaction_pooling() {
        return; // no cancel behind a transaction pooler (documented)
    }
    env.client.batch_execute(STUBBORN).await.expect("stubborn");
    let sync = sync_pool(&env, 2);
    #[rustfmt::skip]
    let cases: [(bool, &'static [A], u8); 6] = [
        (true, &[W(INS8), Q("COMMIT"), Q(N3)], OK),
        (true, &[W(INS8), Q("COMMIT"), Q(N3)], PLAIN),
        (false, &[W(STUB8), Q("COMMIT"), Q(N3)], OK),
        (false, &[W(STUB8), Q("COMMIT"), Q(N3)], PLAIN),
        (false, &[W(STUB8), Q("COMMIT"), Ms(50), W(N3)], OK),
        (false, &[W(STUB8), Q("COMMIT"), Ms(50), W(N3)], PLAIN),
    ];
    let mut bad = Vec::new();
    for (i, (on_sync, steps, end)) in cases.into_iter().enumerate() {
        let key = format!("leftfree-{i}");
        let pool = if on_sync { &sync } else { &env.pool };
        let s = probe(&env, pool, V::Rc, &key, (steps, end), TEN * 3, 400).await;
        tokio::time::sleep(Duration::from_millis(8500).saturating_sub(s.took)).await;
        let n1 = n_of(&env, &key, 1).await;
        let rec = env.record(&key).await.map(|r| r.0);
        let adds = repeat_adds(&env, &key).await;
        let what = format!(
            "{key} sync {on_sync} {steps:?} end {end}: {} in {:?}; then n1 {n1} rec {rec:?}, repeat added {adds}",
            s.ans, s.took
        );
        eprintln!("  {what}");
        if n1 > 0 && rec.is_none() {
            bad.push(format!("{what}: an effect committed, its key free"));
        }
        if n1 > 0 && adds != 0 {
            bad.push(format!("{what}: the repeat ran the body again"));
        }
        if s.took > TWICE {
            bad.push(format!("{what}: slow"));
        }
    }
    bad.extend(hygiene(&env, &env.pool, "leftfree").await);
    verdict(&bad);
}

/// Held, `Replication::Synchronous`: a statement behind the body's end
/// (`ROLLBACK; INSERT ..; SELECT pg_sleep(1)`, its own commit, which would
/// wait for the standby) is not cancelled when the seal refuses the next
/// write: the refusal closes at once, the key is held (it counts as
/// committed), and the `INSERT` commits when its request ends (this
/// server does not check for a closed client while it runs). With a
/// cancel, as before, the sleep was aborted and the `INSERT` with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack49_synchronous_behind_the_end_is_not_cancelled() {
    let env = env(2).await;
    if env.db.via().is_transaction_pooling() {
        return; // no cancel behind a transaction pooler either (documented)
    }
    let interval = "SELECT count(*) FROM pg_settings \
                    WHERE name = 'client_connection_check_interval' AND setting <> '0'";
    let checked = env.scalar(interval).await > 0;
    let pool = sync_pool(&env, 2);
    const BEHIND: &str =
        "ROLLBACK; INSERT INTO effects (tag, n) VALUES ('{k}', 2); SELECT pg_sleep(1)";
    let steps: &'static [A] = &[Q(BEHIND), Ms(50), W(N3)];
    let s = probe(&env, &pool, V::Rc, "behind", (steps, PLAIN), TEN, 1500).await;
    let what = format!("{}: in {:?} n {:?} rec {:?}", s.ans, s.took, s.ns, s.rec);
    assert!(s.took < Duration::from_millis(900), "waited: {what}");
    assert!(s.rec.is_some(), "not held: {what}");
    assert_eq!(s.ns.2, 0, "{what}");
    if !checked {
        assert_eq!(s.ns.1, 1, "cancelled: {what}");
    }
    verdict(&hygiene(&env, &pool, "behind").await);
}
