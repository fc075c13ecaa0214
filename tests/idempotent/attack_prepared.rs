//! Hostile passes at a body's own `PREPARE TRANSACTION` (docs/idempotent.md,
//! "A body's `PREPARE TRANSACTION` counts as its commit"; docs/retryable.md,
//! "Transaction control is idem's"). Effects are counted in the database:
//! rows, `pg_prepared_xacts`, `idem_requests`, the effects' sequence (one
//! value per attempt). Each test starts a server of its own.
use super::kit::*;
use super::*;
use tokio::sync::Notify;

use super::prepared::{env_max, prepared, PREPARE as GID};

const CP: &str = "COMMIT PREPARED 'p-{k}'";
const RP: &str = "ROLLBACK PREPARED 'p-{k}'";

fn leak(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}

fn leak_steps(v: Vec<A>) -> &'static [A] {
    Box::leak(v.into_boxed_slice())
}

/// Values the effects' sequence gave out: one per attempt (and per n = 2, 3 run).
async fn attempts_so_far(env: &Env) -> i64 {
    let q = "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM effects_id_seq";
    env.scalar(q).await
}

/// Every transaction prepared in this database rolled back (the database
/// can then be dropped).
async fn rollback_all(env: &Env) {
    let q = "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()";
    for row in env.client.query(q, &[]).await.unwrap() {
        let gid: String = row.get(0);
        let sql = format!("ROLLBACK PREPARED '{gid}'");
        let _ = env.client.batch_execute(&sql).await;
    }
}

/// The shapes a body's `PREPARE` `p` goes out in, after `pre`.
fn shapes(pre: &[A], p: &'static str) -> Vec<(&'static str, &'static [A])> {
    let with = |tail: &[A]| leak_steps(pre.iter().chain(tail).copied().collect());
    let in_text = leak(format!("{N3}; {p}"));
    let jp: &'static [&'static str] = Box::leak(vec![p, N2].into_boxed_slice());
    let xp = leak(format!("x:{p}"));
    let jx: &'static [&'static str] = Box::leak(vec![xp, N2].into_boxed_slice());
    vec![
        ("awaited", with(&[W(p)])),
        ("returned", with(&[E(p)])),
        ("then-write", with(&[W(p), W(N2)])),
        ("queued", with(&[Q(p), Ms(50)])),
        ("queued-write", with(&[Q(p), Q(N2), Ms(50)])),
        ("extended", with(&[D(p)])),
        ("extended-dropped", with(&[X(p), Ms(50)])),
        ("in-text", with(&[W(in_text)])),
        ("pipelined", with(&[J(jp)])),
        ("pipelined-x", with(&[J(jx)])),
    ]
}

/// What is wrong with `key` after a call whose body's `PREPARE` failed:
/// it must be answered `committed: false`, nothing visible or prepared
/// (but the outside one, `held`), the key free in local mode (a repeat
/// runs the body), held in external mode (its outside call may have run).
#[rustfmt::skip]
async fn free_after_failure(env: &Env, v: V, key: &str, s: &Seen, held: i64) -> Vec<String> {
    let mut bad = Vec::new();
    let what = format!("{key} {v:?}: {} n {:?} rec {:?}", s.ans, s.ns, s.rec);
    if !s.ans.contains("TransactionEnded { committed: false }") {
        bad.push(format!("{what}: not answered TransactionEnded {{ committed: false }}"));
    }
    let (all, _) = prepared(env, "").await;
    if s.ns != (0, 0, 0) || all != held {
        bad.push(format!("{what}: {all} prepared, expected nothing visible, {held} prepared"));
    }
    if plain(v) {
        return bad;
    }
    let before = env.effects(key).await;
    let again = tokio::time::timeout(TEN, call(&env.pool, v, key, &EMPTY, &Notify::new())).await;
    let ran = env.effects(key).await - before;
    let expected = i64::from(v != V::Ext);
    if ran != expected || (v != V::Ext && s.rec.is_some()) || (v == V::Ext && s.rec.is_none()) {
        bad.push(format!("{what}: a repeat ran {ran} (expected {expected}): {again:?}"));
    }
    bad
}

