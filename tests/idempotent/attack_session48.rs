//! Hostile pass (helper-54, session 46) on f47b6f9: `Wire::on_error`
//! clearing what ran outside a block, the seal's bounded wait
//! (`Wire::stops_behind_end`), `COPY` behind the body's end, and how a
//! request's text is read for what runs behind its `ROLLBACK`
//! (`says.rs`). Counted in the database, never from the library's report.
//! Two `found_` defects are fixed (`AND NO CHAIN`; a second `ROLLBACK`),
//! one is a limit kept (a FATAL), one is open (a slow `COMMIT` of the
//! body's, ignored below).
use super::kit::*;
use super::*;

/// `ROLLBACK AND NO CHAIN` ends the transaction like `ROLLBACK`: the
/// `INSERT` behind it runs outside any block and commits on its own.
const NO_CHAIN: &str = "ROLLBACK AND NO CHAIN; INSERT INTO effects (tag, n) VALUES ('{k}', 2)";
const WORK_NO_CHAIN: &str =
    "ROLLBACK WORK AND NO CHAIN; INSERT INTO effects (tag, n) VALUES ('{k}', 2)";
/// The same with a comment that names the word.
const COMMENT_CHAIN: &str =
    "ROLLBACK /* break the chain */; INSERT INTO effects (tag, n) VALUES ('{k}', 2)";
const ABORT_NO_CHAIN: &str = "ABORT AND NO CHAIN; INSERT INTO effects (tag, n) VALUES ('{k}', 2)";

/// Found: the body queues (polls once) `ROLLBACK AND NO CHAIN; INSERT ..`
/// (also `ROLLBACK WORK AND NO CHAIN`, `ABORT AND NO CHAIN`, or `ROLLBACK /*
/// break the chain */`) and then a write of its own, and returns `Ok`. The
/// `INSERT` runs outside any block and commits (n2 = 1), yet the call answers
/// `TransactionEnded { committed: false }`, the key is left free (no row in
/// idem_requests) and the repeat runs the body again: an effect committed with
/// its key free. Same in plain `#[retryable]` (`committed: false` over a
/// committed write) and in external mode (the key held `unknown`, but the
/// answer `committed: false`), and with a plain error end. n2 committed under
/// `committed: false` in 9 of 9 cases in 4 of 4 runs, every local key left
/// free (with a `pg_sleep(0.3)` behind the `INSERT` and an error end, idem's
/// own later cancel usually aborts it, n2 = 0, consistent). Cause:
/// `Reading::of` (idem-runtime/src/pool/wire/says.rs) takes any `ROLLBACK`
/// whose text holds the word `chain` (`names_chain`, a substring test) for a
/// `ROLLBACK AND CHAIN`, so the statements behind it are not read as
/// committing on their own (`Says::commit` false); `State::may_commit`
/// (unanswered.rs) then says nothing unanswered may commit, the seal
/// (`Wire::stops_behind_end`, stop.rs) neither cancels nor waits, closes the
/// connection at once, and the unanswered request counts as nothing committed.
/// Fixed (session 46): a statement chains only when its last words, past
/// comments, are `AND CHAIN` (`says::chains`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_rollback_and_no_chain_leaves_a_committed_write_unheld() {
    let env = env(2).await;
    #[rustfmt::skip]
    let cases: [(V, &'static [A], u8); 9] = [
        (V::Rc, &[Q(NO_CHAIN), Q(N3)], OK), (V::Rc, &[Q(WORK_NO_CHAIN), Q(N3)], OK),
        (V::Rc, &[Q(ABORT_NO_CHAIN), Q(N3)], OK), (V::Rc, &[Q(COMMENT_CHAIN), Q(N3)], OK),
        (V::Sr, &[Q(NO_CHAIN), Q(N3)], OK), (V::Rc, &[Q(NO_CHAIN), Q(N3)], PLAIN),
        (V::Plain, &[Q(NO_CHAIN), Q(N3)], OK), (V::Ext, &[Q(NO_CHAIN), Q(N3)], OK),
        (V::Ext, &[Q(NO_CHAIN), Q(N3)], PLAIN),
    ];
    let mut bad = Vec::new();
    for (i, (v, steps, end)) in cases.into_iter().enumerate() {
        let key = format!("nochain-{i}");
        let s = probe(&env, &env.pool, v, &key, (steps, end), TEN, 1000).await;
        let what = format!(
            "{key} {v:?} {steps:?} end {end}: {} n {:?} rec {:?}",
            s.ans, s.ns, s.rec
        );
        if s.ns.0 + s.ns.2 != 0 {
            bad.push(format!("{what}: idem's transaction committed"));
        }
        if s.ns.1 > 0 && s.ans.contains("committed: false") {
            bad.push(format!(
                "{what}: answered committed: false over a committed write"
            ));
        }
        if v == V::Plain {
            continue;
        }
        if s.ns.1 > 0 && s.rec.is_none() {
            bad.push(format!("{what}: a committed write, key free"));
        }
        let adds = repeat_adds(&env, &key).await;
        if s.ns.1 > 0 && adds != 0 {
            bad.push(format!("{what}: the repeat ran the body again ({adds})"));
        }
    }
    bad.extend(hygiene(&env, &env.pool, "nochain").await);
    verdict(&bad);
}

