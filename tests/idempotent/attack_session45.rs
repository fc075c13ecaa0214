//! Hostile pass (helper-49, session 44) on 47c2acc: a body's `COMMIT` still running at
//! `commit_timeout_ms` (3 s) is cancelled and its answer read within 3 s
//! again on every path (`Tx::cancel_and_read`, from `Tx::send_rollback` and
//! `Tx::refuse`), for calls that are NOT dropped: error ends with the
//! `COMMIT` queued, `Ok` ends with it on the wire, the cancel racing the
//! `COMMIT`'s success, a deferred check ignoring the cancel, a statement
//! ahead of it, writes queued behind it; and how long such a call takes
//! ("up to twice `commit_timeout_ms`"). Counted in the database.
use super::kit::*;
use super::*;

/// A slow immediate trigger: a statement ahead of the `COMMIT` taking 4 s.
const IMM: &str = "CREATE TABLE imm (tag text NOT NULL); CREATE FUNCTION imm_f() RETURNS \
    trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(4); RETURN NULL; END $$; \
    CREATE TRIGGER imm_t AFTER INSERT ON imm FOR EACH ROW EXECUTE FUNCTION imm_f();";

/// The kit's `commit_timeout_ms`.
const TIMEOUT_MS: u128 = 3000;

/// Twice the timeout, and 600 ms for the rest of the call (a hold, a dup).
const TWICE: Option<u128> = Some(2 * TIMEOUT_MS + 600);

// ---------------------------------------------------------------------------

/// Error ends (`PLAIN`, `FINAL`), the body's `COMMIT` queued as it returns:
/// idem's `ROLLBACK` goes out behind it and times out ~3 s later, the
/// cancel going out then. The `COMMIT` takes 2.970 to 3.040 s (5 ms steps),
/// so it ends just before, at or just after the cancel; some fail, some
/// have `N2` behind. Pool of one, one duplicate queued. A `COMMIT` that
/// committed is held, never freed; one aborted (or failed) leaves the key
/// free, the duplicate runs once; `N2` never runs; answered within twice
/// the timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack45_error_end_cancel_racing_the_commits_success() {
    let env = env_slow(2).await;
    let one = pool_of(&env.db, 1);
    let mut cases = Vec::new();
    for i in 0..15_u64 {
        let first = W(slow("slowc", 2970 + 5 * i, i % 5 == 4));
        let end = [PLAIN, FINAL][(i % 2) as usize];
        cases.push((
            V::Rc,
            commit_after(first, i % 3 == 1, false),
            end,
            None,
            false,
        ));
    }
    verdict(&sweep(&env, &one, "erace", &cases, 1, 1500, TWICE).await);
}

/// `Ok` ends with the body's `COMMIT` on the wire (50 ms before it
/// returns): `Tx::refuse` waits 3 s for it, then cancels it and reads it.
/// The `COMMIT` takes 3.020 to 3.090 s, straddling that cancel; some fail,
/// some have `N2` behind; read committed (`max = 1`, `4`) and
/// serializable. Pool of one,
/// one duplicate queued. Same checks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack45_ok_end_on_the_wire_cancel_racing_the_commits_success() {
    let env = env_slow(2).await;
    let one = pool_of(&env.db, 1);
    let mut cases = Vec::new();
    for i in 0..15_u64 {
        let first = W(slow("slowc", 3020 + 5 * i, i % 5 == 2));
        let v = [V::Rc, V::Sr, V::Rc4][(i % 3) as usize];
        cases.push((v, commit_after(first, i % 3 == 0, true), OK, None, false));
    }
    verdict(&sweep(&env, &one, "orace", &cases, 1, 1500, TWICE).await);
}

/// A deferred check ignoring the cancel, 1.5x the timeout (4.5 s: answered
/// in the second window) and 2.5x (7.5 s: never answered), succeeding or
/// failing, on the paths not dropped: an error end with the `COMMIT`
/// queued, an `Ok` end with it on the wire (with `N2` behind), a plain
/// `#[retryable]` and external mode. Answered in time: decided by its
/// answer (a failure holds nothing). Never answered: held (or, failing,
/// may be held over nothing), never freed. Pool of one, one duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack45_stubborn_commit_on_paths_not_dropped() {
    let env = env_slow(2).await;
    env.client.batch_execute(STUBBORN).await.expect("stubborn");
    let one = pool_of(&env.db, 1);
    let mut cases = Vec::new();
    for (i, (ms, fail)) in [(4500, false), (4500, true), (7500, false), (7500, true)]
        .into_iter()
        .enumerate()
    {
        let first = W(slow("stubc", ms, fail));
        let lax = ms > 6000;
        cases.push((
            V::Rc,
            commit_after(first, i % 2 == 0, false),
            PLAIN,
            None,
            lax,
        ));
        cases.push((V::Sr, commit_after(first, i % 2 == 1, true), OK, None, lax));
        match i {
            0 => cases.push((V::Plain, commit_after(first, true, false), FINAL, None, lax)),
            2 => cases.push((V::Ext, commit_after(first, false, false), PLAIN, None, lax)),
            _ => {}
        }
    }
    verdict(&sweep(&env, &one, "stub", &cases, 1, 3000, TWICE).await);
}