/// A `PREPARE` that fails ends the transaction rolled back: a gid in use,
/// no slot left (`max_prepared_transactions = 1`, taken by an outside
/// transaction), a gid too long, a temporary table, a `NOTIFY`, a deferred
/// check that fails (as a serialization failure too, under `max = 4`), a
/// transaction already failed. In every shape, in local and external mode
/// and a plain `#[retryable]`: answered `TransactionEnded { committed: false
/// }`, one attempt (never replayed), nothing committed or prepared, no write
/// behind it run, the local key free, the external one held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_a_failed_prepare_commits_nothing_and_frees_a_local_key() {
    let (_cluster, env) = env_max("1").await;
    let outside = "BEGIN; INSERT INTO effects (tag, n) VALUES ('outside', 9); \
                   PREPARE TRANSACTION 'held'";
    env.client.batch_execute(outside).await.expect("outside");
    let long = leak(format!("PREPARE TRANSACTION '{}'", "g".repeat(250)));
    let (vs, races): (&[V], &[V]) = (&[V::Rc, V::Ext, V::Plain], &[V::Rc4, V::Pl4]);
    #[rustfmt::skip]
    let kinds: Vec<(&str, Vec<A>, &'static str, &[V])> = vec![
        ("dup", vec![], "PREPARE TRANSACTION 'held'", vs),
        ("full", vec![], GID, vs),
        ("long", vec![], long, vs),
        ("temp", vec![W("CREATE TEMP TABLE tmpx (a int)")], GID, vs),
        ("notify", vec![W("NOTIFY idem_chan")], GID, vs),
        ("check", vec![W(BAD0)], GID, vs),
        ("aborted", vec![W("SELECT 1/0")], GID, vs),
        ("race", vec![W("INSERT INTO serc VALUES ('{k}', 0)")], GID, races),
    ];
    let mut bad = Vec::new();
    for (kind, pre, p, vs) in &kinds {
        for (shape, steps) in shapes(pre, p) {
            // Aborted: the text's INSERT fails first, its PREPARE never runs.
            if (*kind, shape) == ("aborted", "in-text") {
                continue;
            }
            for &v in *vs {
                let key = format!("fail-{kind}-{shape}-{v:?}");
                let before = attempts_so_far(&env).await;
                let s = probe(&env, &env.pool, v, &key, (steps, OK), TEN, 0).await;
                let attempts = attempts_so_far(&env).await - before;
                let extra = i64::from(matches!(shape, "in-text" | "pipelined-x"));
                if *kind == "race" && attempts != 1 + extra {
                    bad.push(format!("{key}: {} after {attempts} attempts", s.ans));
                }
                bad.extend(free_after_failure(&env, v, &key, &s, 1).await);
            }
        }
    }
    bad.extend(hygiene(&env, &env.pool, "fail").await);
    rollback_all(&env).await;
    verdict(&bad);
}

/// Whether the key is as it must be once the body's `PREPARE` ran
/// (`prepared`) or not: the answer, `pg_prepared_xacts`, nothing visible
/// (or, for `ran_on`, the body's own `COMMIT PREPARED` that ran), the
/// record, and a repeat.
#[rustfmt::skip]
async fn as_prepared(env: &Env, v: V, key: &str, s: &Seen, prepared_: bool, finish: &str)
    -> Vec<String> {
    if !prepared_ {
        return free_after_failure(env, v, key, s, 0).await;
    }
    let mut bad = Vec::new();
    let what = format!("{key} {v:?}: {} n {:?} rec {:?}", s.ans, s.ns, s.rec);
    if !s.ans.contains("TransactionEnded { committed: true }") {
        bad.push(format!("{what}: not answered TransactionEnded {{ committed: true }}"));
    }
    let (all, mine) = prepared(env, &format!("p-{key}")).await;
    if s.ns != (0, 0, 0) || all != 1 || mine != 1 {
        bad.push(format!("{what}: {all} prepared ({mine} its own), expected one, nothing seen"));
    }
    // Finished first: a local duplicate would wait on the prepared
    // transaction's advisory lock up to its deadline.
    let finish = format!("{finish} PREPARED 'p-{key}'");
    let _ = env.client.batch_execute(&finish).await;
    if !plain(v) {
        // External mode's claim, left by a dropped call, holds too.
        let claim = v == V::Ext && s.rec.as_deref() == Some("in_progress");
        let held = s.rec.as_deref() == Some("unknown") || claim;
        let before = env.effects(key).await;
        let r = tokio::time::timeout(TEN, call(&env.pool, v, key, &EMPTY, &Notify::new())).await;
        let ran = env.effects(key).await - before;
        if !held || ran != 0 {
            bad.push(format!(
                "{what}: key not held ({:?}) or a repeat ran {ran}: {r:?}",
                s.rec
            ));
        }
    }
    bad
}