/// Found (a hold over nothing): `ROLLBACK; INSERT ..; ROLLBACK` (or `ABORT`
/// as the second) awaited, the body then returns a plain error. The second
/// `ROLLBACK` aborts the implicit transaction the `INSERT` ran in: nothing
/// committed (n = 0), yet the call answers `TransactionEnded { committed: true
/// }`, the key is held `unknown` and the repeat is refused: 2 of 2 keys in 5
/// of 5 runs. Cause: `Wire::on_complete` (wire.rs) leaves `autocommitted` set
/// at a `ROLLBACK` tag (kept for `ROLLBACK TO SAVEPOINT`, which shares the
/// tag; one outside a block fails anyway), and `Wire::on_ready` counts it at
/// the idle `ReadyForQuery`. The documented promise "a key is held only over a
/// statement that committed" does not hold. Fixed (session 46): a `ROLLBACK`
/// tag clears it. (`..; ABORT; SELECT 1` is still held: a read outside any
/// transaction counts as a write, as documented.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_a_write_a_second_rollback_undid_holds_the_key() {
    let env = env(2).await;
    #[rustfmt::skip]
    let cases: [&'static [A]; 2] = [
        &[W("ROLLBACK; INSERT INTO effects (tag, n) VALUES ('{k}', 2); ROLLBACK")],
        &[W("ROLLBACK; INSERT INTO effects (tag, n) VALUES ('{k}', 2); ABORT")],
    ];
    let mut bad = Vec::new();
    for (i, steps) in cases.into_iter().enumerate() {
        let key = format!("twice-{i}");
        let s = probe(&env, &env.pool, V::Rc, &key, (steps, PLAIN), TEN, 500).await;
        let what = format!("{key} {steps:?}: {} n {:?} rec {:?}", s.ans, s.ns, s.rec);
        if s.ns != (0, 0, 0) {
            bad.push(format!("{what}: something committed"));
        } else if s.rec.is_some() {
            bad.push(format!("{what}: held over nothing"));
        }
        if s.ns == (0, 0, 0) && repeat_adds(&env, &key).await != 1 {
            bad.push(format!("{what}: the repeat did not run once"));
        }
    }
    bad.extend(hygiene(&env, &env.pool, "twice").await);
    verdict(&bad);
}

