//! Hostile tests of local mode's hold: a body that commits by hand
//! (`TransactionEnded { committed: true }`) leaves its key held as outcome
//! unknown (docs/idempotent.md, "local"), so a repeat is answered
//! `OutcomeUnknown` and never runs the body again, until settled; a body
//! that committed nothing leaves the key free. Runs, effects and records
//! are counted (a counter in the body, the side connection), never taken
//! from idem's report. Tests named `found_..` failed when written, and
//! pass since the fixes each names.

use super::*;

/// How the body's first run answers after its SQL.
#[derive(Clone, Copy, Debug)]
enum Ret {
    Ok,
    /// Not final.
    Timeout,
    /// Final (stored, unless the body committed by hand).
    Decline,
}

/// Effect `run`, then `sql` on its first run, then answers as `ret`; later
/// runs answer `Ok(run)`. In `sql`, `$I` inserts an effect of the key's,
/// `$R` fails with 40001. Prefixes: `RACE;` the first run loses a
/// serialization race (replayed) and `sql` runs on the second; `SWALLOW;` a
/// failed statement first, its error ignored; `DROP;` the future of `sql`
/// dropped after 100 ms (a timeout around it); `Q;` through `sql_query`
/// (else `batch_execute`).
#[idempotent(key = key, fingerprint(key), scope = none)]
#[retryable(max = 3, deadline_ms = 10000)]
async fn hand(
    conn: &mut AsyncPgConnection,
    key: &str,
    sql: &str,
    ret: Ret,
    runs: &AtomicU32,
) -> Result<i64, AppError> {
    let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
    insert_effect(conn, key, i64::from(run)).await?;
    let raced = sql.starts_with("RACE;");
    if raced && run == 1 {
        conn.batch_execute(&raise("40001")).await?;
    }
    if run != 1 + u32::from(raced) {
        return Ok(i64::from(run));
    }
    let sql = sql
        .trim_start_matches("RACE;")
        .replace("$R", &raise("40001"));
    let mut sql = sql.replace(
        "$I",
        &format!("INSERT INTO effects (tag, n) VALUES ('{key}', 9)"),
    );
    if let Some(rest) = sql.strip_prefix("SWALLOW;") {
        let _ = conn.batch_execute("SELECT 1/0").await;
        sql = rest.to_owned();
    }
    if let Some(rest) = sql.strip_prefix("DROP;") {
        let _ = tokio::time::timeout(Duration::from_millis(100), conn.batch_execute(rest)).await;
    } else if let Some(rest) = sql.strip_prefix("Q;") {
        diesel::sql_query(rest).execute(conn).await?;
    } else {
        conn.batch_execute(&sql).await?;
    }
    match ret {
        Ret::Ok => Ok(1),
        Ret::Timeout => Err(AppError::Timeout),
        Ret::Decline => Err(AppError::Declined(Declined::InsufficientFunds {
            needed: 1,
        })),
    }
}

fn raise(code: &str) -> String {
    format!("DO $$ BEGIN RAISE EXCEPTION 'x' USING ERRCODE = '{code}'; END $$")
}

/// `late`: a row's deferred check sleeps `pause` seconds at `COMMIT`, then
/// refuses the `COMMIT` when `fail`; `deferred`: a deferred unique key.
async fn at_commit(env: &Env) {
    env.client
        .batch_execute(
            "CREATE TABLE deferred (x int UNIQUE DEFERRABLE INITIALLY DEFERRED);
             CREATE TABLE late (pause float8, fail bool);
             CREATE FUNCTION late() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
               PERFORM pg_sleep(NEW.pause);
               IF NEW.fail THEN RAISE EXCEPTION 'refused' USING ERRCODE = 'check_violation'; END IF;
               RETURN NULL; END $$;
             CREATE CONSTRAINT TRIGGER late AFTER INSERT ON late DEFERRABLE INITIALLY DEFERRED
               FOR EACH ROW EXECUTE FUNCTION late();",
        )
        .await
        .unwrap();
}