/// A `PREPARE` behind a deferred check slower than `commit_timeout_ms` (3
/// s), queued (`Q`) or sent through the extended protocol and dropped
/// before its answer (`X`), then `Ok`: the seal waits for it up to 3 s,
/// cancels it and reads its answer up to 3 s more. A check that stops at
/// the cancel prepares nothing (`committed: false`, the local key free);
/// one that ignores it and ends at 4 s prepares (`committed: true`, the
/// key held, a write queued behind it never run) or fails (nothing).
/// Behind a transaction pooler no cancel is sent: the first prepares too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_a_slow_prepare_is_cancelled_or_read_within_twice_commit_timeout() {
    let (_cluster, env) = env_max("8").await;
    let pooled = env.db.via().is_transaction_pooling();
    let (all, two, one_): (&[V], &[V], &[V]) =
        (&[V::Rc, V::Ext, V::Plain], &[V::Rc, V::Plain], &[V::Rc]);
    #[rustfmt::skip]
    let cases: Vec<(&str, &'static [A], bool, &[V])> = vec![
        ("cancelled", leak_steps(vec![W(slow("slowc", 4000, false)), Q(GID)]), pooled, all),
        ("stubborn", leak_steps(vec![W(slow("stubc", 4000, false)), Q(GID)]), true, all),
        ("stubborn-bad", leak_steps(vec![W(slow("stubc", 4000, true)), Q(GID)]), false, &all[..2]),
        ("x-cancelled", leak_steps(vec![W(slow("slowc", 4000, false)), X(GID)]), pooled, two),
        ("x-stubborn", leak_steps(vec![W(slow("stubc", 4000, false)), X(GID)]), true, one_),
        ("x-stubborn-write", leak_steps(vec![W(slow("stubc", 4000, false)), X(GID), Q(N2)]), true, two),
    ];
    let mut bad = Vec::new();
    for (name, steps, prepares, shapes) in cases {
        for &v in shapes {
            let key = format!("slow-{name}-{v:?}");
            let s = probe(&env, &env.pool, v, &key, (steps, OK), TEN, 300).await;
            if s.took > Duration::from_millis(6800) {
                bad.push(format!("{key}: answered after {:?}", s.took));
            }
            bad.extend(as_prepared(&env, v, &key, &s, prepares, "ROLLBACK").await);
            rollback_all(&env).await;
        }
    }
    bad.extend(hygiene(&env, &env.pool, "slow").await);
    verdict(&bad);
}

/// Waits for the key's background work: no deferred check still running,
/// then up to 8 s for a record when `held` is expected (1 s otherwise).
async fn settled(env: &Env, key: &str, held: bool) {
    let busy = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                AND pid <> pg_backend_pid() AND state = 'active' AND query ~ 'slowc|stubc'";
    eventually(TEN, || async { env.scalar(busy).await == 0 }).await;
    let record = || async { env.record(key).await.is_some() };
    if !held || !eventually(Duration::from_secs(8), record).await {
        tokio::time::sleep(Duration::from_millis(1000)).await;
    }
}

/// The seen state of `key`, now.
#[rustfmt::skip]
async fn seen(env: &Env, key: &str, ans: String, took: Duration) -> Seen {
    let ns = (n_of(env, key, 1).await, n_of(env, key, 2).await, n_of(env, key, 3).await);
    let rec = env.record(key).await.map(|r| r.0);
    eprintln!("  {key}: {ans} in {took:?}; n {ns:?} rec {rec:?}");
    Seen { ans, took, ns, rec }
}