/// The cancel hitting a statement ahead of the body's `COMMIT`
/// (`pg_sleep(4)`, or a 4 s immediate trigger) on the paths not dropped:
/// an error end, the `COMMIT` queued, and an `Ok` end, the `COMMIT` on the
/// wire; `N2` behind; repeatable read and serializable. The `COMMIT` rolls
/// back: nothing committed, nothing held, the duplicate runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack45_cancel_hits_a_statement_ahead_of_the_commit() {
    let env = env_slow(2).await;
    env.client.batch_execute(IMM).await.expect("imm");
    let one = pool_of(&env.db, 1);
    #[rustfmt::skip]
    const SHAPES: [&[A]; 4] = [&[Q("SELECT pg_sleep(4)"), Q("COMMIT"), Q(N2)],
        &[Q("INSERT INTO imm VALUES ('{k}')"), Q("COMMIT"), Q(N2)],
        &[Jq(&["SELECT pg_sleep(4)", "COMMIT", N2])], &[Q("SELECT pg_sleep(4)"), Q("COMMIT")]];
    let mut cases = Vec::new();
    for (t, steps) in SHAPES.iter().enumerate() {
        let v = [V::Rr, V::Sr][t % 2];
        cases.push((v, *steps, PLAIN, None, false));
        let on_wire: &'static [A] = Box::leak([*steps, &[Ms(50)][..]].concat().into_boxed_slice());
        cases.push((v, on_wire, OK, None, false));
    }
    verdict(&sweep(&env, &one, "ahead", &cases, 1, 1500, TWICE).await);
}

/// Current-thread runtime: a 4 s `COMMIT` (cancelled at 3 s), succeeding
/// or failing, `N2` behind or not, error ends queued and `Ok` ends on the
/// wire, under repeatable read, serializable, external mode and plain
/// `#[retryable]`. Pool of one, two duplicates queued.
#[tokio::test(flavor = "current_thread")]
async fn attack45_current_thread_slow_commit_not_dropped() {
    let env = env_slow(2).await;
    let one = pool_of(&env.db, 1);
    let mut cases = Vec::new();
    for (t, v) in [V::Rr, V::Sr, V::Ext, V::Plain].into_iter().enumerate() {
        for (j, end) in [PLAIN, OK].into_iter().enumerate() {
            let first = W(slow("slowc", 4000, (t + j) % 2 == 1));
            cases.push((
                v,
                commit_after(first, t % 2 == 0, end == OK),
                end,
                None,
                false,
            ));
        }
    }
    verdict(&sweep(&env, &one, "ct", &cases, 2, 1500, TWICE).await);
}

/// Pool of one with three duplicates queued behind calls whose `COMMIT`
/// is cancelled at 3 s (4 s, 5 s), or answered in the second window by a
/// stubborn check (4 s): the pool keeps serving, no backend is left idle in
/// a transaction or sleeping, each key's effect at most once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[rustfmt::skip]
async fn attack45_pool_of_one_three_duplicates_queued() {
    let env = env_slow(2).await;
    env.client.batch_execute(STUBBORN).await.expect("stubborn");
    let one = pool_of(&env.db, 1);
    let cases: Vec<Case> = vec![
        (V::Rc, commit_after(W(slow("slowc", 4000, false)), true, false), FINAL, None, false),
        (V::Rc, commit_after(W(slow("slowc", 5000, false)), false, true), OK, None, false),
        (V::Rr, commit_after(W(slow("stubc", 4000, false)), true, true), OK, None, false),
        (V::Sr, commit_after(W(slow("stubc", 4000, true)), false, false), PLAIN, None, false),
        (V::Ext, commit_after(W(slow("slowc", 4000, false)), true, true), OK, None, false),
    ];
    verdict(&sweep(&env, &one, "three", &cases, 3, 1500, TWICE).await);
}

