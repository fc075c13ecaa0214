//! Hostile pass (helper-56, session 50) on c235525: idem's own `COMMIT`
//! held by the seal behind a `COMMIT` the body queued in a text and
//! returned `Ok` over (`Tx::send_commit`'s wait for the seal's answer), in
//! plain `#[retryable]` and local mode; and `Replication::Synchronous`
//! pools with statements behind a `ROLLBACK` of the body's.
use super::attack_session49::{held_iff, TWICE};
use super::attack_sync_standby::sync_pool;
use super::kit::*;
use super::*;

/// Whether `ans` tells the truth about `n1` (the body's effect): `Ok` or
/// `TransactionEnded { committed: true }` over a committed effect; neither
/// `Ok` nor `committed: true` over none.
fn truthful(ans: &str, committed: bool) -> bool {
    let ok = ans.starts_with("Ok(");
    let says_committed = ans.contains("committed: true");
    match committed {
        true => ok || says_committed,
        false => !ok && !says_committed,
    }
}

/// The body writes (a deferred check taking `ms`, failing or not, through
/// `slowc` or the cancel-ignoring `stubc`), queues `COMMIT` in a text of its
/// own (alone or after a `SELECT 1`), lets the driver write it (50 ms) and
/// returns `Ok`: idem's `COMMIT` is the write the seal holds back. Under
/// plain `#[retryable]` and local mode: the answer within 2 × 3 s + slack,
/// and true to what committed (n1 counted); local: held iff n1 committed,
/// the repeat runs iff free; then hygiene.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack50_idems_commit_held_behind_a_queued_commit_answers_truly() {
    let env = env_slow(2).await;
    if env.db.via().is_transaction_pooling() {
        return; // no cancel behind a transaction pooler (documented)
    }
    env.client.batch_execute(STUBBORN).await.expect("stubborn");
    let body = |table: &str, ms: u64, fail: bool, text: &'static str| -> &'static [A] {
        Box::leak(Box::new([W(slow(table, ms, fail)), Q(text), Ms(50)]))
    };
    #[rustfmt::skip]
    let cases: Vec<(&'static [A], Option<i64>)> = vec![
        (body("slowc", 2500, false, "COMMIT"), Some(1)),
        (body("slowc", 2500, true, "SELECT 1; COMMIT"), Some(0)),
        (body("slowc", 2500, false, "SELECT 1; END"), Some(1)),
        (body("slowc", 3500, false, "COMMIT"), Some(0)),
        (body("stubc", 5000, false, "SELECT 1; COMMIT"), Some(1)),
        (body("stubc", 5000, true, "COMMIT"), Some(0)),
    ];
    let mut bad = Vec::new();
    for v in [V::Plain, V::Rc] {
        for (i, &(steps, n1)) in cases.iter().enumerate() {
            let key = format!("held50-{v:?}-{i}");
            let s = probe(&env, &env.pool, v, &key, (steps, OK), TEN * 3, 500).await;
            let what = format!(
                "{key} {steps:?}: {} in {:?} n {:?} rec {:?}",
                s.ans, s.took, s.ns, s.rec
            );
            if s.took > TWICE {
                bad.push(format!("{what}: answered after {TWICE:?}"));
            }
            if n1.is_some_and(|n| n != s.ns.0) || s.ns.2 != 0 {
                bad.push(format!("{what}: expected n1 = {n1:?}, n3 = 0"));
            }
            if !truthful(&s.ans, s.ns.0 > 0) {
                bad.push(format!("{what}: the answer is untrue to n1"));
            }
            if plain(v) {
                continue;
            }
            bad.extend(held_iff(&env, &key, &what, s.ns.0, s.rec.is_some(), false).await);
        }
    }
    bad.extend(hygiene(&env, &env.pool, "held50").await);
    verdict(&bad);
}