/// Kills the backend of the call whose last statement is a `PREPARE` in
/// `state` (`active`: while it runs; `idle`: once answered).
fn kill_when(env: &Env, state: &'static str) -> tokio::task::JoinHandle<bool> {
    let url = env.db.url().to_owned();
    tokio::spawn(async move {
        let side = side_connection(&url).await;
        let q = "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE datname = current_database() AND pid <> pg_backend_pid() \
                 AND query LIKE 'PREPARE TRANSACTION%' AND state = $1";
        let until = Instant::now() + TEN;
        while Instant::now() < until {
            if !side.query(q, &[&state]).await.unwrap().is_empty() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        false
    })
}

/// A case around a `PREPARE`: its name, the body's steps and end, when the
/// call is dropped (µs), the backend state at which it is killed, whether
/// something is prepared (`None`: either).
type Around = (
    &'static str,
    &'static [A],
    u8,
    Option<u64>,
    Option<&'static str>,
    Option<bool>,
);

/// Around the body's `PREPARE`: the call dropped while it runs (a check of
/// 1 s that passes or fails; one of 4.5 s, cancelled at `commit_timeout_ms`
/// but behind a pooler), a panic or a drop after it, the backend killed
/// once it is answered. The key is held exactly when something was
/// prepared (one killed while the `PREPARE` runs may be held over nothing,
/// as documented: its answer never came). Local and external mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_a_call_dropped_panicking_or_killed_around_its_prepare_holds_what_it_prepared() {
    let (_cluster, env) = env_max("8").await;
    let pooled = env.db.via().is_transaction_pooling();
    #[rustfmt::skip]
    let cases: [Around; 7] = [
        ("drop-ok", leak_steps(vec![W(slow("slowc", 1000, false)), W(GID)]), OK, Some(400_000), None, Some(true)),
        ("drop-bad", leak_steps(vec![W(slow("slowc", 1000, true)), W(GID)]), OK, Some(400_000), None, Some(false)),
        ("drop-slow", leak_steps(vec![W(slow("slowc", 4500, false)), W(GID)]), OK, Some(400_000), None,
            Some(pooled)),
        ("panic", leak_steps(vec![W(GID)]), PANIC, None, None, Some(true)),
        ("hang", leak_steps(vec![W(GID)]), HANG, None, None, Some(true)),
        ("killed-after", leak_steps(vec![W(GID), Ms(300)]), OK, None, Some("idle"), Some(true)),
        ("killed-during", leak_steps(vec![W(slow("slowc", 1500, false)), W(GID)]), OK, None, Some("active"), None),
    ];
    let mut bad = Vec::new();
    for v in [V::Rc, V::Ext] {
        for &(name, steps, end, drop_us, kill, prepares) in &cases {
            let key = format!("around-{name}-{v:?}");
            let killer = kill.map(|state| kill_when(&env, state));
            let t0 = Instant::now();
            let (p, k) = (env.pool.clone(), key.clone());
            let task =
                tokio::spawn(async move { one(&p, v, &k, &Q { steps, end }, drop_us).await });
            let ans = task.await.unwrap_or_else(|_| "task panicked".into());
            let took = t0.elapsed();
            if let Some(killer) = killer {
                if !killer.await.unwrap_or(false) {
                    bad.push(format!("{key}: its backend was never found to kill"));
                }
            }
            settled(&env, &key, prepares != Some(false)).await;
            let s = seen(&env, &key, ans.chars().take(90).collect(), took).await;
            // External mode, dropped or panicked: the key is held by its
            // claim whatever the `PREPARE` did (closed with the call).
            let lax = v == V::Ext && !s.ans.starts_with("Err(");
            match prepares.filter(|_| !lax) {
                Some(p) => {
                    let mut found = as_prepared(&env, v, &key, &s, p, "ROLLBACK").await;
                    if !s.ans.starts_with("Err(") {
                        // Dropped or panicked: no answer to judge.
                        found.retain(|b| !b.contains("not answered TransactionEnded"));
                    }
                    bad.extend(found);
                }
                None => {
                    let (all, _) = prepared(&env, "").await;
                    // Held over nothing only when its answer never came.
                    let held = s.rec.is_some();
                    let ok = s.ans.starts_with("Ok");
                    if ok || ((all == 1 || lax) && !held) || s.ns != (0, 0, 0) {
                        let (a, n, r) = (&s.ans, s.ns, &s.rec);
                        bad.push(format!("{key}: {a} prepared {all} n {n:?} rec {r:?}"));
                    }
                }
            }
            rollback_all(&env).await;
        }
    }
    bad.extend(hygiene(&env, &env.pool, "around").await);
    verdict(&bad);
}

