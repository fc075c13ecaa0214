//! Hostile pass (session 44) on f8ef65d: a `COMMIT` of the body's still
//! running at `commit_timeout_ms` (3 s), cancelled by idem, and whether its
//! answer is read before the key is held: the hand-off's `ROLLBACK` timing
//! out behind it (the cancel racing the `COMMIT`'s success, a deferred check
//! that ignores the cancel, a slow statement ahead of the `COMMIT`), and the
//! paths of a call that is not dropped. Counted in the database.
use super::kit::*;
use super::*;

// ---------------------------------------------------------------------------

/// The hand-off's cancel racing the `COMMIT`'s success: the call dropped
/// 200 ms in, its `COMMIT` (queued at once) taking 3.160 to 3.255 s (5 ms steps), so that
/// it ends just before, at, or just after idem's `ROLLBACK` times out
/// (~3.2 s) and the cancel goes out; failing or not, `N2` behind or not;
/// pool of one, two duplicates queued. A `COMMIT` that committed is held
/// (or recorded by a duplicate), never freed; nothing is held over nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack44_handoff_cancel_racing_the_commits_success() {
    let env = env_slow(2).await;
    let one = pool_of(&env.db, 1);
    let mut cases = Vec::new();
    for i in 0..20_u64 {
        let first = W(slow("slowc", 3160 + 5 * i, i % 7 == 6));
        cases.push((
            V::Rc,
            commit_after(first, i % 3 == 1, false),
            PLAIN,
            Some(200_000),
            false,
        ));
    }
    verdict(&sweep(&env, &one, "race", &cases, 2, 1500, None).await);
}

/// A deferred check that ignores the cancel (4.5 s: answered in the second
/// wait; 7.5 s: never within it), succeeding or failing, `N2` behind or
/// not; dropped 200 ms in, as it reaches its end (`HANG`), or panicking;
/// pool of one, two duplicates queued. A `COMMIT` whose answer never came
/// may be held over nothing (documented), also one that would have
/// succeeded; one answered must not be.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack44_handoff_commit_ignoring_the_cancel() {
    let env = env_slow(2).await;
    env.client.batch_execute(STUBBORN).await.expect("stubborn");
    let one = pool_of(&env.db, 1);
    let mut cases = Vec::new();
    for (i, (ms, fail)) in [(4500, false), (4500, true), (7500, false), (7500, true)]
        .into_iter()
        .enumerate()
    {
        for (j, (end, us)) in [(PLAIN, Some(200_000)), (HANG, None)]
            .into_iter()
            .enumerate()
        {
            let steps = commit_after(W(slow("stubc", ms, fail)), (i + j) % 2 == 1, false);
            // Never answered in time: may be held over nothing, failing or not
            // (behind PgBouncer the closed client takes its backend with it).
            cases.push((V::Rc, steps, end, us, ms > 6000));
        }
    }
    cases.push((
        V::Rc,
        commit_after(W(slow("stubc", 4500, true)), false, false),
        PANIC,
        None,
        false,
    ));
    verdict(&sweep(&env, &one, "stub", &cases, 2, 3000, None).await);
}

/// The hand-off's cancel hitting a slow statement the body queued ahead of
/// its `COMMIT` (`pg_sleep(4)`, a 4 s immediate trigger): the `COMMIT` then
/// rolls back. Nothing committed, nothing held; `N2` never runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack44_handoff_cancel_hits_a_statement_ahead_of_the_commit() {
    let env = env_slow(2).await;
    env.client
        .batch_execute(
            "CREATE TABLE imm (tag text NOT NULL); CREATE FUNCTION imm_f() RETURNS trigger \
             LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(4); RETURN NULL; END $$; \
             CREATE TRIGGER imm_t AFTER INSERT ON imm FOR EACH ROW EXECUTE FUNCTION imm_f();",
        )
        .await
        .expect("imm");
    let one = pool_of(&env.db, 1);
    #[rustfmt::skip]
    const SHAPES: [&[A]; 4] = [&[Q("SELECT pg_sleep(4)"), Q("COMMIT")], &[Q("SELECT pg_sleep(4)"), Q("COMMIT"), Q(N2)],
        &[Q("INSERT INTO imm VALUES ('{k}')"), Q("COMMIT"), Q(N2)], &[Jq(&["SELECT pg_sleep(4)", "COMMIT", N2])]];
    let mut cases = Vec::new();
    for (t, steps) in SHAPES.iter().enumerate() {
        let v = [V::Rc, V::Sr][t % 2];
        cases.push((v, *steps, PLAIN, Some(200_000), false));
        cases.push((v, *steps, HANG, None, false));
    }
    verdict(&sweep(&env, &one, "ahead", &cases, 2, 1500, None).await);
}

