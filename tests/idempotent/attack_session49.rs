//! Hostile pass (helper-55, session 49) on df8b3d0: the bound on a write
//! the seal refuses behind the body's own `COMMIT` (`Wire::holds_refused`,
//! wire/stop.rs; `Tx::bound_body_commit`, tx/close.rs): bounded time, held
//! iff committed (counted in the database), repeats, hygiene, and the
//! no-cancel path under `Replication::Synchronous`. The kit's calls run
//! with `commit_timeout_ms = 3000`.
use super::kit::*;
use super::*;

const RB: &str = "ROLLBACK; INSERT INTO slowc VALUES ('{k}', 8000, false); \
    INSERT INTO effects (tag, n) VALUES ('{k}', 2); COMMIT";
const CI: &str = "COMMIT; INSERT INTO slowc VALUES ('{k}', 8000, false); \
    INSERT INTO effects (tag, n) VALUES ('{k}', 2)";
const IC: &str = "INSERT INTO slowc VALUES ('{k}', 8000, false); COMMIT; SELECT 1/0";

/// 2 × `commit_timeout_ms` and some slack.
pub(super) const TWICE: Duration = Duration::from_millis(6700);
pub(super) const INS8: &str = "INSERT INTO slowc VALUES ('{k}', 8000, false)";
pub(super) const STUB8: &str = "INSERT INTO stubc VALUES ('{k}', 8000, false)";

/// One case's problems: the call within `limit`, no write behind the end
/// (n2, n3), n1 as expected (`None`: either), held iff n1 committed
/// (`lax`: a hold over nothing allowed, documented), and the repeat runs
/// iff the key is free.
#[allow(clippy::too_many_arguments)]
pub(super) async fn check(
    env: &Env,
    pool: &Pool,
    key: &str,
    steps: &'static [A],
    end: u8,
    n1: Option<i64>,
    limit: Duration,
    settle_ms: u64,
    lax: bool,
) -> Vec<String> {
    let s = probe(env, pool, V::Rc, key, (steps, end), TEN * 3, settle_ms).await;
    let what = format!(
        "{key} {steps:?} end {end}: {} in {:?} n {:?} rec {:?}",
        s.ans, s.took, s.ns, s.rec
    );
    let mut bad = Vec::new();
    if s.took > limit {
        bad.push(format!("{what}: answered after {limit:?}"));
    }
    if s.ns.1 + s.ns.2 != 0 || n1.is_some_and(|n| n != s.ns.0) {
        bad.push(format!("{what}: expected n1 = {n1:?} alone"));
    }
    bad.extend(held_iff(env, key, &what, s.ns.0, s.rec.is_some(), lax).await);
    bad
}

/// The key held iff `committed` effects are there (`lax`: a hold over
/// nothing allowed, documented), and its repeat runs iff it is free.
pub(super) async fn held_iff(
    env: &Env,
    key: &str,
    what: &str,
    committed: i64,
    held: bool,
    lax: bool,
) -> Vec<String> {
    let mut bad = Vec::new();
    if committed > 0 && !held || committed == 0 && held && !lax {
        bad.push(format!("{what}: held iff committed does not hold"));
    }
    let adds = repeat_adds(env, key).await;
    if adds != i64::from(!held) {
        bad.push(format!("{what}: the repeat added {adds}"));
    }
    bad
}