/// After its `PREPARE` the body goes on: it tries to finish its own
/// two-phase commit (`COMMIT PREPARED`, `ROLLBACK PREPARED`: awaited,
/// through the extended protocol, queued, pipelined, in the same text), or
/// sends an end of its own (`ROLLBACK`, the very bytes of idem's own, which
/// the seal lets through; `COMMIT`, the very text of idem's, which a record
/// may ride on), or prepared from inside a savepoint (whose rollback then
/// goes out after the end), or sent the `PREPARE` through the extended
/// protocol and dropped it unanswered. Nothing it sends after the end goes
/// out, nothing undoes or hides what was prepared: answered `committed:
/// true`, exactly its own transaction prepared, nothing visible, the key
/// held; once finished from outside, its effects (n = 1, n = 3 from the
/// savepoint) appear, never n = 2. A write in the same text as the
/// `PREPARE` runs (documented) and is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_a_body_going_on_after_its_prepare_neither_finishes_nor_hides_it() {
    let (_cluster, env) = env_max("8").await;
    let (in_text, in_text_w) = (leak(format!("{GID}; {CP}")), leak(format!("{GID}; {N2}")));
    let xp = leak(format!("x:{GID}"));
    let jqr: &'static [&'static str] = Box::leak(vec![GID, "ROLLBACK"].into_boxed_slice());
    let jx: &'static [&'static str] = Box::leak(vec![xp, "x:SELECT 1"].into_boxed_slice());
    #[rustfmt::skip]
    let cases: Vec<(&str, &'static [A], i64)> = vec![
        ("commit", leak_steps(vec![W(GID), W(CP)]), 0),
        ("commit-x", leak_steps(vec![W(GID), D("COMMIT PREPARED 'p-{k}'")]), 0),
        ("rollback", leak_steps(vec![W(GID), W(RP)]), 0),
        ("rollback-x", leak_steps(vec![W(GID), D("ROLLBACK PREPARED 'p-{k}'")]), 0),
        ("queued", leak_steps(vec![Q(GID), Q(CP), Ms(50)]), 0),
        ("pipelined", leak_steps(vec![J(&[GID, CP, N2])]), 0),
        ("in-text", leak_steps(vec![W(in_text)]), 0),
        ("savepoint", leak_steps(vec![Nest(GID, false)]), 1),
        ("savepoint-queued", leak_steps(vec![Nest(GID, true), Ms(50)]), 1),
        ("savepoint-then", leak_steps(vec![Nest(GID, false), W(N2), W(CP)]), 1),
        ("end-rollback", leak_steps(vec![W(GID), W("ROLLBACK")]), 0),
        ("end-rollback-queued", leak_steps(vec![W(GID), Q("ROLLBACK")]), 0),
        ("end-both-queued-rollback", leak_steps(vec![Q(GID), Q("ROLLBACK")]), 0),
        ("end-both-queued-rollback-sent", leak_steps(vec![Q(GID), Q("ROLLBACK"), Ms(50)]), 0),
        ("end-rollback-then-write", leak_steps(vec![W(GID), W("ROLLBACK"), W(N2)]), 0),
        ("end-commit", leak_steps(vec![W(GID), W("COMMIT")]), 0),
        ("end-commit-queued", leak_steps(vec![W(GID), Q("COMMIT")]), 0),
        ("end-both-queued-commit", leak_steps(vec![Q(GID), Q("COMMIT")]), 0),
        ("end-both-queued-commit-sent", leak_steps(vec![Q(GID), Q("COMMIT"), Ms(50)]), 0),
        ("end-both-queued-commit-write", leak_steps(vec![Q(GID), Q("COMMIT"), Q(N2)]), 0),
        ("x-dropped", leak_steps(vec![X(GID)]), 0),
        ("x-dropped-sent", leak_steps(vec![X(GID), Ms(50)]), 0),
        ("x-dropped-commit", leak_steps(vec![X(GID), Q("COMMIT")]), 0),
        ("pipelined-rollback", leak_steps(vec![Jq(jqr)]), 0),
        ("pipelined-x", leak_steps(vec![J(jx)]), 0),
    ];
    let mut bad = Vec::new();
    for v in [V::Rc, V::Ext, V::Plain] {
        for &(name, steps, n3) in &cases {
            let key = format!("own-{name}-{v:?}");
            let s = probe(&env, &env.pool, v, &key, (steps, OK), TEN, 100).await;
            bad.extend(as_prepared(&env, v, &key, &s, true, "COMMIT").await);
            let ns = (
                n_of(&env, &key, 1).await,
                n_of(&env, &key, 2).await,
                n_of(&env, &key, 3).await,
            );
            if ns != (1, 0, n3) {
                bad.push(format!("{key} {v:?}: after COMMIT PREPARED: n {ns:?}"));
            }
        }
    }
    let steps = leak_steps(vec![W(in_text_w)]);
    let s = probe(
        &env,
        &env.pool,
        V::Rc,
        "own-text-write",
        (steps, OK),
        TEN,
        0,
    )
    .await;
    if !s.ans.contains("committed: true") || s.rec.as_deref() != Some("unknown") || s.ns.1 != 1 {
        bad.push(format!(
            "own-text-write: {} n {:?} rec {:?}",
            s.ans, s.ns, s.rec
        ));
    }
    rollback_all(&env).await;
    bad.extend(hygiene(&env, &env.pool, "own").await);
    verdict(&bad);
}