fn ended(r: &Result<impl std::fmt::Debug, AppError>) -> Option<bool> {
    match r {
        Err(AppError::Idem(idem::Error::TransactionEnded { committed })) => Some(*committed),
        _ => None,
    }
}

/// `state/mode` of the record of `key`; [`HELD`] for local mode's hold.
async fn held(env: &Env, key: &str) -> Option<String> {
    let sql = "SELECT state::text || '/' || mode::text FROM idem_requests WHERE key = $1";
    let row = env.client.query_opt(sql, &[&key]).await.unwrap();
    row.map(|r| r.get(0))
}
const HELD: Option<&str> = Some("unknown/local");

/// Every way a body can end the transaction by hand, and every answer
/// after it, as `(sql, answer, effects committed)`. Committed (`n > 0`):
/// told `committed: true`, the key held as `unknown` in mode `local`, a
/// repeat `OutcomeUnknown` without a run. Nothing committed (`0`): told
/// `committed: false`, no record, a repeat runs the body and records it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_hold_every_hand_end_is_held_iff_it_committed() {
    let env = env(2).await;
    at_commit(&env).await;
    let pool = pool_of(&env.db, 2);
    let slow = "DROP;INSERT INTO late VALUES (1, false); COMMIT";
    let refused = "DROP;INSERT INTO late VALUES (1, true); COMMIT";
    let mut cases = vec![
        ("COMMIT", Ret::Ok, 1),
        ("COMMIT", Ret::Timeout, 1),
        ("COMMIT", Ret::Decline, 1),
        ("END", Ret::Ok, 1),
        ("end transaction", Ret::Decline, 1),
        ("Q;/* c */ commit work", Ret::Ok, 1),
        ("Q;COMMIT", Ret::Timeout, 1),
        ("COMMIT AND CHAIN", Ret::Ok, 1),
        ("Q;COMMIT AND CHAIN", Ret::Decline, 1),
        ("COMMIT; $I", Ret::Ok, 2),
        ("COMMIT; BEGIN; $I", Ret::Ok, 1),
        ("COMMIT; $I; $R", Ret::Ok, 1),
        ("COMMIT; SELECT 1/0", Ret::Decline, 1),
        ("ROLLBACK; $I", Ret::Ok, 1),
        ("ABORT; $I; $I", Ret::Timeout, 2),
        ("RACE;COMMIT", Ret::Ok, 1),
        (slow, Ret::Ok, 1),
        (slow, Ret::Timeout, 1),
        (slow, Ret::Decline, 1),
        ("ROLLBACK", Ret::Ok, 0),
        ("ABORT", Ret::Decline, 0),
        ("Q;ROLLBACK", Ret::Timeout, 0),
        ("ROLLBACK AND CHAIN", Ret::Ok, 0),
        ("SWALLOW;COMMIT", Ret::Ok, 0),
        ("SWALLOW;Q;END", Ret::Decline, 0),
        ("SWALLOW;COMMIT AND CHAIN", Ret::Ok, 0),
        ("INSERT INTO deferred VALUES (1), (1); COMMIT", Ret::Ok, 0),
        ("INSERT INTO late VALUES (0, true); COMMIT", Ret::Timeout, 0),
        (refused, Ret::Ok, 0),
        (refused, Ret::Timeout, 0),
        ("RACE;ROLLBACK", Ret::Ok, 0),
        ("ROLLBACK; BEGIN; $I", Ret::Ok, 0),
    ];
    let sql = "SELECT current_setting('max_prepared_transactions')::bigint";
    if env.scalar(sql).await == 0 {
        // Refused by the server: nothing prepared.
        cases.push(("PREPARE TRANSACTION 'idem_hold'", Ret::Ok, 0));
    }
    let mut seen = Vec::new();
    for (i, (sql, ret, want)) in cases.into_iter().enumerate() {
        let (key, runs) = (format!("hand-{i}"), AtomicU32::new(0));
        let first = hand(&pool, &key, sql, ret, &runs).await;
        let (effects, record) = (env.effects(&key).await, held(&env, &key).await);
        let repeat = hand(&pool, &key, sql, ret, &runs).await;
        let (effects2, state) = (env.effects(&key).await, env.state(&key).await);
        let before = 1 + u32::from(sql.starts_with("RACE;"));
        let fine = effects == want
            && if want > 0 {
                ended(&first) == Some(true)
                    && record.as_deref() == HELD
                    && matches_idem(&repeat, "OutcomeUnknown")
                    && (calls(&runs), effects2) == (before, want)
            } else {
                ended(&first) == Some(false)
                    && record.is_none()
                    && matches!(&repeat, Ok(v) if !v.replayed && v.value > 1)
                    && (effects2, state.as_deref()) == (1, Some("completed"))
            };
        seen.push(format!(
            "{}{sql:?} {ret:?}: {first:?}, effects {effects}/{want}, {record:?}; \
             repeat {repeat:?}, runs {}, effects {effects2}",
            if fine { "" } else { "BAD " },
            calls(&runs)
        ));
    }
    let bad: Vec<_> = seen.iter().filter(|s| s.starts_with("BAD")).collect();
    assert!(bad.is_empty(), "{}", seen.join("\n"));
}