/// Current-thread runtime: the session-43 shape (a 4 s `COMMIT`, failing
/// or not, `N2` behind or not) under repeatable read, serializable,
/// external mode and plain `#[retryable]`, dropped 200 ms in or panicking;
/// pool of one, two duplicates queued.
#[tokio::test(flavor = "current_thread")]
async fn attack44_current_thread_handoff_slow_commit_shapes() {
    let env = env_slow(2).await;
    let one = pool_of(&env.db, 1);
    let mut cases = Vec::new();
    for (t, v) in [V::Rr, V::Sr, V::Ext, V::Plain].into_iter().enumerate() {
        for (j, end) in [PLAIN, PANIC, FINAL].into_iter().enumerate() {
            let steps = commit_after(W(slow("slowc", 4000, (t + j) % 2 == 1)), j == 1, false);
            let us = (end != PANIC).then_some(200_000);
            cases.push((v, steps, end, us, false));
        }
    }
    verdict(&sweep(&env, &one, "ct", &cases, 2, 1500, None).await);
}

/// Pool of two, two duplicates (one may run on the advisory lock, as
/// documented): the racing `COMMIT`s again, serializable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack44_pool_of_two_racing_commits_serializable() {
    let env = env_slow(3).await;
    let two = pool_of(&env.db, 2);
    let mut cases = Vec::new();
    for i in 0..8_u64 {
        let first = W(slow("slowc", 3120 + 40 * i, i % 4 == 3));
        cases.push((
            V::Sr,
            commit_after(first, i % 2 == 1, false),
            PLAIN,
            Some(200_000),
            false,
        ));
    }
    verdict(&sweep(&env, &two, "two", &cases, 2, 1500, None).await);
}

/// A call not dropped whose body queues a `COMMIT` slower than
/// `commit_timeout_ms` (4 s, succeeding or failing, `N2` behind or not) and
/// returns `Ok`: the record rides on that `COMMIT` (idem's own), answered
/// `CommitUnknown`, cancelled: nothing committed, the key free, the
/// duplicate runs once. Multi-thread and pool of one, one duplicate queued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack44_ok_end_commit_slower_than_the_timeout_rides() {
    let env = env_slow(2).await;
    let one = pool_of(&env.db, 1);
    let mut cases = Vec::new();
    for i in 0..4 {
        let steps = commit_after(W(slow("slowc", 4000, i % 2 == 1)), i >= 2, false);
        cases.push((V::Rc, steps, OK, None, false));
    }
    verdict(&sweep(&env, &one, "okend", &cases, 1, 2000, None).await);
}

/// Found (fixed; failed every run before): a call NOT dropped (nor panicking) whose body queues a `COMMIT`
/// slower than `commit_timeout_ms` (3 s; a deferred check of 3.3, 4 or 7 s,
/// succeeding or failing, `N2` behind or not) and returns an error
/// (`PLAIN`, `FINAL`); pool of one, one duplicate queued. Seen: the call
/// answers `TransactionEnded { committed: true }` after ~3.01 s, the key is
/// held `unknown` with n1 = 0 (nothing committed, also for the `COMMIT`s
/// that would have succeeded), the duplicate refused `OutcomeUnknown`:
/// every key, 8 of 8 in each of 3 runs. idem logs "ROLLBACK got no answer;
/// discarding the connection behind=false". Also seen (probes, not kept):
/// on a current-thread runtime (`max = 4`, pool of two), and, the `COMMIT`
/// on the wire before idem looks (a 50 ms sleep after queuing it), for a
/// 7 s `COMMIT` after ~6.07 s. Promise (docs/idempotent.md):
/// a `COMMIT` still running at `commit_timeout_ms` is cancelled and its
/// answer read; one the cancel aborted holds nothing; a key is held only
/// if the body's writes may have committed. Cause: f8ef65d fixed
/// only the handed-on transaction: `Tx::send_rollback` (tx/rollback.rs),
/// its last `Err(_elapsed)` arm (not handed on), called
/// `cancel_and_discard`, aborting the body's `COMMIT` unread, and
/// `ended::body_end` then counted it committed (`unanswered_may_commit`).
/// Fixed: that arm, the hand-off's and `Tx::refuse` share
/// `Tx::cancel_and_read` (the guard kept up, the answer read).
/// (`ended_by_body_settled` in `leave` does not help: the body's queued
/// `COMMIT` is not yet on the wire when it looks.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_error_end_commit_slower_than_the_timeout_cancelled_then_held() {
    let env = env_slow(2).await;
    let one = pool_of(&env.db, 1);
    let pooled = env.db.via().is_transaction_pooling();
    let mut cases = Vec::new();
    let shapes = [(3300, false), (4000, false), (4000, true), (7000, false)];
    for (i, (ms, fail)) in shapes.into_iter().enumerate() {
        for (j, end) in [PLAIN, FINAL].into_iter().enumerate() {
            let steps = commit_after(W(slow("slowc", ms, fail)), (i + j) % 2 == 1, false);
            // Behind PgBouncer idem sends no cancel: a `COMMIT` of over
            // twice the timeout is never answered in time, and is held.
            cases.push((V::Rc, steps, end, None, pooled && ms > 6000));
        }
    }
    verdict(&sweep(&env, &one, "errend", &cases, 1, 2000, None).await);
}