/// A limit kept: `ROLLBACK; INSERT ..; SELECT
/// pg_terminate_backend(pg_backend_pid())` queued, then a write, end `Ok`.
/// The backend's FATAL aborts the implicit transaction with the `INSERT`
/// (n = 0), yet the call answers `TransactionEnded { committed: true }` and
/// the key is held `unknown`, the repeat refused (helper-54: 19 of 20 keys
/// over 4 runs; the odd one answered `committed: false`, key free). A
/// FATAL does not say what committed: a backend terminated during its
/// commit's wait for a synchronous standby, or just after it committed, has
/// committed all the same, so the request it ended still counts. Asserted
/// here: never an effect without its key held, and a key left free runs
/// once more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack48_a_write_a_fatal_ended_is_held_or_ran_nothing() {
    let env = env(2).await;
    const KILL: &str = "ROLLBACK; INSERT INTO effects (tag, n) VALUES ('{k}', 2); \
        SELECT pg_terminate_backend(pg_backend_pid())";
    let steps: &'static [A] = &[Q(KILL), Q(N3)];
    let mut bad = Vec::new();
    for t in 0..6 {
        let key = format!("fatal-{t}");
        let s = probe(&env, &env.pool, V::Rc, &key, (steps, OK), TEN, 500).await;
        let what = format!("{key}: {} n {:?} rec {:?}", s.ans, s.ns, s.rec);
        if s.ns != (0, 0, 0) && s.rec.is_none() {
            bad.push(format!("{what}: an effect with its key free"));
        }
        let ran = repeat_adds(&env, &key).await;
        if ran != i64::from(s.rec.is_none()) {
            bad.push(format!("{what}: the repeat added {ran}"));
        }
    }
    bad.extend(hygiene(&env, &env.pool, "fatal").await);
    verdict(&bad);
}

/// Procedures and a `DO` that commit inside, then fail or sleep.
const PROCS: &str = "
    CREATE PROCEDURE p48_fail(k text) LANGUAGE plpgsql AS $$ BEGIN
      INSERT INTO effects (tag, n) VALUES (k, 2); COMMIT; PERFORM 1/0; END $$;
    CREATE PROCEDURE p48_sleep(k text, s float8) LANGUAGE plpgsql AS $$ BEGIN
      INSERT INTO effects (tag, n) VALUES (k, 2); COMMIT; PERFORM pg_sleep(s); END $$;";
const DO_FAIL: &str = "DO $$ BEGIN INSERT INTO effects (tag, n) VALUES ('{k}', 2); COMMIT; \
    PERFORM 1/0; END $$";