/// `Replication::Synchronous` (this server has no standby): the body sends
/// `ROLLBACK` and statements behind it in one text (a transaction of their
/// own with a slow deferred check, or autocommit writes), then awaits a
/// write (refused) or returns `Ok` (idem's `COMMIT` refused). Per case
/// after 9 s: n2 (committed outside idem's transaction) counted; the key
/// held iff n2 committed (a hold over nothing allowed only where the
/// statement fails after the refusal closed, unread: documented); the
/// answer never says nothing committed over n2 = 1, nor is `Ok`; the
/// repeat runs iff free; each call within 2 × 3 s + slack; hygiene.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack50_synchronous_statements_behind_a_rollback() {
    let env = env_slow(2).await;
    if env.db.via().is_transaction_pooling() {
        return; // no cancel behind a transaction pooler (documented)
    }
    let pool = sync_pool(&env, 2);
    const TX2: &str = "ROLLBACK; BEGIN; INSERT INTO effects (tag, n) VALUES ('{k}', 2); \
        INSERT INTO slowc VALUES ('{k}', 2000, false); COMMIT";
    const TX4: &str = "ROLLBACK; BEGIN; INSERT INTO effects (tag, n) VALUES ('{k}', 2); \
        INSERT INTO slowc VALUES ('{k}', 4500, false); COMMIT";
    const TX2F: &str = "ROLLBACK; BEGIN; INSERT INTO effects (tag, n) VALUES ('{k}', 2); \
        INSERT INTO slowc VALUES ('{k}', 2000, true); COMMIT";
    const AUTO: &str = "ROLLBACK; INSERT INTO effects (tag, n) VALUES ('{k}', 2); \
        INSERT INTO slowc VALUES ('{k}', 1500, false)";
    const AUTOF: &str = "ROLLBACK; INSERT INTO slowc VALUES ('{k}', 1500, true); \
        INSERT INTO effects (tag, n) VALUES ('{k}', 2)";
    #[rustfmt::skip]
    let cases: Vec<(&'static [A], u8, bool)> = vec![
        (&[Q(TX2), Ms(50), W(N3)], PLAIN, false),
        (&[Q(TX2), Ms(50)], OK, false),
        (&[Q(TX4), Ms(50), W(N3)], PLAIN, false),
        (&[Q(TX4), Ms(50)], OK, false),
        (&[Q(TX2F), Ms(50), W(N3)], PLAIN, false),
        (&[Q(TX2F), Ms(50)], OK, false),
        (&[Q(AUTO), Ms(50), W(N3)], PLAIN, true),
        (&[Q(AUTOF), Ms(50)], OK, true),
    ];
    let mut bad = Vec::new();
    for v in [V::Rc, V::Plain] {
        for (i, &(steps, end, lax)) in cases.iter().enumerate() {
            let key = format!("syncrb-{v:?}-{i}");
            let s = probe(&env, &pool, v, &key, (steps, end), TEN * 3, 0).await;
            tokio::time::sleep(Duration::from_millis(9000).saturating_sub(s.took)).await;
            let (n1, n2, n3) = (
                n_of(&env, &key, 1).await,
                n_of(&env, &key, 2).await,
                n_of(&env, &key, 3).await,
            );
            let rec = env.record(&key).await.map(|r| r.0);
            let what = format!(
                "{key} {steps:?} end {end}: {} in {:?}; then n ({n1}, {n2}, {n3}) rec {rec:?}",
                s.ans, s.took
            );
            eprintln!("    {what}");
            if s.took > TWICE {
                bad.push(format!("{what}: answered after {TWICE:?}"));
            }
            if n1 + n3 != 0 {
                bad.push(format!(
                    "{what}: a write inside idem's transaction committed"
                ));
            }
            if s.ans.starts_with("Ok(") || (n2 > 0 && s.ans.contains("committed: false")) {
                bad.push(format!("{what}: the answer is untrue to n2"));
            }
            if plain(v) {
                continue;
            }
            bad.extend(held_iff(&env, &key, &what, n2, rec.is_some(), lax).await);
        }
    }
    bad.extend(hygiene(&env, &pool, "syncrb").await);
    verdict(&bad);
}