/// Found (fixed; failed every run before): an error end (`PLAIN`, `FINAL`; local and external mode) whose
/// body's `COMMIT` is on the wire before it returns (a 50 ms sleep after
/// queuing it), slower than `commit_timeout_ms` (3 s): a stubborn check of
/// 9.5 s (never answered in two windows), and `slowc` of 6.05 s. Pool of
/// one, one duplicate queued. Seen (2 of 2 runs): the 9.5 s ones answer
/// `TransactionEnded { committed: true }` after 9.07-9.08 s, three windows
/// (effects right: held `unknown`, n1 = 1, or 0 for the failing one, the
/// duplicate refused); the 6.05 s `slowc` is not cancelled at 3 s, it
/// commits at ~6.05 s (n1 = 1, held). Promise (docs/idempotent.md): "A
/// `COMMIT` still running when `commit_timeout_ms` has passed is cancelled
/// ... such a call can take up to twice `commit_timeout_ms` to answer".
/// Cause: `Call::leave` (idempotency/call/mod.rs) first waits a whole
/// window in `attempt.ended_by_body_settled()` (`Tx::settle`, no cancel,
/// answer `MayHaveCommitted` dropped), then the loop's `roll_back_reading`
/// (`Tx::send_rollback`) waits a second for the `ROLLBACK` behind the
/// `COMMIT`, and only then `cancel_and_read` a third. Fixed:
/// `Tx::ended_by_body_settled` cancels and reads a second window itself,
/// and nothing waits for what is still unanswered after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[rustfmt::skip]
async fn found_error_end_commit_on_the_wire_waits_three_windows() {
    let env = env_slow(2).await;
    env.client.batch_execute(STUBBORN).await.expect("stubborn");
    let one = pool_of(&env.db, 1);
    // Behind PgBouncer idem sends no cancel: the 6.05 s `COMMIT` runs past
    // the second window, and is held.
    let pooled = env.db.via().is_transaction_pooling();
    let cases: Vec<Case> = vec![
        (V::Rc, commit_after(W(slow("stubc", 9500, false)), false, true), PLAIN, None, true),
        (V::Rc, commit_after(W(slow("stubc", 9500, true)), true, true), FINAL, None, true),
        (V::Ext, commit_after(W(slow("stubc", 9500, false)), false, true), PLAIN, None, true),
        (V::Rc, commit_after(W(slow("slowc", 6050, false)), false, true), PLAIN, None, pooled),
    ];
    verdict(&sweep(&env, &one, "win3", &cases, 1, 3000, TWICE).await);
}

/// Found (fixed; failed every run before): external mode, an `Ok` end with the body's `COMMIT` on the wire
/// (phase 3 committed by hand, 50 ms before returning), slower than the
/// timeout: `slowc` of 9 s (cancellable) succeeding or failing (`N2`
/// behind), a stubborn check of 9.5 s, `slowc` of 25 s. Pool of one, one
/// duplicate. Seen (2 of 2 runs): answered `TransactionEnded` after 9.02,
/// 9.02, 9.53-9.56 and 25.02 s: the `COMMIT` is never cancelled nor
/// bounded, it runs to its end (n1 = 1 for the succeeding ones; keys held
/// `unknown`, right for external mode). Promise: README "`commit_timeout_ms`
/// bounds the wait for every `COMMIT`", "no statement outlives the
/// deadline" (20 s here); docs/idempotent.md "cancelled ... up to twice
/// `commit_timeout_ms`". Cause: `Call::leave` (idempotency/call/mod.rs),
/// external branch: `attempt.open()` finds the transaction open and
/// `Call::record` sends the record statement, unbounded, queued in
/// tokio-postgres behind the body's running `COMMIT`; no `settle`/`refuse`
/// with `commit_timeout` comes first (local mode's `commit_with` does).
/// Fixed: that branch looks first (`ended_by_body_settled`, which cancels
/// and reads), and records nothing behind an end the body sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[rustfmt::skip]
async fn found_external_ok_end_commit_on_the_wire_waited_unbounded() {
    let env = env_slow(2).await;
    env.client.batch_execute(STUBBORN).await.expect("stubborn");
    let one = pool_of(&env.db, 1);
    let cases: Vec<Case> = vec![
        (V::Ext, commit_after(W(slow("slowc", 9000, false)), false, true), OK, None, true),
        (V::Ext, commit_after(W(slow("slowc", 9000, true)), true, true), OK, None, true),
        (V::Ext, commit_after(W(slow("stubc", 9500, false)), false, true), OK, None, true),
        (V::Ext, commit_after(W(slow("slowc", 25000, false)), false, true), OK, None, true),
    ];
    verdict(&sweep(&env, &one, "extok", &cases, 1, 3000, TWICE).await);
}