/// Held: what commits behind the end and is then followed by an error in
/// the same request (an explicit `COMMIT`, `END`, `BEGIN .. COMMIT`, then
/// `SELECT 1/0`) is held and the repeat refused; a `COMMIT` inside a
/// procedure or `DO` behind the end never runs (in one text it is atomic and
/// fails; as a request of its own, queued or pipelined through the extended
/// protocol, the seal refuses it), so nothing commits and the key is free;
/// `COPY`: an `INSERT` committed before a `COPY .. FROM STDIN` is held (after
/// `commit_timeout_ms`), one in the `COPY`'s implicit transaction is not, one
/// before a `COPY .. TO STDOUT` is; a `COPY .. FROM STDIN` in the body's own
/// transaction commits nothing and leaves the key free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack48_commits_errors_procedures_and_copy_behind_the_end() {
    let env = env(2).await;
    if env.db.via().is_transaction_pooling() {
        return; // no wait behind a transaction pooler: the refusal closes at once (documented)
    }
    env.client.batch_execute(PROCS).await.expect("procs");
    #[rustfmt::skip]
    let cases: [(V, &'static [A], u8, i64); 14] = [
        (V::Rc, &[W("ROLLBACK; INSERT INTO effects (tag, n) VALUES ('{k}', 2); COMMIT; SELECT 1/0")], PLAIN, 1),
        (V::Rc, &[W("ROLLBACK; INSERT INTO effects (tag, n) VALUES ('{k}', 2); END; SELECT 1/0")], PLAIN, 1),
        (V::Rc, &[W("ROLLBACK; BEGIN; INSERT INTO effects (tag, n) VALUES ('{k}', 2); COMMIT; SELECT 1/0")], PLAIN, 1),
        (V::Rc, &[W("ROLLBACK; INSERT INTO effects (tag, n) VALUES ('{k}', 2); COMMIT AND CHAIN; SELECT 1/0")], PLAIN, 0),
        (V::Rc, &[W("ROLLBACK; CALL p48_fail('{k}')")], PLAIN, 0),
        (V::Rc, &[Q("ROLLBACK"), Q("CALL p48_fail('{k}')"), Q(N3)], PLAIN, 0),
        (V::Rc, &[Q("ROLLBACK"), Q("CALL p48_sleep('{k}', 5)"), Ms(50), W(N3)], OK, 0),
        (V::Rc, &[Q("ROLLBACK"), Q(DO_FAIL), Q(N3)], PLAIN, 0),
        (V::Rc, &[Jq(&["ROLLBACK", "x:CALL p48_fail('{k}')"]), Q(N3)], PLAIN, 0),
        (V::Rc, &[Q("ROLLBACK; INSERT INTO effects (tag, n) VALUES ('{k}', 2); COMMIT; COPY effects (tag, n) FROM STDIN"), Q(N3)], OK, 1),
        (V::Rc, &[Q("ROLLBACK; INSERT INTO effects (tag, n) VALUES ('{k}', 2); COPY effects (tag, n) FROM STDIN"), Q(N3)], OK, 0),
        (V::Rc, &[Q("ROLLBACK; INSERT INTO effects (tag, n) VALUES ('{k}', 2); COPY (SELECT 1) TO STDOUT"), Q(N3)], OK, 1),
        (V::Rc, &[W("COPY effects (tag, n) FROM STDIN")], OK, 0),
        (V::Rc, &[W("ROLLBACK; INSERT INTO effects (tag, n) VALUES ('{k}', 2)")], PLAIN, 1),
    ];
    let mut bad = Vec::new();
    for (i, (v, steps, end, n2)) in cases.into_iter().enumerate() {
        let key = format!("held-{i}");
        let s = probe(&env, &env.pool, v, &key, (steps, end), TEN, 500).await;
        let what = format!(
            "{key} {steps:?} end {end}: {} n {:?} rec {:?}",
            s.ans, s.ns, s.rec
        );
        if s.ns != (0, n2, 0) {
            bad.push(format!("{what}: expected n2 = {n2} alone"));
        }
        if (n2 == 1) != s.rec.is_some() || s.took > Duration::from_millis(3500) {
            bad.push(format!("{what}: in {:?}", s.took));
        }
        if repeat_adds(&env, &key).await != 1 - n2 {
            bad.push(format!(
                "{what}: the repeat ran over a held key, or not over a free one"
            ));
        }
    }
    bad.extend(hygiene(&env, &env.pool, "held").await);
    verdict(&bad);
}

const STUB: &str = "SELECT count(*) FROM stubc WHERE tag = $1";