/// `Replication::Synchronous` (no standby on this server): the body's own
/// `COMMIT` (a deferred check of 4.5 s or 8 s, succeeding or failing) on
/// the wire, then the body returns an error, panics, or its call is
/// dropped: no seal refusal, idem's rollback and `Tx::cancel_running`
/// decide. Per case after 9.5 s: a succeeding check committed (n1 = 1: no
/// cancel went out), a failing one did not; held iff n1 (over nothing
/// allowed only for the 8 s check outlasting 2 × 3 s, documented); the
/// answer never `committed: false` over n1 = 1, nor `Ok`; within 2 × 3 s +
/// slack; the repeat runs iff free; hygiene.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack50_synchronous_body_commit_then_an_error_or_a_drop() {
    let env = env_slow(2).await;
    if env.db.via().is_transaction_pooling() {
        return; // no cancel behind a transaction pooler (documented)
    }
    let pool = sync_pool(&env, 2);
    let q = |ms: u64, fail: bool| -> &'static [A] {
        Box::leak(Box::new([W(slow("slowc", ms, fail)), Q("COMMIT"), Ms(50)]))
    };
    #[rustfmt::skip]
    let cases: Vec<(V, &'static [A], u8, bool, bool)> = vec![
        (V::Rc, q(8000, false), PLAIN, true, false),
        (V::Rc, q(8000, false), FINAL, true, false),
        (V::Rc, q(8000, false), PANIC, true, false),
        (V::Rc, q(8000, false), HANG, true, false),
        (V::Rc, q(8000, true), PLAIN, false, true),
        (V::Rc, q(4500, false), PLAIN, true, false),
        (V::Rc, q(4500, true), FINAL, false, false),
        (V::Plain, q(8000, false), PLAIN, true, false),
        (V::Plain, q(4500, true), PLAIN, false, false),
    ];
    let mut bad = Vec::new();
    for (i, &(v, steps, end, commits, lax)) in cases.iter().enumerate() {
        let key = format!("syncerr-{v:?}-{i}");
        let s = probe(&env, &pool, v, &key, (steps, end), TEN * 3, 0).await;
        tokio::time::sleep(Duration::from_millis(9500).saturating_sub(s.took)).await;
        let n1 = n_of(&env, &key, 1).await;
        let rec = env.record(&key).await.map(|r| r.0);
        let what = format!(
            "{key} {steps:?} end {end}: {} in {:?}; then n1 {n1} rec {rec:?}",
            s.ans, s.took
        );
        eprintln!("    {what}");
        if s.took > TWICE {
            bad.push(format!("{what}: answered after {TWICE:?}"));
        }
        if n1 != i64::from(commits) {
            bad.push(format!("{what}: expected n1 = {}", i64::from(commits)));
        }
        if s.ans.starts_with("Ok(") || (n1 > 0 && s.ans.contains("committed: false")) {
            bad.push(format!("{what}: the answer is untrue to n1"));
        }
        if plain(v) {
            continue;
        }
        bad.extend(held_iff(&env, &key, &what, n1, rec.is_some(), lax).await);
    }
    bad.extend(hygiene(&env, &pool, "syncerr").await);
    verdict(&bad);
}

/// The body writes (a deferred check through `slowc` or `stubc`), queues
/// `COMMIT` (alone or after a `SELECT 1`), lets the driver write it and
/// returns `Ok`; idem's `COMMIT` is held by the seal, and the caller drops
/// the call during that wait (0.5 s, 1 s or 4 s in), direct and
/// `Replication::Synchronous` pools. Per case 9.5 s after the start: never
/// an effect committed with its key free (a hold over nothing is allowed:
/// a `COMMIT` whose answer the dropped call never read, documented); the
/// repeat runs iff free; hygiene on both pools.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack50_dropped_while_idems_commit_is_held() {
    let env = env_slow(2).await;
    if env.db.via().is_transaction_pooling() {
        return; // no cancel behind a transaction pooler (documented)
    }
    env.client.batch_execute(STUBBORN).await.expect("stubborn");
    let sync = sync_pool(&env, 2);
    let body = |table: &str, ms: u64, fail: bool, text: &'static str| -> &'static [A] {
        Box::leak(Box::new([W(slow(table, ms, fail)), Q(text), Ms(50)]))
    };
    #[rustfmt::skip]
    let cases: Vec<(bool, &'static [A], u64)> = vec![
        (false, body("slowc", 2500, false, "COMMIT"), 1_000_000),
        (false, body("slowc", 2500, false, "SELECT 1; COMMIT"), 500_000),
        (false, body("slowc", 2500, true, "COMMIT"), 1_000_000),
        (false, body("slowc", 3500, false, "COMMIT"), 1_000_000),
        (false, body("slowc", 8000, false, "SELECT 1; COMMIT"), 4_000_000),
        (false, body("stubc", 5000, false, "COMMIT"), 4_000_000),
        (false, body("stubc", 7500, false, "COMMIT"), 4_000_000),
        (true, body("slowc", 2500, false, "COMMIT"), 1_000_000),
        (true, body("slowc", 4500, false, "SELECT 1; COMMIT"), 4_000_000),
        (true, body("slowc", 8000, false, "COMMIT"), 4_000_000),
    ];
    let mut bad = Vec::new();
    for (i, &(on_sync, steps, us)) in cases.iter().enumerate() {
        let key = format!("drop50-{i}");
        let pool = if on_sync {
            sync.clone()
        } else {
            env.pool.clone()
        };
        let t0 = Instant::now();
        let (p, k) = (pool.clone(), key.clone());
        let task =
            tokio::spawn(async move { one(&p, V::Rc, &k, &Q { steps, end: OK }, Some(us)).await });
        let ans = task.await.unwrap_or_else(|_| "task panicked".into());
        let took = t0.elapsed();
        tokio::time::sleep(Duration::from_millis(9500).saturating_sub(took)).await;
        let n1 = n_of(&env, &key, 1).await;
        let n3 = n_of(&env, &key, 3).await;
        let rec = env.record(&key).await.map(|r| r.0);
        let what = format!("{key} sync {on_sync} {steps:?} drop {us} us: {ans} in {took:?}; then n1 {n1} n3 {n3} rec {rec:?}");
        eprintln!("    {what}");
        if n3 != 0 {
            bad.push(format!("{what}: a nested write ran"));
        }
        let held = rec.is_some();
        if n1 > 0 && !held {
            bad.push(format!("{what}: an effect committed, its key free"));
        }
        let adds = repeat_adds(&env, &key).await;
        if adds != i64::from(!held) {
            bad.push(format!("{what}: the repeat added {adds}"));
        }
    }
    bad.extend(hygiene(&env, &env.pool, "drop50").await);
    bad.extend(hygiene(&env, &sync, "drop50s").await);
    verdict(&bad);
}