// --- The call ends without an answer after the body's COMMIT

/// Effect, `COMMIT` by hand, then (first run only) waits on an outside
/// system for `after_ms`, or panics with `after_ms` 0.
#[idempotent(key = key, fingerprint(key), scope = none)]
#[retryable(max = 1, deadline_ms = 60000)]
async fn commits_then_waits(
    conn: &mut AsyncPgConnection,
    key: &str,
    after_ms: u64,
    runs: &AtomicU32,
) -> Result<i64, AppError> {
    let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
    insert_effect(conn, key, i64::from(run)).await?;
    if run > 1 {
        return Ok(i64::from(run));
    }
    conn.batch_execute("COMMIT").await?;
    assert!(after_ms > 0, "the body panics after its own COMMIT");
    tokio::time::sleep(Duration::from_millis(after_ms)).await;
    Ok(1)
}

/// Once anything idem does in the background had time: the record of
/// `key`, what a repeat gets, and the effects then, when the key was not
/// held as promised.
async fn not_held_after(env: &Env, key: &str, runs: &AtomicU32) -> Option<String> {
    tokio::time::sleep(Duration::from_secs(3)).await;
    let record = held(env, key).await;
    let repeat = commits_then_waits(&env.pool, key, 1, runs).await;
    let (effects, runs) = (env.effects(key).await, calls(runs));
    let fine = record.as_deref() == HELD && matches_idem(&repeat, "OutcomeUnknown");
    let report = format!("record {record:?}; repeat {repeat:?}, runs {runs}, effects {effects}");
    (!fine || effects != 1).then_some(report)
}

/// Found, and fixed (a drop guard on the call spawns the hold). The caller gives up on the call (a `timeout` around it, an HTTP
/// client gone: axum drops the handler's future; here its task is aborted
/// once the hand `COMMIT` is visible) while the body, past its own
/// `COMMIT`, waits on something else. Seen: no hold is written (no record
/// at all, 3 s later), and the repeat runs the body again: `Ok(2)` fresh,
/// two effects. The docs promise that a body that commits by hand has its
/// key held, every repeat answered `OutcomeUnknown` without running the
/// body, the only exceptions being a duplicate in the window before the
/// hold and a hold that cannot be written (logged as an error); here the
/// hold is never attempted (`Call::end` never runs). idem does act on a
/// dropped call elsewhere (README, "A call dropped or panicking after a
/// swap"): the hold could be spawned from a drop guard the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_a_call_dropped_after_the_hand_commit_is_not_held() {
    let env = env(2).await;
    let (runs, key) = (Arc::new(AtomicU32::new(0)), "dropped-after-commit");
    let (pool, r) = (env.pool.clone(), runs.clone());
    let call =
        tokio::spawn(async move { commits_then_waits(&pool, key, 60_000, &r).await.is_ok() });
    let until = Instant::now() + Duration::from_secs(30);
    while env.effects(key).await == 0 {
        assert!(Instant::now() < until, "the hand COMMIT never committed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    call.abort(); // The caller gives up: the call's future is dropped.
    assert!(call.await.is_err_and(|e| e.is_cancelled()));
    let bad = not_held_after(&env, key, &runs).await;
    assert!(bad.is_none(), "after the drop: {}", bad.unwrap());
}

/// Found, and fixed by the same drop guard (the docs never named panics here). The
/// body panics after its own `COMMIT`. Seen: no hold, and the repeat runs
/// the body again (two effects), as for a dropped call above; the same fix
/// (a guard that writes the hold when the call ends without an answer)
/// would cover it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_a_panic_after_the_hand_commit_is_not_held() {
    let env = env(2).await;
    let runs = Arc::new(AtomicU32::new(0));
    let key = "panic-after-commit";
    let (pool, r) = (env.pool.clone(), runs.clone());
    let first = tokio::spawn(async move { commits_then_waits(&pool, key, 0, &r).await.is_ok() });
    assert!(first.await.is_err_and(|e| e.is_panic()));
    assert_eq!(env.effects(key).await, 1, "the hand COMMIT committed");
    let bad = not_held_after(&env, key, &runs).await;
    assert!(bad.is_none(), "after the panic: {}", bad.unwrap());
}

