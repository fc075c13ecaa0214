//! Hostile pass (session 43) on d9b253c: a dropped local call whose body
//! queued its `COMMIT`, dropped while idem's own `ROLLBACK` is in flight
//! behind it (diesel-async's manager then broken), duplicates queued on the
//! pool behind it; what later callers on that pool get. Counted in the DB.
use super::kit::*;
use super::*;

/// A `COMMIT` slower than `commit_timeout_ms` (3 s), failing or not.
const BAD40: &str = "INSERT INTO slowc VALUES ('{k}', 4000, true)";
const OK40: &str = "INSERT INTO slowc VALUES ('{k}', 4000, false)";

/// The shapes whose queued `COMMIT` takes 300 ms (idem's `ROLLBACK` waits
/// behind it): succeeding, failing, serialization failure; a write behind.
#[rustfmt::skip]
const SHAPES: [&[A]; 6] = [&[W(OK3), Q("COMMIT"), Q(N2)], &[W(BAD3), Q("COMMIT"), Q(N2)],
    &[W(OK3), Q("COMMIT")], &[W(BAD3), Q("COMMIT")], &[W(SER3), Q("COMMIT"), Q(N2)],
    &[W(OK3), Q("COMMIT"), Q(N2), Q(N3)]];

/// Every shape, ends `PLAIN`/`FINAL`/`PANIC`, dropped 20-260 ms in
/// (inside idem's `ROLLBACK` behind the 300 ms `COMMIT`), `dups` queued.
async fn sweep(env: &Env, pool: &Pool, p: &str, v: V, dups: usize, rounds: u64) -> Vec<String> {
    let most = pool.status().max_size as i64;
    let mut done = Vec::new();
    for t in 0..rounds {
        let steps = SHAPES[(t % 6) as usize];
        let end = [PLAIN, FINAL, PANIC][(t / 6 % 3) as usize];
        let us = 20_000 + (t * 37_003) % 240_000;
        let key = format!("{p}-{t}");
        let (ans, _, dup) = with_dups(pool, v, &key, steps, end, Some(us), dups).await;
        done.push((
            key,
            format!("{steps:?} end {end} drop {us}us: {ans}; dups {dup:?}"),
        ));
    }
    settle_holds(env, p, 1500).await;
    let mut bad = Vec::new();
    for (key, what) in &done {
        bad.extend(wrong(env, v, key, what, most, false).await);
    }
    eprintln!("{p}: {} of {} keys wrong", bad.len(), done.len());
    bad.extend(later(env, pool, p, 9).await);
    bad
}

// ---------------------------------------------------------------------------

/// Pool of one, three duplicates queued behind a call dropped inside idem's
/// `ROLLBACK` (the broken-manager hand-off): at most one effect per key,
/// no hold over nothing, then later calls (savepoints among them) served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack43_pool_of_one_three_dups_behind_a_drop_in_the_rollback() {
    let env = env_slow(2).await;
    let one = pool_of(&env.db, 1);
    verdict(&sweep(&env, &one, "p1", V::Rc, 3, 36).await);
}

/// The same on a pool of two (two duplicates), and serializable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack43_pool_of_two_and_serializable_drop_in_the_rollback() {
    let env = env_slow(3).await;
    let two = pool_of(&env.db, 2);
    let one = pool_of(&env.db, 1);
    let mut bad = sweep(&env, &two, "p2", V::Rc, 2, 24).await;
    bad.extend(sweep(&env, &one, "s1", V::Sr, 3, 24).await);
    verdict(&bad);
}

/// Current-thread runtime (the driver writes only when the call yields).
#[tokio::test(flavor = "current_thread")]
async fn attack43_current_thread_drop_in_the_rollback_dups_queued() {
    let env = env_slow(2).await;
    let one = pool_of(&env.db, 1);
    let mut bad = sweep(&env, &one, "c1", V::Rc, 3, 24).await;
    bad.extend(sweep(&env, &env.pool, "c2", V::Rr, 2, 12).await);
    verdict(&bad);
}

/// Plain `#[retryable]` and external mode dropped the same way, pool of one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack43_plain_and_external_drop_in_the_rollback() {
    let env = env_slow(2).await;
    let one = pool_of(&env.db, 1);
    let mut bad = sweep(&env, &one, "pl", V::Plain, 2, 18).await;
    bad.extend(sweep(&env, &one, "ex", V::Ext, 3, 18).await);
    verdict(&bad);
}

/// Found (fixed): a body queues a `COMMIT` slower than `commit_timeout_ms`
/// (3 s; a 4 s deferred trigger, failing or not, a write behind it or not),
/// and its call is dropped inside idem's `ROLLBACK` behind it (200 ms in),
/// or as the body reaches its end (`HANG`), or it panics; pool of one, two
/// duplicates queued. Seen: keys held `unknown` with nothing committed
/// (n1 0), the duplicates refused `OutcomeUnknown`, 4 to 6 of 12 every run;
/// also for `OK40`, whose `COMMIT` would have committed had it not been
/// cancelled. Promise: no key held `unknown` unless the body's writes may
/// have committed. Cause: the hand-off's `ROLLBACK` timed out behind the
/// slow `COMMIT`, and `cancel_and_discard` cancelled that `COMMIT` without
/// reading its answer, which `ended::body_end` then counted as committed.
/// Fixed (session 42): a handed-on transaction whose `ROLLBACK` times out
/// cancels the statement running, keeps the write guard up, and reads the
/// answers (`send_rollback`); 0 of 12 wrong in each of 3 runs since.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_commit_slower_than_the_timeout_cancelled_then_held_over_nothing() {
    let env = env_slow(2).await;
    let p1 = pool_of(&env.db, 1);
    #[rustfmt::skip]
    const SLOW: [&[A]; 4] = [&[W(BAD40), Q("COMMIT"), Q(N2)], &[W(OK40), Q("COMMIT"), Q(N2)],
        &[W(BAD40), Q("COMMIT")], &[W(OK40), Q("COMMIT")]];
    let mut done = Vec::new();
    for (t, steps) in SLOW.iter().enumerate() {
        for (end, us) in [(PLAIN, Some(200_000)), (HANG, None), (PANIC, None)] {
            let key = format!("sl-{t}-{end}");
            let (ans, dup) = match us {
                Some(_) => {
                    let (ans, _, dup) = with_dups(&p1, V::Rc, &key, steps, end, us, 2).await;
                    (ans, dup)
                }
                None => (one(&p1, V::Rc, &key, &Q { steps, end }, None).await, vec![]),
            };
            done.push((
                key,
                format!("{steps:?} end {end} drop {us:?}: {ans}; dups {dup:?}"),
            ));
        }
    }
    settle_holds(&env, "sl", 5000).await;
    let mut bad = Vec::new();
    for (key, what) in &done {
        let (n1, rec) = (n_of(&env, key, 1).await, env.record(key).await);
        eprintln!("{key}: n1 {n1} {rec:?}");
        bad.extend(wrong(&env, V::Rc, key, what, 1, false).await);
    }
    eprintln!("{} of {} keys wrong", bad.len(), done.len());
    bad.extend(later(&env, &p1, "sl", 6).await);
    verdict(&bad);
}