/// The body queues its own `COMMIT` (a deferred check through `slowc` or
/// `stubc`), then sleeps past or near `commit_timeout_ms` (2.9 s, 3.5 s)
/// before it returns `Ok`: idem's `COMMIT`, held by the seal, is sent after
/// the body's `COMMIT`'s bound (or just before it) ran out, so the seal's
/// second wait and `send_commit`'s own timeout run out together. Direct and
/// `Replication::Synchronous` pools. Per case, 10 s after the start: the
/// answer within the body's sleep + 2 × 3 s + slack and true to n1 (never
/// `Ok`, never `committed: false` over n1 = 1), held iff n1 (a hold over
/// nothing allowed only for a check outlasting the wait, documented), the
/// repeat runs iff free; hygiene.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack50_body_sleeps_past_the_bound_after_its_commit() {
    let env = env_slow(2).await;
    if env.db.via().is_transaction_pooling() {
        return; // no cancel behind a transaction pooler (documented)
    }
    env.client.batch_execute(STUBBORN).await.expect("stubborn");
    let sync = sync_pool(&env, 2);
    let body = |table: &str, ms: u64, fail: bool, nap: u64| -> &'static [A] {
        Box::leak(Box::new([W(slow(table, ms, fail)), Q("COMMIT"), Ms(nap)]))
    };
    #[rustfmt::skip]
    let cases: Vec<(bool, &'static [A], u64, bool)> = vec![
        (false, body("slowc", 8000, false, 3500), 3500, false),
        (false, body("stubc", 5000, false, 3500), 3500, false),
        (false, body("slowc", 8000, false, 2900), 2900, false),
        (true, body("slowc", 8000, false, 3500), 3500, true),
        (true, body("slowc", 5000, true, 3500), 3500, false),
        (true, body("slowc", 8000, true, 2900), 2900, true),
        (true, body("slowc", 5800, false, 2900), 2900, false),
    ];
    let mut bad = Vec::new();
    for (i, &(on_sync, steps, nap, lax)) in cases.iter().enumerate() {
        let key = format!("nap50-{i}");
        let pool = if on_sync { &sync } else { &env.pool };
        let s = probe(&env, pool, V::Rc, &key, (steps, OK), TEN * 3, 0).await;
        tokio::time::sleep(Duration::from_millis(10000).saturating_sub(s.took)).await;
        let n1 = n_of(&env, &key, 1).await;
        let rec = env.record(&key).await.map(|r| r.0);
        let what = format!(
            "{key} sync {on_sync} {steps:?}: {} in {:?}; then n1 {n1} rec {rec:?}",
            s.ans, s.took
        );
        eprintln!("    {what}");
        let limit = TWICE + Duration::from_millis(nap);
        if s.took > limit {
            bad.push(format!("{what}: answered after {limit:?}"));
        }
        if s.ans.starts_with("Ok(") || (n1 > 0 && s.ans.contains("committed: false")) {
            bad.push(format!("{what}: the answer is untrue to n1"));
        }
        bad.extend(held_iff(&env, &key, &what, n1, rec.is_some(), lax).await);
    }
    bad.extend(hygiene(&env, &env.pool, "nap50").await);
    bad.extend(hygiene(&env, &sync, "nap50s").await);
    verdict(&bad);
}