// --- Duplicates

/// Every run: effect, 1.5 s, `COMMIT` by hand, `Ok`.
#[idempotent(key = key, fingerprint(key), scope = none)]
#[retryable(max = 1, deadline_ms = 60000)]
async fn always_commits(
    conn: &mut AsyncPgConnection,
    key: &str,
    runs: &AtomicU32,
) -> Result<i64, AppError> {
    runs.fetch_add(1, Ordering::SeqCst);
    let id = insert_effect(conn, key, 1).await?;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    conn.batch_execute("COMMIT").await?;
    Ok(id)
}

/// `n` duplicates of `key` on `pool`, the first 300 ms before the others
/// (so they queue behind it): their answers, the runs, the effects.
async fn duplicates(env: &Env, pool: &Pool, key: &str, n: u64) -> (Vec<String>, u32, i64) {
    let runs = AtomicU32::new(0);
    let runs_ = &runs;
    let seen = futures_util::future::join_all((0..n).map(|i| async move {
        tokio::time::sleep(Duration::from_millis(300 * i.min(1))).await;
        let r = always_commits(pool, key, runs_).await;
        format!("{:?}", r.map(|v| v.replayed))
    }))
    .await;
    (seen, calls(&runs), env.effects(key).await)
}

/// Duplicates queued on the key's advisory lock (a pool large enough)
/// behind a body that commits by hand (every run does): the documented
/// window lets the next one in after the body's `COMMIT`; the hold, written
/// well within that one's 1.5 s, stops the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn attack_hold_duplicates_queued_on_the_lock() {
    let env = env(8).await;
    let (seen, runs, effects) = duplicates(&env, &env.pool, "dup-lock", 5).await;
    assert!(
        runs <= 2 && effects == i64::from(runs),
        "{seen:?}, runs {runs}"
    );
    let unknown = seen.iter().filter(|s| s.contains("OutcomeUnknown")).count();
    assert_eq!(unknown as u32 + runs, 5, "{seen:?}");
    assert_eq!(held(&env, "dup-lock").await.as_deref(), HELD);
}

/// Found, and fixed (the hold is written on the call's own connection before
/// it goes back to the pool). Four such duplicates, all started 1.2 s before the first body's
/// `COMMIT`, on a pool of one (any pool with callers waiting for a
/// connection): they queue on the pool instead of the advisory lock. Seen:
/// all four run the body (four effects, each answered `TransactionEnded {
/// committed: true }`, the hold written only after the last): the hold's
/// own checkout queues (FIFO) behind the duplicates it should stop, so each
/// of them reads no record. The docs say one duplicate arriving between the
/// body's `COMMIT` and the hold runs the body "once more"; these arrived
/// before the `COMMIT`, and the window never closed while callers waited.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn found_duplicates_queued_on_the_pool_run_before_the_hold() {
    let env = env(2).await;
    let pool = pool_of(&env.db, 1);
    let (seen, runs, effects) = duplicates(&env, &pool, "dup-pool", 4).await;
    assert!(
        runs <= 2 && effects == i64::from(runs),
        "{seen:?}, runs {runs}, effects {effects}"
    );
}