/// Found (bounded time), fixed: the body inserts into `slowc` (a deferred
/// check that sleeps, cancellable), queues its own `COMMIT` (polled once),
/// then awaits a write, and returns a plain error. The seal held the refused
/// write back while the `COMMIT` was in flight with no cancel and no bound:
/// the call answered only once the check was done, 8.02 s in 3 of 3 runs for
/// an 8 s check (30.04 s for 30 s), past `commit_timeout_ms` (3 s) and, for
/// 30 s, `deadline_ms` (20 s). Now the write waits for the body's `COMMIT`
/// up to `commit_timeout_ms` from its send, then cancels it (wire/stop.rs):
/// the 8 s check is aborted, nothing committed, the key left free; a check
/// done within the bound is read (committed: held; failed: free). Behind a
/// transaction pooler, where no cancel is sent, the write waits as long
/// again, then the connection closes and the unanswered `COMMIT` counts as
/// committed (held).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_a_slow_commit_the_body_queued_holds_its_next_write_unbounded() {
    let env = env_slow(2).await;
    let pooled = env.db.via().is_transaction_pooling();
    #[rustfmt::skip]
    let cases: [(&'static [A], Option<i64>); 3] = [
        (&[W("INSERT INTO slowc VALUES ('{k}', 8000, false)"), Q("COMMIT"), Ms(50), W(N3)], Some(0)),
        (&[W("INSERT INTO slowc VALUES ('{k}', 1500, false)"), Q("COMMIT"), Ms(50), W(N3)], Some(1)),
        (&[W("INSERT INTO slowc VALUES ('{k}', 1500, true)"), Q("COMMIT"), Ms(50), W(N3)], Some(0)),
    ];
    let mut bad = Vec::new();
    for (i, (steps, n1)) in cases.into_iter().enumerate() {
        let key = format!("inflight-{i}");
        // Behind a pooler the first case's `COMMIT` is left running at the
        // close: what it does then is the server's (held either way).
        let n1 = n1.filter(|_| !pooled || i > 0);
        let s = probe(&env, &env.pool, V::Rc, &key, (steps, PLAIN), TEN * 2, 500).await;
        let what = format!(
            "{key} {steps:?}: {} in {:?} n {:?} rec {:?}",
            s.ans, s.took, s.ns, s.rec
        );
        // Cancelled at 3 s, answered at once; behind a pooler waited for
        // 3 s more, then closed.
        let limit = Duration::from_millis(if pooled { 6500 } else { 4500 });
        if s.took > limit {
            bad.push(format!("{what}: answered past {limit:?}"));
        }
        if s.ns.1 + s.ns.2 != 0 || n1.is_some_and(|n1| s.ns.0 != n1) {
            bad.push(format!("{what}: expected n1 = {n1:?} alone"));
        }
        let held = match n1 {
            Some(n1) => n1 == 1,
            None => true,
        };
        if held != s.rec.is_some() {
            bad.push(format!("{what}: held iff committed does not hold"));
        }
        if repeat_adds(&env, &key).await != i64::from(!held) {
            bad.push(format!(
                "{what}: the repeat ran over a held key, or not over a free one"
            ));
        }
    }
    bad.extend(hygiene(&env, &env.pool, "inflight").await);
    verdict(&bad);
}

/// Held: a write behind `ROLLBACK` whose deferred check ignores the seal's
/// cancel (`STUBBORN`) and takes 0.8 to 1.5 s, the body's next write awaited
/// or queued before `Ok`: each call answers within 1.6 s; a check done
/// within the second is read (committed: held, the repeat refused; failed:
/// key free, the repeat runs); one that outlasts it is held (what commits
/// after the close too). No backend is left running or idle in a transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack48_stubborn_checks_around_the_second() {
    let env = env(2).await;
    if env.db.via().is_transaction_pooling() {
        return; // no wait behind a transaction pooler: the refusal closes at once (documented)
    }
    env.client.batch_execute(STUBBORN).await.expect("stubborn");
    #[rustfmt::skip]
    let cases: [(&'static [A], u8); 6] = [
        (&[Q("ROLLBACK; INSERT INTO stubc VALUES ('{k}', 800, false)"), Ms(50), W(N3)], PLAIN),
        (&[Q("ROLLBACK; INSERT INTO stubc VALUES ('{k}', 800, true)"), Ms(50), W(N3)], PLAIN),
        (&[Q("ROLLBACK; INSERT INTO stubc VALUES ('{k}', 950, false)"), Q(N3)], OK),
        (&[Q("ROLLBACK; INSERT INTO stubc VALUES ('{k}', 1200, false)"), Ms(50), W(N3)], PLAIN),
        (&[Q("ROLLBACK; INSERT INTO stubc VALUES ('{k}', 1200, false)"), Q(N3)], OK),
        (&[Q("ROLLBACK; INSERT INTO stubc VALUES ('{k}', 1500, true)"), Ms(50), W(N3)], FINAL),
    ];
    let mut bad = Vec::new();
    for (i, (steps, end)) in cases.into_iter().enumerate() {
        let key = format!("stub-{i}");
        let s = probe(&env, &env.pool, V::Rc, &key, (steps, end), TEN, 2000).await;
        let stub: i64 = env.client.query_one(STUB, &[&key]).await.unwrap().get(0);
        let what = format!(
            "{key} {steps:?}: {} in {:?} n {:?} stubc {stub} rec {:?}",
            s.ans, s.took, s.ns, s.rec
        );
        if s.took > Duration::from_millis(1600) || s.ns != (0, 0, 0) {
            bad.push(format!("{what}: slow, or an effect of idem's transaction"));
        }
        let within = s.took < Duration::from_millis(950);
        if stub == 1 && s.rec.is_none() || stub == 0 && within && s.rec.is_some() {
            bad.push(format!("{what}: held iff committed does not hold"));
        }
        if repeat_adds(&env, &key).await != i64::from(s.rec.is_none()) {
            bad.push(format!(
                "{what}: the repeat ran over a held key, or not over a free one"
            ));
        }
    }
    bad.extend(hygiene(&env, &env.pool, "stub").await);
    verdict(&bad);
}