/// Found (fixed; failed every run before): as above, but the body's `COMMIT` is on the wire before idem
/// looks (the body sleeps 50 ms after queuing it) and it returns `Ok`: a
/// `COMMIT` of 3.5, 4 or 7 s, succeeding or failing, `N2` queued behind or
/// not; pool of one, one duplicate queued. Seen: answered
/// `TransactionEnded { committed: true }` after ~3.07 s, the key held
/// `unknown` with n1 = 0, the duplicate refused `OutcomeUnknown`: 6 of 6
/// keys in each of 3 runs. Promise as above. Cause: `Tx::refuse`
/// (tx/mod.rs): `settle(timeout)` says `MayHaveCommitted` (the `COMMIT`
/// still running at 3 s), and it called `cancel_and_discard` and answered
/// `EndedByBody { committed: true }`, the cancelled `COMMIT`'s answer
/// never read. (With an error end the same `COMMIT` is read: the
/// `ROLLBACK` waits 3 s more, and only a `COMMIT` over 6 s is held over
/// nothing, by the `send_rollback` arm above.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_ok_end_commit_on_the_wire_slower_than_the_timeout_cancelled_then_held() {
    let env = env_slow(2).await;
    let one = pool_of(&env.db, 1);
    let pooled = env.db.via().is_transaction_pooling();
    let mut cases = Vec::new();
    let shapes = [(3500, false), (4000, true), (7000, false)];
    for (i, (ms, fail)) in shapes.into_iter().enumerate() {
        for behind in [false, true] {
            let steps = commit_after(W(slow("slowc", ms, fail)), behind, true);
            cases.push(([V::Rc, V::Sr][i % 2], steps, OK, None, pooled && ms > 6000));
        }
    }
    verdict(&sweep(&env, &one, "wire", &cases, 1, 2000, None).await);
}

/// Plain `#[retryable]` (no key): a body's `COMMIT` still running at
/// `commit_timeout_ms` (3 s), cancelled and read, is answered as it ended,
/// not `committed: true` unread (helper-48's note): a 4 s check the cancel
/// aborts committed nothing (behind PgBouncer, no cancel: it commits); one that ignores the cancel and ends in the
/// second window (4.5 s) committed, or failed. Error and `Ok` ends (the
/// `COMMIT` on the wire). The answer's flag is checked against the rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack44_plain_retryable_answers_how_the_cancelled_commit_ended() {
    let env = env_slow(2).await;
    env.client.batch_execute(STUBBORN).await.expect("stubborn");
    let one_pool = pool_of(&env.db, 1);
    // Behind PgBouncer idem sends no cancel: the 4 s `COMMIT` then ends,
    // committed, in the second window.
    let uncancelled = i64::from(env.db.via().is_transaction_pooling());
    let cases = [
        (slow("slowc", 4000, false), OK, uncancelled),
        (slow("slowc", 4000, false), PLAIN, uncancelled),
        (slow("stubc", 4500, false), OK, 1),
        (slow("stubc", 4500, false), PLAIN, 1),
        (slow("stubc", 4500, true), OK, 0),
    ];
    let mut bad = Vec::new();
    for (t, (first, end, want)) in cases.into_iter().enumerate() {
        let key = format!("pl-{t}");
        let steps: &'static [A] = Box::leak(Box::new([W(first), Q("COMMIT"), Ms(50)]));
        let ans = one(&one_pool, V::Plain, &key, &Q { steps, end }, None).await;
        let n1 = n_of(&env, &key, 1).await;
        let said = format!("TransactionEnded {{ committed: {} }}", n1 == 1);
        eprintln!("  {key} {first} end {end}: {ans}, n1 {n1}");
        if n1 != want || !ans.contains(&said) {
            bad.push(format!(
                "{key} {first} end {end}: {ans}, n1 {n1} (want {want})"
            ));
        }
    }
    bad.extend(later(&env, &one_pool, "pl", 3).await);
    verdict(&bad);
}