// --- Faults around the hold

/// First run: effect (its `n` the body's backend), `COMMIT` by hand, then
/// waits at `gate` twice (the test acts in between) and answers `Ok`.
#[idempotent(key = key, fingerprint(key), scope = none)]
#[retryable(max = 1, deadline_ms = 30000, commit_timeout_ms = 1500)]
pub(super) async fn commits_at_gate(
    conn: &mut AsyncPgConnection,
    key: &str,
    gate: &Barrier,
    runs: &AtomicU32,
) -> Result<i64, AppError> {
    let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
    diesel::sql_query("INSERT INTO effects (tag, n) VALUES ($1, pg_backend_pid())")
        .bind::<Text, _>(key)
        .execute(conn)
        .await?;
    if run == 1 {
        conn.batch_execute("COMMIT").await?;
        gate.wait().await;
        gate.wait().await;
    }
    Ok(i64::from(run))
}

/// Between the body's `COMMIT` and its return, `act` runs on `side`; then
/// the call's answer, and how long it took after the body was let go.
async fn at_gate(
    env: &Env,
    side: &tokio_postgres::Client,
    key: &'static str,
    act: &str,
    runs: &Arc<AtomicU32>,
) -> (Result<idem::Idempotent<i64>, AppError>, Duration) {
    let gate = Arc::new(Barrier::new(2));
    let call = {
        let (pool, gate, runs) = (env.pool.clone(), gate.clone(), runs.clone());
        tokio::spawn(async move { commits_at_gate(&pool, key, &gate, &runs).await })
    };
    gate.wait().await;
    side.batch_execute(act).await.unwrap();
    gate.wait().await;
    let started = Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(40), call).await;
    (r.expect("the call hung").unwrap(), started.elapsed())
}

/// The body's backend killed right after its own `COMMIT`: the hold is
/// written on another connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_hold_survives_the_body_backend_killed() {
    let env = env(2).await;
    let runs = Arc::new(AtomicU32::new(0));
    let kill = "SELECT pg_terminate_backend(n::int) FROM effects WHERE tag = 'killed'";
    let (r, _) = at_gate(&env, &env.client, "killed", kill, &runs).await;
    assert_eq!(ended(&r), Some(true), "{r:?}");
    let gone = "SELECT count(*) FROM pg_stat_activity WHERE pid IN (SELECT n::int FROM effects)";
    assert_eq!(env.scalar(gone).await, 0, "the body's backend was killed");
    assert_eq!(held(&env, "killed").await.as_deref(), HELD);
    let repeat = commits_at_gate(&env.pool, "killed", &Barrier::new(1), &runs).await;
    assert!(matches_idem(&repeat, "OutcomeUnknown"), "{repeat:?}");
    assert_eq!((calls(&runs), env.effects("killed").await), (1, 1));
}

/// `idem_requests` locked by someone else while the hold is written: the
/// hold gives up within `commit_timeout_ms` (1.5 s here), the caller is
/// answered, and (as documented) a repeat runs the body again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_hold_that_cannot_be_written_is_bounded() {
    let env = env(2).await;
    let locker = side_connection(env.db.url()).await;
    let runs = Arc::new(AtomicU32::new(0));
    let lock = "BEGIN; LOCK TABLE idem_requests IN ACCESS EXCLUSIVE MODE";
    let (r, took) = at_gate(&env, &locker, "locked", lock, &runs).await;
    locker.batch_execute("ROLLBACK").await.unwrap();
    let bounded = ended(&r) == Some(true) && took < Duration::from_secs(12);
    assert!(bounded, "{r:?} after {took:?}");
    assert_eq!(held(&env, "locked").await, None, "not written");
    let again = commits_at_gate(&env.pool, "locked", &Barrier::new(1), &runs).await;
    assert!(matches!(&again, Ok(v) if !v.replayed), "{again:?}");
    assert_eq!((calls(&runs), env.effects("locked").await), (2, 2));
    assert_eq!(env.state("locked").await.as_deref(), Some("completed"));
}