/// The call dropped at points all around its body's `PREPARE` (a timeout
/// of `us` µs; or given up once the body queued it and yielded `n` times;
/// or a panic there), whether the `PREPARE` succeeds or fails (a deferred
/// check). Local mode: a key left free over a transaction that was
/// prepared would run the body again; a key held over a `PREPARE` that
/// failed, whose answer came, holds nothing. Both are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_a_call_dropped_anywhere_around_its_prepare_holds_the_key_iff_prepared() {
    let (_cluster, env) = env_max("8").await;
    let mut cases: Vec<(String, &'static [A], u8, Option<u64>)> = Vec::new();
    for pre in [None, Some(BAD0)] {
        let with = |tail: Vec<A>| leak_steps(pre.map(W).into_iter().chain(tail).collect());
        let tag = if pre.is_some() { "bad" } else { "ok" };
        for us in [6000, 8000, 9000, 10000, 11000, 12000, 13000, 15000, 18000] {
            cases.push((format!("{tag}-t{us}"), with(vec![W(GID)]), OK, Some(us)));
        }
        for n in [0, 1, 2, 4, 8] {
            cases.push((format!("{tag}-h{n}"), with(vec![Q(GID), Y(n)]), HANG, None));
            cases.push((format!("{tag}-p{n}"), with(vec![Q(GID), Y(n)]), PANIC, None));
        }
        cases.push((format!("{tag}-hw"), with(vec![W(GID)]), HANG, None));
        cases.push((format!("{tag}-pw"), with(vec![W(GID)]), PANIC, None));
    }
    let (mut bad, mut over_nothing) = (Vec::new(), Vec::new());
    for (name, steps, end, us) in &cases {
        let key = format!("any-{name}");
        let (p, k, (steps, end, us)) = (env.pool.clone(), key.clone(), (*steps, *end, *us));
        let task = tokio::spawn(async move { one(&p, V::Rc, &k, &Q { steps, end }, us).await });
        let ans = task.await.unwrap_or_else(|_| "task panicked".into());
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (_, mine) = prepared(&env, &format!("p-{key}")).await;
        let record = || async { env.record(&key).await.is_some() };
        let wait = Duration::from_millis(if mine == 1 { 4000 } else { 700 });
        let held = eventually(wait, record).await;
        let (rec, n1) = (env.state(&key).await, n_of(&env, &key, 1).await);
        eprintln!("  {key}: {ans}; prepared {mine} rec {rec:?} n1 {n1}");
        if (mine == 1 || n1 == 1) && !held {
            bad.push(format!(
                "{key}: {ans}: prepared {mine} n1 {n1}, the key free"
            ));
        }
        if mine == 0 && n1 == 0 && held {
            over_nothing.push(format!("{key}: {ans}: held over nothing"));
        }
        rollback_all(&env).await;
    }
    eprintln!("held over nothing: {over_nothing:?}");
    bad.extend(over_nothing.iter().filter(|b| b.contains("-bad-")).cloned());
    bad.extend(hygiene(&env, &env.pool, "any").await);
    verdict(&bad);
}