/// Held: `ROLLBACK AND NO CHAIN` alone (queued or awaited, with a write
/// queued behind it) commits nothing and leaves the key free; awaited with an
/// `INSERT` behind it, the answer is read and the key held (the control for
/// the `found_` test above: only the unread request is miscounted); a `COPY ..
/// FROM STDIN` behind it rolls back with the `INSERT` (key free), one behind
/// an explicit `COMMIT` is held; `COMMIT; COPY .. TO STDOUT; SELECT
/// pg_sleep(3)` behind a `ROLLBACK` is held within `commit_timeout_ms`; a
/// `COPY .. FROM STDIN` through the extended protocol in the body's own
/// transaction loses the connection, nothing committed, key free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack48_no_chain_read_and_copy_shapes() {
    let env = env(2).await;
    if env.db.via().is_transaction_pooling() {
        return; // no wait behind a transaction pooler: the refusal closes at once (documented)
    }
    const COPY_X: &str = "COPY effects (tag, n) FROM STDIN";
    const NC_COPY: &str = "ROLLBACK AND NO CHAIN; INSERT INTO effects (tag, n) VALUES ('{k}', 2); \
        COPY effects (tag, n) FROM STDIN";
    const NC_COMMIT_COPY: &str = "ROLLBACK AND NO CHAIN; INSERT INTO effects (tag, n) \
        VALUES ('{k}', 2); COMMIT; COPY effects (tag, n) FROM STDIN";
    const COPY_OUT: &str = "ROLLBACK; INSERT INTO effects (tag, n) VALUES ('{k}', 2); COMMIT; \
        COPY (SELECT 1) TO STDOUT; SELECT pg_sleep(3)";
    #[rustfmt::skip]
    let cases: [(&'static [A], u8, i64); 10] = [
        (&[D(COPY_X)], OK, 0), (&[D(COPY_X)], PLAIN, 0),
        (&[Q("ROLLBACK AND NO CHAIN")], OK, 0), (&[W("ROLLBACK AND NO CHAIN")], OK, 0),
        (&[Q("ROLLBACK AND NO CHAIN"), Q(N3)], OK, 0), (&[W(NO_CHAIN), W(N3)], OK, 1),
        (&[W(NO_CHAIN), W(N3)], PLAIN, 1), (&[Q(NC_COPY), Q(N3)], OK, 0),
        (&[Q(NC_COMMIT_COPY), Q(N3)], OK, 1), (&[Q(COPY_OUT), Q(N3)], OK, 1),
    ];
    let mut bad = Vec::new();
    for (i, (steps, end, n2)) in cases.into_iter().enumerate() {
        let key = format!("ncread-{i}");
        let s = probe(&env, &env.pool, V::Rc, &key, (steps, end), TEN, 1000).await;
        let what = format!(
            "{key} {steps:?} end {end}: {} in {:?} n {:?} rec {:?}",
            s.ans, s.took, s.ns, s.rec
        );
        if s.ns != (0, n2, 0) || (n2 == 1) != s.rec.is_some() {
            bad.push(format!(
                "{what}: expected n2 = {n2} alone, held iff committed"
            ));
        }
        if s.took > Duration::from_millis(3500) {
            bad.push(format!("{what}: slow"));
        }
        if repeat_adds(&env, &key).await != 1 - n2 {
            bad.push(format!(
                "{what}: the repeat ran over a held key, or not over a free one"
            ));
        }
    }
    bad.extend(hygiene(&env, &env.pool, "ncread").await);
    verdict(&bad);
}