// --- Scopes, fingerprints, derived keys, retention, the other mode

/// Effect `n` tagged `key`, then `COMMIT` by hand when `commit`.
#[idempotent(key = key, operation = "hold.op", fingerprint(n), scope = (tenant, user), ttl_s = 1)]
#[retryable(max = 1, deadline_ms = 10000)]
async fn op(
    conn: &mut AsyncPgConnection,
    tenant: i64,
    user: i64,
    key: &str,
    n: i64,
    commit: bool,
    runs: &AtomicU32,
) -> Result<i64, AppError> {
    let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
    insert_effect(conn, key, n).await?;
    if commit {
        conn.batch_execute("COMMIT").await?;
    }
    Ok(i64::from(run))
}

/// The same operation, in external mode.
#[idempotent(key = key, operation = "hold.op", fingerprint(n), scope = (tenant, user), ttl_s = 1, mode = external)]
#[retryable(max = 3, deadline_ms = 10000)]
async fn op_external(
    db: &mut Deferred<'_>,
    tenant: i64,
    user: i64,
    key: &str,
    n: i64,
    runs: &AtomicU32,
) -> Result<i64, AppError> {
    let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
    insert_effect(db.conn().await?, key, n).await?;
    Ok(i64::from(run))
}

/// Waits until the record of `key` is past its retention.
async fn expire(env: &Env, key: &str) {
    let until = Instant::now() + Duration::from_secs(30);
    let sql =
        format!("SELECT count(*) FROM idem_requests WHERE key = '{key}' AND expires_at <= now()");
    while env.scalar(&sql).await == 0 {
        assert!(Instant::now() < until, "{key} never expired");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A hold is per scope: another tenant's or user's request with the same
/// key runs as its own; concurrent repeats get `OutcomeUnknown`, other
/// requests under the key `FingerprintMismatch`, none runs; a settle under
/// another scope touches nothing; the right one releases the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn attack_hold_is_per_scope_and_settled_in_its_scope() {
    let env = env(10).await;
    let runs = AtomicU32::new(0);
    let r = op(&env.pool, 1, 7, "sc", 1, true, &runs).await;
    assert_eq!(ended(&r), Some(true), "{r:?}");
    for (tenant, user) in [(2, 7), (1, 8), (7, 1)] {
        let other = op(&env.pool, tenant, user, "sc", 1, false, &runs).await;
        assert!(
            matches!(&other, Ok(v) if !v.replayed),
            "{tenant}/{user}: {other:?}"
        );
    }
    let repeats = (0..8).map(|i| op(&env.pool, 1, 7, "sc", 1 + i % 2, false, &runs));
    let repeats = futures_util::future::join_all(repeats).await;
    for (i, r) in repeats.iter().enumerate() {
        let want = ["OutcomeUnknown", "FingerprintMismatch"][i % 2];
        assert!(matches_idem(r, want), "{i}: {r:?}");
    }
    assert_eq!((calls(&runs), env.effects("sc").await), (4, 4));
    for wrong in [(2_i64, 7_i64), (1, 8), (7, 1)] {
        let settled = settle(&env.pool, &wrong, "sc", Settlement::Released).await;
        assert!(matches!(settled, Ok(false)), "{wrong:?}: {settled:?}");
    }
    assert!(settle(&env.pool, &(), "sc", Settlement::Released)
        .await
        .is_ok_and(|s| !s));
    let sql = "SELECT count(*) FILTER (WHERE state = 'unknown') * 10 + count(*) FROM idem_requests";
    assert_eq!(env.scalar(sql).await, 14, "one held, three completed");
    let settled = settle(&env.pool, &(1_i64, 7_i64), "sc", Settlement::Released).await;
    assert!(matches!(settled, Ok(true)), "{settled:?}");
    let again = op(&env.pool, 1, 7, "sc", 1, false, &runs).await;
    assert!(matches!(&again, Ok(v) if !v.replayed), "{again:?}");
    assert_eq!(env.effects("sc").await, 5);
}

/// A hold outlives its `ttl_s`: past it, a repeat is still `OutcomeUnknown`
/// and `purge_expired` keeps it. It takes over an expired completed record
/// of another request (another fingerprint) or of external mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_hold_outlives_its_retention_and_takes_over_expired_records() {
    let env = env(2).await;
    let runs = AtomicU32::new(0);
    op(&env.pool, 1, 7, "fp", 1, false, &runs).await.unwrap();
    op_external(&env.pool, 1, 7, "ext", 1, &runs).await.unwrap();
    for key in ["fp", "ext"] {
        expire(&env, key).await;
    }
    let r = op(&env.pool, 1, 7, "fp", 2, true, &runs).await;
    assert_eq!(ended(&r), Some(true), "{r:?}");
    let r = op(&env.pool, 1, 7, "ext", 1, true, &runs).await;
    assert_eq!(ended(&r), Some(true), "{r:?}");
    for key in ["fp", "ext"] {
        assert_eq!(held(&env, key).await.as_deref(), HELD, "{key}");
        expire(&env, key).await;
    }
    let mut conn = AsyncPgConnection::establish(env.db.url()).await.unwrap();
    let purged = idem::idempotency::purge_expired(&mut conn, 100)
        .await
        .unwrap();
    assert!(purged.unknown >= 2, "{purged:?}");
    let old = op(&env.pool, 1, 7, "fp", 1, false, &runs).await;
    assert!(matches_idem(&old, "FingerprintMismatch"), "{old:?}");
    let repeat = op(&env.pool, 1, 7, "fp", 2, false, &runs).await;
    assert!(matches_idem(&repeat, "OutcomeUnknown"), "{repeat:?}");
    let repeat = op_external(&env.pool, 1, 7, "ext", 1, &runs).await;
    assert!(matches_idem(&repeat, "OutcomeUnknown"), "{repeat:?}");
    assert_eq!(calls(&runs), 4);
    assert_eq!((env.effects("fp").await, env.effects("ext").await), (2, 2));
}