/// A case for [`checks`]: the body, its end, n1 as expected, the settle
/// (ms) and `lax`, as [`check`] takes them.
pub(super) type Expect = (&'static [A], u8, Option<i64>, u64, bool);

/// Each case [`check`]ed on `pool` as `{prefix}-{i}`, answered within
/// `limit`, then the pool's [`hygiene`].
pub(super) async fn checks(
    env: &Env,
    pool: &Pool,
    prefix: &str,
    cases: Vec<Expect>,
    limit: Duration,
) -> Vec<String> {
    let mut bad = Vec::new();
    for (i, (steps, end, n1, settle, lax)) in cases.into_iter().enumerate() {
        let key = format!("{prefix}-{i}");
        bad.extend(check(env, pool, &key, steps, end, n1, limit, settle, lax).await);
    }
    bad.extend(hygiene(env, pool, prefix).await);
    bad
}

/// Cases where nothing commits (n1 = 0, not lax).
fn nothing(cases: &[(&'static [A], u8)]) -> Vec<Expect> {
    cases
        .iter()
        .map(|&(s, e)| (s, e, Some(0), 500, false))
        .collect()
}

/// Held: a `COMMIT` of the body's with an 8 s deferred check (cancellable),
/// in many shapes (queued writes, `END`, `COMMIT AND CHAIN`, extended
/// protocol, behind a slow statement, in one text with others, no write
/// after it, each end): each call answers within 2 × 3 s + slack, nothing
/// commits, the key is free and the repeat runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack49_a_slow_body_commit_in_many_shapes_is_bounded() {
    let env = env_slow(2).await;
    if env.db.via().is_transaction_pooling() {
        return; // no cancel behind a transaction pooler (documented)
    }
    #[rustfmt::skip]
    let cases: [(&'static [A], u8); 14] = [
        (&[W(INS8), Q("COMMIT"), Q(N3)], OK),
        (&[W(INS8), Q("COMMIT"), Q(N3), Q(N3), Q(N3)], OK),
        (&[W(INS8), Q("COMMIT")], OK),
        (&[W(INS8), Q("COMMIT"), Ms(50)], PLAIN),
        (&[W(INS8), Q("END"), Ms(50), W(N3)], PLAIN),
        (&[W(INS8), Q("COMMIT AND CHAIN"), Ms(50), W(N3)], PLAIN),
        (&[W(INS8), X("COMMIT"), Ms(50), D(N3)], PLAIN),
        (&[W(INS8), Q("SELECT pg_sleep(10)"), Q("COMMIT"), Ms(50), W(N3)], PLAIN),
        (&[W(INS8), Q("SELECT 1; COMMIT"), Ms(50), W(N3)], PLAIN),
        (&[Q("INSERT INTO slowc VALUES ('{k}', 8000, false); COMMIT"), Ms(50), W(N3)], PLAIN),
        (&[W(INS8), Q("COMMIT"), Ms(50), W(N3)], FINAL),
        (&[W(INS8), Q("COMMIT"), Ms(50), W(N3)], PANIC),
        (&[W(INS8), Q("COMMIT"), Q("ROLLBACK"), Ms(50), W(N3)], PLAIN),
        (&[W(INS8), Jq(&["COMMIT", "x:INSERT INTO effects (tag, n) VALUES ('{k}', 2)"]), Ms(50)], OK),
    ];
    verdict(&checks(&env, &env.pool, "shape", nothing(&cases), TWICE).await);
}

/// Held: checks just under and over the bound (3 s), and stubborn ones
/// (ignoring the cancel) done within 2 × the bound or outlasting it: a
/// check done within the bound is read (committed: held; failed: free);
/// one the cancel stops commits nothing, key free; a stubborn one done
/// before 6 s is read; one outlasting it counts as committed (held; when
/// it fails, held over nothing: documented). Each call within 6.7 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack49_checks_around_the_bound_and_twice_it() {
    let env = env_slow(2).await;
    if env.db.via().is_transaction_pooling() {
        return; // no cancel behind a transaction pooler (documented)
    }
    env.client.batch_execute(STUBBORN).await.expect("stubborn");
    let body = |table: &str, ms: u64, fail: bool| -> &'static [A] {
        Box::leak(Box::new([
            W(slow(table, ms, fail)),
            Q("COMMIT"),
            Ms(50),
            W(N3),
        ]))
    };
    #[rustfmt::skip]
    let cases: Vec<(&'static [A], Option<i64>, u64, bool)> = vec![
        (body("slowc", 2500, false), Some(1), 500, false),
        (body("slowc", 2500, true), Some(0), 500, false),
        (body("slowc", 3500, false), Some(0), 500, false),
        (body("slowc", 3500, true), Some(0), 500, false),
        (body("stubc", 5000, false), Some(1), 500, false),
        (body("stubc", 5000, true), Some(0), 500, false),
        (body("stubc", 7500, false), Some(1), 2500, false),
        (body("stubc", 7500, true), Some(0), 2500, true),
        (body("stubc", 12500, false), Some(1), 7000, false),
    ];
    let cases = cases
        .into_iter()
        .map(|(s, n1, settle, lax)| (s, OK, n1, settle, lax));
    verdict(&checks(&env, &env.pool, "edge", cases.collect(), TWICE).await);
}

/// Held: a `COPY .. FROM STDIN` queued ahead of the body's `COMMIT` (and
/// writes behind it): the `COPY` waits for data and the `COMMIT` cannot
/// run; nothing commits, the key is free, the call is quick.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack49_copy_queued_ahead_of_the_commit() {
    let env = env_slow(2).await;
    if env.db.via().is_transaction_pooling() {
        return; // no cancel behind a transaction pooler (documented)
    }
    const COPY: &str = "COPY effects (tag, n) FROM STDIN";
    #[rustfmt::skip]
    let cases: [(&'static [A], u8); 5] = [
        (&[Q(COPY), Q("COMMIT"), Ms(50), W(N3)], PLAIN),
        (&[Q(COPY), Q("COMMIT"), Q(N3)], OK),
        (&[Q(COPY), Q("COMMIT")], OK),
        (&[W(INS8), Q(COPY), Q("COMMIT"), Ms(50), W(N3)], PLAIN),
        (&[Q("COPY effects (tag, n) FROM STDIN; COMMIT"), Ms(50), W(N3)], PLAIN),
    ];
    verdict(&checks(&env, &env.pool, "copy", nothing(&cases), TWICE).await);
}

/// Held: the same slow `COMMIT` on a current-thread runtime (the timer
/// the refused write sets runs on it): bounded, nothing committed, free.
#[tokio::test]
async fn attack49_current_thread_runtime() {
    let env = env_slow(2).await;
    if env.db.via().is_transaction_pooling() {
        return; // no cancel behind a transaction pooler (documented)
    }
    #[rustfmt::skip]
    let cases: [(&'static [A], u8); 3] = [
        (&[W(INS8), Q("COMMIT"), Ms(50), W(N3)], PLAIN),
        (&[W(INS8), Q("COMMIT"), Q(N3)], OK),
        (&[W(INS8), Q("COMMIT")], OK),
    ];
    verdict(&checks(&env, &env.pool, "ct", nothing(&cases), TWICE).await);
}

/// Held: the call dropped during the wait (1 s, 4 s in), or run to its
/// end, on a pool of one with two duplicates queued: each key settled
/// (`sweep`: never an effect with its key free, nor twice), later calls
/// serve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack49_dropped_during_the_wait_pool_of_one() {
    let env = env_slow(1).await;
    if env.db.via().is_transaction_pooling() {
        return; // no cancel behind a transaction pooler (documented)
    }
    let s8: &'static [A] = &[W(INS8), Q("COMMIT"), Ms(50), W(N3)];
    let s15: &'static [A] = &[W(OK15), Q("COMMIT"), Ms(50), W(N3)];
    #[rustfmt::skip]
    let cases: [Case; 6] = [
        (V::Rc, s8, PLAIN, Some(1_000_000), true), (V::Rc, s8, PLAIN, Some(4_000_000), true),
        (V::Rc, s8, OK, None, false), (V::Rc, s15, OK, Some(1_000_000), true),
        (V::Rc, s15, HANG, None, true), (V::Ext, s8, PLAIN, None, true),
    ];
    let bad = sweep(&env, &env.pool, "dropw", &cases, 2, 9000, None).await;
    verdict(&bad);
}

/// Held: the slow `COMMIT` (8 s check, cancelled at 3 s) under every call
/// shape, `max = 4` included (no retry stacks a second wait), and a
/// serialization failure the body's `COMMIT` meets: each answers within
/// 2 × 3 s + slack, nothing committed; a local key is free and its repeat
/// runs (external mode may hold over nothing, documented).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack49_every_call_shape_and_retries() {
    let env = env_slow(2).await;
    if env.db.via().is_transaction_pooling() {
        return; // no cancel behind a transaction pooler (documented)
    }
    let s8: &'static [A] = &[W(INS8), Q("COMMIT"), Ms(50), W(N3)];
    let q8: &'static [A] = &[W(INS8), Q("COMMIT"), Q(N3)];
    let ser: &'static [A] = &[W(SER3), Q("COMMIT"), Ms(50), W(N3)];
    #[rustfmt::skip]
    let cases: [(V, &'static [A], u8); 12] = [
        (V::Rc4, s8, PLAIN), (V::Rc4, q8, OK), (V::Pl4, s8, PLAIN), (V::Pl4, q8, OK),
        (V::Rr, s8, PLAIN), (V::Sr, q8, OK), (V::Ext, s8, PLAIN), (V::Ext, q8, OK),
        (V::Plain, s8, OK), (V::Rc4, ser, PLAIN), (V::Rc4, ser, OK), (V::Pl4, ser, OK),
    ];
    let mut bad = Vec::new();
    for (i, (v, steps, end)) in cases.into_iter().enumerate() {
        let key = format!("shapes-{i}");
        let s = probe(&env, &env.pool, v, &key, (steps, end), TEN * 3, 500).await;
        let what = format!(
            "{key} {v:?} {steps:?} end {end}: {} in {:?} n {:?} rec {:?}",
            s.ans, s.took, s.ns, s.rec
        );
        if s.took > TWICE {
            bad.push(format!("{what}: answered after {TWICE:?}"));
        }
        if s.ns != (0, 0, 0) {
            bad.push(format!("{what}: something committed"));
        }
        if plain(v) || v == V::Ext {
            continue;
        }
        if s.rec.is_some() {
            bad.push(format!("{what}: held over nothing"));
        }
        if repeat_adds(&env, &key).await != 1 {
            bad.push(format!("{what}: the repeat of a free key did not run once"));
        }
    }
    bad.extend(hygiene(&env, &env.pool, "shapes").await);
    verdict(&bad);
}

/// Held: a `COMMIT` in one text with a slow check behind or ahead of it:
/// `ROLLBACK; INSERT INTO slowc (8 s); COMMIT` (the implicit block's
/// check, cancelled at 3 s: n2 = 0, key free); `COMMIT; INSERT INTO
/// slowc (8 s)` (the body's transaction committed at once, n1 = 1, held;
/// the implicit block behind it cancelled); `INSERT INTO slowc (8 s);
/// COMMIT; SELECT 1/0` (cancelled: free). Each within 2 × 3 s + slack,
/// a write behind awaited after 50 ms before an error end, or queued
/// before `Ok` where nothing committed is `found_` below (held).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack49_commit_in_one_text_with_a_slow_check() {
    let env = env_slow(2).await;
    if env.db.via().is_transaction_pooling() {
        return; // no cancel behind a transaction pooler (documented)
    }
    #[rustfmt::skip]
    let cases: [(&'static [A], u8, (i64, i64)); 6] = [
        (&[Q(RB), Ms(50), W(N3)], PLAIN, (0, 0)), (&[Q(CI), Ms(50), W(N3)], PLAIN, (1, 0)),
        (&[Q(CI), Q(N3)], OK, (1, 0)), (&[Q(IC), Ms(50), W(N3)], PLAIN, (0, 0)),
        (&[Q(IC), Ms(50), W(N3)], OK, (0, 0)), (&[Q(RB), Ms(50), W(N3)], OK, (0, 0)),
    ];
    let mut bad = Vec::new();
    for (i, (steps, end, (n1, n2))) in cases.into_iter().enumerate() {
        let key = format!("onetext-{i}");
        let s = probe(&env, &env.pool, V::Rc, &key, (steps, end), TEN * 3, 500).await;
        let what = format!(
            "{key} {steps:?} end {end}: {} in {:?} n {:?} rec {:?}",
            s.ans, s.took, s.ns, s.rec
        );
        if s.took > TWICE || s.ns != (n1, n2, 0) {
            bad.push(format!(
                "{what}: expected n ({n1}, {n2}, 0) within {TWICE:?}"
            ));
        }
        let committed = s.ns.0 + s.ns.1 > 0;
        if committed != s.rec.is_some() {
            bad.push(format!("{what}: held iff committed does not hold"));
        }
        if repeat_adds(&env, &key).await != i64::from(s.rec.is_none()) {
            bad.push(format!(
                "{what}: the repeat ran over a held key, or not over a free one"
            ));
        }
    }
    bad.extend(hygiene(&env, &env.pool, "onetext").await);
    verdict(&bad);
}

/// Found (promise 2, a hold over nothing), fixed: the body's `COMMIT` of a slow
/// transaction (8 s deferred check) in a text with other statements
/// (`INSERT INTO slowc ..; COMMIT; SELECT 1/0`, `ROLLBACK; INSERT INTO
/// slowc ..; INSERT ..; COMMIT`, `SELECT 1; COMMIT`) or as `END`,
/// `COMMIT AND CHAIN`, queued (polled once) with a write queued behind it,
/// or a lone `COMMIT` through the extended protocol (`sql_query("COMMIT")`
/// with its `Bind`/`Execute` queued, `X`), the body returning `Ok` at
/// once. At 3.0 s the `COMMIT` is cancelled and aborts (n = 0 for good),
/// yet the call answers `CommitUnknown` and the key is held `unknown`, the
/// repeat refused: 6 of 6 such keys (cases 1 to 6) in each of 6 of 6 runs
/// (and 2 of 2 in a first run); cases 9, 10 (`X`): 2 of 2 in each of 3 of
/// 3 runs. Error ends (7, 8) are free, as expected. Expected: the
/// key free, as for a lone `COMMIT` queued the same way (control, case 0:
/// idem's record rides ahead of it, `CommitUnknown` but free) or the same
/// text with the write awaited before an error end (attack49 above:
/// free). Reading: nothing rides ahead of a text that is not a lone
/// `COMMIT`, so idem's own record and `COMMIT` (`Tx::send_commit`,
/// tx/mod.rs) queue behind the body's end, where the seal holds them
/// (`Wire::holds_refused`, wire/stop.rs) until `commit_timeout_ms` from the
/// body's send, the same instant `send_commit`'s own timeout runs out: its
/// `Err(_elapsed)` arm answers `CommitFailure::Unknown` (key held) though
/// its own `COMMIT` never went out, without reading the body's end the
/// seal is cancelling (`ended::committed_since` once settled). Fixed:
/// there, while the seal still holds idem's `COMMIT` back, `send_commit`
/// waits for the seal's answer and reads the body's end (`EndedByBody`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_a_queued_commit_text_cancelled_holds_its_key() {
    let env = env_slow(2).await;
    if env.db.via().is_transaction_pooling() {
        return; // no cancel behind a transaction pooler (documented)
    }
    #[rustfmt::skip]
    let cases: [(&'static [A], u8); 11] = [
        (&[W(INS8), Q("COMMIT"), Q(N3)], OK),
        (&[Q(IC), Q(N3)], OK),
        (&[Q(RB), Q(N3)], OK),
        (&[W(INS8), Q("SELECT 1; COMMIT"), Q(N3)], OK),
        (&[W(INS8), Q("SELECT 1; COMMIT")], OK),
        (&[W(INS8), Q("END"), Q(N3)], OK),
        (&[W(INS8), Q("COMMIT AND CHAIN"), Q(N3)], OK),
        (&[W(INS8), Q("SELECT 1; COMMIT"), Q(N3)], FINAL),
        (&[W(INS8), Q("SELECT 1; COMMIT"), Q(N3)], PLAIN),
        (&[W(INS8), X("COMMIT"), Q(N3)], OK),
        (&[W(INS8), X("COMMIT")], OK),
    ];
    verdict(&checks(&env, &env.pool, "qtext", nothing(&cases), TWICE).await);
}

/// Held: the `found_` shape above with a check done within the bound (1.5
/// s: committed, held, the repeat refused; failed, free, the repeat runs),
/// and a stubborn `DO` (ignoring cancels, 10 s) queued ahead of the body's
/// `COMMIT`, then a write: the call answers within 2 × 3 s + slack and
/// never leaves an effect with its key free (the close counts the
/// `COMMIT` as committed: a hold over nothing allowed, documented).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack49_within_the_bound_and_a_stubborn_statement_ahead() {
    let env = env_slow(2).await;
    if env.db.via().is_transaction_pooling() {
        return; // no cancel behind a transaction pooler (documented)
    }
    const DO_STUB: &str = "DO $$ DECLARE t0 timestamptz := clock_timestamp(); BEGIN \
        WHILE clock_timestamp() < t0 + interval '10 s' LOOP \
        BEGIN PERFORM pg_sleep(0.05); EXCEPTION WHEN query_canceled THEN NULL; END; \
        END LOOP; END $$";
    #[rustfmt::skip]
    let cases: [Expect; 6] = [
        (&[W(OK15), Q("SELECT 1; COMMIT"), Q(N3)], OK, Some(1), 500, false),
        (&[W(BAD15), Q("SELECT 1; COMMIT"), Q(N3)], OK, Some(0), 500, false),
        (&[W(OK15), Q("END"), Q(N3)], OK, Some(1), 500, false),
        (&[W(BAD15), Q("COMMIT AND CHAIN"), Q(N3)], OK, Some(0), 500, false),
        (&[Q(DO_STUB), Q("COMMIT"), Ms(50), W(N3)], PLAIN, None, 5000, true),
        (&[Q(DO_STUB), Q("COMMIT"), Q(N3)], OK, None, 5000, true),
    ];
    verdict(&checks(&env, &env.pool, "within", cases.to_vec(), TWICE).await);
}