/// After its `PREPARE`, the body returns an error: a final one (never
/// stored over what it prepared), a plain one, or one that says nothing
/// was sent (`nothing_sent`, which in external mode releases the key unless
/// the body's transaction committed by hand); the `PREPARE` awaited,
/// queued, through the extended protocol, slow behind a check that ignores
/// the cancel. Never `Ok`, exactly its transaction prepared, the key held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_an_error_returned_after_a_prepare_neither_stores_nor_frees_the_key() {
    let (_cluster, env) = env_max("8").await;
    #[rustfmt::skip]
    let cases: Vec<(&str, &'static [A])> = vec![
        ("awaited", leak_steps(vec![W(GID)])),
        ("queued", leak_steps(vec![Q(GID)])),
        ("queued-sent", leak_steps(vec![Q(GID), Ms(50)])),
        ("extended", leak_steps(vec![X(GID)])),
        ("then-write", leak_steps(vec![W(GID), Q(N2)])),
        ("slow", leak_steps(vec![W(slow("stubc", 3500, false)), Q(GID)])),
    ];
    let mut bad = Vec::new();
    for v in [V::Rc, V::Ext, V::Plain] {
        for end in [FINAL, PLAIN, INVALID] {
            for &(name, steps) in &cases {
                let key = format!("err-{name}-{end}-{v:?}");
                let s = probe(&env, &env.pool, v, &key, (steps, end), TEN, 300).await;
                let (_, mine) = prepared(&env, &format!("p-{key}")).await;
                let held = s.rec.as_deref() == Some("unknown");
                if s.ans.starts_with("Ok") || mine != 1 || s.ns != (0, 0, 0) || (!plain(v) && !held)
                {
                    bad.push(format!(
                        "{key}: {} prepared {mine} n {:?} rec {:?}",
                        s.ans, s.ns, s.rec
                    ));
                }
                rollback_all(&env).await;
            }
        }
    }
    bad.extend(hygiene(&env, &env.pool, "err").await);
    verdict(&bad);
}

/// Local mode, the ordinary two-phase pattern: the body prepares and its
/// coordinator finishes the prepared transaction (another session) while
/// the body still runs, before idem holds the key. That opens the window
/// of a body's own `COMMIT` (docs/idempotent.md), for as long as the body
/// runs on. Found (helper-57) against the first wording of the docs, which
/// promised that duplicates wait until the prepared transaction is
/// finished and then get `OutcomeUnknown`: a duplicate waiting on the lock
/// ran the body again, n1 = 2, in 3 of 3 runs. The docs now say so, and
/// this pins it: after `COMMIT PREPARED` the duplicate runs at most once
/// more, the first call answered `committed: true`, the key completed over
/// the duplicate's effect when it ran and held when not; after `ROLLBACK
/// PREPARED` at most the duplicate's effect, under its completed record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_a_prepared_transaction_finished_before_the_hold_opens_the_commit_window() {
    let (_cluster, env) = env_max("8").await;
    let mut bad = Vec::new();
    for (t, finish) in ["COMMIT", "ROLLBACK"].iter().enumerate() {
        let key = format!("race-{t}");
        let steps = leak_steps(vec![W(GID), Ms(1500)]);
        let (p, k) = (env.pool.clone(), key.clone());
        let first =
            tokio::spawn(async move { one(&p, V::Rc, &k, &Q { steps, end: OK }, None).await });
        let gid = format!("p-{key}");
        let is_prepared = || async { prepared(&env, &gid).await.1 == 1 };
        assert!(eventually(TEN, is_prepared).await, "never prepared");
        let (p, k) = (env.pool.clone(), key.clone());
        let dup = tokio::spawn(async move { one(&p, V::Rc, &k, &EMPTY, None).await });
        tokio::time::sleep(Duration::from_millis(300)).await;
        env.client
            .batch_execute(&format!("{finish} PREPARED '{gid}'"))
            .await
            .unwrap();
        let dup = dup.await.unwrap_or_else(|_| "task panicked".into());
        let first = first.await.unwrap_or_else(|_| "task panicked".into());
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (n1, rec) = (n_of(&env, &key, 1).await, env.record(&key).await);
        eprintln!("  {key} ({finish}): first {first}; duplicate {dup}; n1 {n1} rec {rec:?}");
        let ran = dup.starts_with("Ok(") && !dup.starts_with("Ok(-");
        let state = rec.as_ref().map(|r| r.0.as_str());
        // The first call's effect counts after `COMMIT PREPARED` only.
        let first_n1 = i64::from(*finish == "COMMIT");
        let consistent = match ran {
            true => n1 == first_n1 + 1 && state == Some("completed"),
            false => n1 == first_n1 && state == Some("unknown"),
        };
        if !consistent || !first.contains("committed: true") {
            bad.push(format!(
                "{key} ({finish}): first {first}; duplicate {dup}; n1 {n1} rec {rec:?}"
            ));
        }
    }
    rollback_all(&env).await;
    verdict(&bad);
}