/// No key (derived from scope, operation and fingerprint), no `#[retryable]`.
#[idempotent(scope = who, operation = "hold.derived", fingerprint(n))]
async fn derived(
    conn: &mut AsyncPgConnection,
    who: &str,
    n: i64,
    commit: bool,
    runs: &AtomicU32,
) -> Result<i64, AppError> {
    let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
    insert_effect(conn, "derived", n).await?;
    if commit {
        conn.batch_execute("COMMIT").await?;
    }
    Ok(i64::from(run))
}

/// A derived key is held like a given one, per scope and fingerprint; an
/// operator settles it by the key its record shows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_hold_of_a_derived_key_without_retryable() {
    let env = env(2).await;
    let runs = AtomicU32::new(0);
    let r = derived(&env.pool, "u1", 5, true, &runs).await;
    assert_eq!(ended(&r), Some(true), "{r:?}");
    let sql = "SELECT key FROM idem_requests WHERE state = 'unknown'";
    let key: String = env.client.query_one(sql, &[]).await.unwrap().get(0);
    let repeat = derived(&env.pool, "u1", 5, false, &runs).await;
    assert!(matches_idem(&repeat, "OutcomeUnknown"), "{repeat:?}");
    for (who, n) in [("u2", 5), ("u1", 6)] {
        let other = derived(&env.pool, who, n, false, &runs).await;
        assert!(matches!(&other, Ok(v) if !v.replayed), "{other:?}");
    }
    let done = Settlement::Completed(serde_json::json!(77));
    assert!(matches!(
        settle(&env.pool, "u1", &key, done).await,
        Ok(true)
    ));
    let replay = derived(&env.pool, "u1", 5, false, &runs).await;
    assert!(
        matches!(&replay, Ok(v) if v.replayed && v.value == 77),
        "{replay:?}"
    );
    assert_eq!((calls(&runs), env.effects("derived").await), (3, 3));
}
