//! Hostile tests of what a body does to the transaction idem gives it:
//! transaction control idem does not send (`.. AND CHAIN`, `PREPARE
//! TRANSACTION`, `CALL`), its own backend cancelled or killed, its
//! external claim touched. Effects and records are counted through the
//! side connection; a pool of one shows whether the connection stays
//! poisoned.

use super::attack::healthy;
use super::attack_ext::records_of;
use super::*;

/// How a body sends its SQL: `batch_execute` (`Batch`) or `sql_query`.
type Via = bool;
#[allow(non_upper_case_globals)]
const Batch: Via = true;

/// Writes effect 1, runs `sql` as `via`, sleeps `pause_ms`, writes effect
/// 2 and answers `Ok`.
#[idempotent(key = key, scope = none, fingerprint(tag))]
#[retryable(max = 3, deadline_ms = 10000)]
async fn around(
    conn: &mut AsyncPgConnection,
    key: &str,
    tag: &str,
    sql: &str,
    via: Via,
    pause_ms: u64,
) -> Result<i64, AppError> {
    insert_effect(conn, tag, 1).await?;
    if via {
        conn.batch_execute(sql).await?;
    } else {
        diesel::sql_query(sql).execute(conn).await?;
    }
    tokio::time::sleep(Duration::from_millis(pause_ms)).await;
    insert_effect(conn, tag, 2).await
}

/// `COMMIT AND CHAIN` / `ROLLBACK AND CHAIN` commit or roll back and open a
/// new transaction at once: the server reports a transaction open all the
/// way to idem's `COMMIT`. The docs promise `TransactionEnded`, never `Ok`,
/// for a body that runs `COMMIT` or `ROLLBACK` itself.
// Found by a hostile pass: `ROLLBACK AND CHAIN` and `ABORT AND CHAIN`
// were not seen (same tag as `ROLLBACK TO SAVEPOINT`, no idle status
// between): `Ok`, effect 2 committed with its record, effect 1 silently
// rolled back; a plain `#[retryable]` the same. The wire now tells them
// apart by their text (a `Query`'s, or the one a `Bind`'s statement was
// parsed from).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_body_chained_commit_or_rollback() {
    let env = env(2).await;
    let pool = pool_of(&env.db, 1);
    let mut seen = Vec::new();
    for (i, sql) in [
        "COMMIT AND CHAIN",
        "ROLLBACK AND CHAIN",
        "END AND CHAIN",
        "ABORT AND CHAIN",
    ]
    .iter()
    .enumerate()
    {
        for via in [Batch, !Batch] {
            let how = if via { "batch_execute" } else { "sql_query" };
            let tag = format!("chain-{i}-{how}");
            let r = around(&pool, &tag, &tag, sql, via, 0).await;
            let effects = env.effects(&tag).await;
            let records = records_of(&env, &tag).await;
            seen.push(format!(
                "{sql} via {how}: {r:?}, effects {effects}, records {records}"
            ));
        }
    }
    let r = plain(
        &pool,
        "INSERT INTO effects (tag, n) VALUES ('chain-plain', 1); ROLLBACK AND CHAIN; \
         INSERT INTO effects (tag, n) VALUES ('chain-plain', 2)",
    )
    .await;
    let effects = env.effects("chain-plain").await;
    seen.push(format!(
        "plain #[retryable] ROLLBACK AND CHAIN: {r:?}, effects {effects}"
    ));
    healthy(&env, &pool, "chain-after", 2).await;
    assert!(
        seen.iter().all(|s| s.contains("TransactionEnded")),
        "chained transaction control answered Ok:\n{}",
        seen.join("\n")
    );
}

/// Two duplicates of one key, each body running chained transaction
/// control after its first write (so the key's advisory lock goes with it)
/// and pausing: the second finds no record and runs too.
/// `COMMIT AND CHAIN`: each committed its first write by hand, and each is
/// told so (`TransactionEnded { committed: true }`, as documented); the
/// second ran in the window docs/idempotent.md names (after the first's
/// `COMMIT`, before its key was held), and the key is then held as outcome
/// unknown: one record. `ROLLBACK AND CHAIN`: each is told its transaction ended
/// (`TransactionEnded { committed: false }`), nothing committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn attack_body_chained_control_lets_a_duplicate_in() {
    let env = env(3).await;
    let pool = pool_of(&env.db, 2);
    healthy(&env, &pool, "dup-warm", 1).await;
    let mut seen = Vec::new();
    for (tag, sql) in [
        ("cc-dup", "COMMIT AND CHAIN"),
        ("rc-dup", "ROLLBACK AND CHAIN"),
    ] {
        let first = {
            let pool = pool.clone();
            tokio::spawn(async move { around(&pool, tag, tag, sql, Batch, 600).await })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        let second = around(&pool, tag, tag, sql, Batch, 0).await;
        let first = first.await.unwrap();
        let effects = env.effects(tag).await;
        let records = records_of(&env, tag).await;
        seen.push(format!(
            "{sql}: first {first:?}, second {second:?}; effects {effects}, records {records}"
        ));
    }
    assert!(
        seen[0].contains("first Err(Idem(TransactionEnded { committed: true }))")
            && seen[0].contains("second Err(Idem(TransactionEnded { committed: true }))")
            && seen[0].ends_with("records 1"),
        "{seen:?}"
    );
    assert!(
        seen[1].contains("first Err(Idem(TransactionEnded { committed: false }))")
            && seen[1].contains("second Err(Idem(TransactionEnded { committed: false }))")
            && seen[1].ends_with("effects 0, records 0"),
        "{seen:?}"
    );
    assert_eq!(env.state("cc-dup").await.as_deref(), Some("unknown"));
}

/// After `ROLLBACK AND CHAIN` the body's statements run in a transaction
/// without idem's `SET LOCAL statement_timeout`: does the deadline still
/// bound them?
#[idempotent(key = key, scope = none, fingerprint(key))]
#[retryable(max = 1, deadline_ms = 800)]
async fn sleeps_after(conn: &mut AsyncPgConnection, key: &str, sql: &str) -> Result<i64, AppError> {
    conn.batch_execute(sql).await?;
    conn.batch_execute("SELECT pg_sleep(3)").await?;
    insert_effect(conn, key, 1).await
}

// Left open (a hostile pass): the chained transaction has none of idem's
// `SET LOCAL`s, so the `pg_sleep(3)` runs to its end, past the deadline
// (about 3 s under `deadline_ms = 800`). What is pinned: the call fails and
// nothing commits (before the wire saw the chain, it answered `Ok`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_body_rollback_and_chain_drops_the_deadline() {
    let env = env(2).await;
    let pool = pool_of(&env.db, 1);
    let started = Instant::now();
    let r = sleeps_after(&pool, "rbc-deadline", "ROLLBACK AND CHAIN").await;
    let took = started.elapsed();
    let effects = env.effects("rbc-deadline").await;
    let records = records_of(&env, "rbc-deadline").await;
    assert!(
        matches!(r, Err(AppError::Idem(idem::Error::TransactionEnded { committed: false })))
            && (effects, records) == (0, 0),
        "pg_sleep(3) after ROLLBACK AND CHAIN under 800 ms: {r:?} after {took:?}; effects {effects}"
    );
}

// ---------------------------------------------------------------------------
// Session state a body commits and leaves on the pooled connection
// ---------------------------------------------------------------------------

/// Fresh keys, each called twice, on `pool`: `(first, replay)` outcomes and
/// effects written, for a report instead of a panic.
pub(super) async fn next_callers(env: &Env, pool: &Pool, tag: &str) -> (Vec<String>, i64) {
    let before = env.effects(tag).await;
    let mut out = Vec::new();
    for i in 0..3 {
        let key = format!("{tag}-next-{i}");
        let mut ab = Vec::new();
        for _ in 0..2 {
            ab.push(
                around(pool, &key, tag, "", Batch, 20)
                    .await
                    .map(|v| v.replayed),
            );
        }
        out.push(format!("{:?}/{:?}", ab[0], ab[1]));
    }
    (out, env.effects(tag).await - before)
}

/// A plain transaction (no key) that runs `sql`.
#[retryable(max = 1, deadline_ms = 5000)]
pub(super) async fn plain(conn: &mut AsyncPgConnection, sql: &str) -> Result<(), AppError> {
    conn.batch_execute(sql).await?;
    Ok(())
}

/// Each `sql` runs after the body's write, at its very end: what commits
/// must match what is recorded, and the call is `Ok` only with its record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_body_ends_its_own_backend_or_goes_read_only() {
    let env = env(2).await;
    let mut seen = Vec::new();
    for (i, sql) in [
        "SELECT pg_cancel_backend(pg_backend_pid())",
        "SELECT pg_terminate_backend(pg_backend_pid())",
        "SET TRANSACTION READ ONLY",
        "LOCK TABLE idem_requests IN ACCESS EXCLUSIVE MODE",
        "SET LOCAL idle_in_transaction_session_timeout = '1ms'",
    ]
    .iter()
    .enumerate()
    {
        let pool = pool_of(&env.db, 1);
        let tag = format!("end-{i}");
        let r = around(&pool, &tag, &tag, sql, Batch, 50).await;
        let (effects, records) = (env.effects(&tag).await, records_of(&env, &tag).await);
        let again = around(&pool, &tag, &tag, sql, Batch, 50).await;
        let (effects2, records2) = (env.effects(&tag).await, records_of(&env, &tag).await);
        let (next, written) = next_callers(&env, &pool, &tag).await;
        seen.push(format!(
            "{sql}: {r:?} -> effects {effects} records {records}; again {again:?} -> effects {effects2} \
             records {records2}; next {next:?} +{written}"
        ));
        let consistent = effects == 2 * records && effects2 == 2 * records2 && records2 <= 1;
        let ok_committed = r.as_ref().map_or(true, |_| records == 1);
        if !(consistent && ok_committed && written == 6) {
            seen.push("^^^ BAD".to_owned());
        }
    }
    assert!(!seen.iter().any(|s| s == "^^^ BAD"), "{}", seen.join("\n"));
}

// ---------------------------------------------------------------------------
// External mode: phase 3 plays with its transaction or its claim
// ---------------------------------------------------------------------------

/// Phase 3: writes effect 1, runs `sql` (`$1` is the key), writes effect 2;
/// counts its runs (the outside call).
#[idempotent(key = key, operation = "body.ext", fingerprint(key), mode = external, scope = none)]
#[retryable(max = 3, deadline_ms = 10000)]
async fn external_body(
    db: &mut Deferred<'_>,
    key: &str,
    sql: &str,
    runs: &AtomicU32,
) -> Result<String, AppError> {
    runs.fetch_add(1, Ordering::SeqCst);
    let conn = db.conn().await?;
    insert_effect(conn, key, 1).await?;
    if sql.contains("$1") {
        diesel::sql_query(sql)
            .bind::<Text, _>(key)
            .execute(conn)
            .await?;
    } else {
        conn.batch_execute(sql).await?;
    }
    insert_effect(conn, key, 2).await?;
    Ok("receipt".to_owned())
}

/// Each must fail (the claim then held, the outside call not repeated) and
/// leave the connection healthy. Held: `COMMIT AND CHAIN` is
/// `TransactionEnded { committed: true }` with the key `unknown`; deleting
/// or completing its own claim by hand is `ClaimLost`, nothing committed;
/// a read-only phase 3 commits nothing.
// Found by a hostile pass: `ROLLBACK AND CHAIN` in phase 3 answered `Ok`
// and recorded the outcome with the body's second write only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_body_external_phase_three_ends_or_deletes_its_claim() {
    let env = env(2).await;
    let mut seen = Vec::new();
    for (i, sql) in [
        "ROLLBACK AND CHAIN",
        "COMMIT AND CHAIN",
        "DELETE FROM idem_requests WHERE key = $1",
        "UPDATE idem_requests SET state = 'completed' WHERE key = $1",
        "SET TRANSACTION READ ONLY",
    ]
    .iter()
    .enumerate()
    {
        let pool = pool_of(&env.db, 1);
        let key = format!("ext-{i}");
        let runs = AtomicU32::new(0);
        let r = external_body(&pool, &key, sql, &runs).await;
        let effects = env.effects(&key).await;
        let state = env.record(&key).await;
        let again = external_body(&pool, &key, sql, &runs).await;
        let effects2 = env.effects(&key).await;
        let (next, written) = next_callers(&env, &pool, &key).await;
        seen.push(format!(
            "{sql}: {r:?} -> effects {effects} record {state:?}; again {again:?} -> effects {effects2}, \
             outside calls {}; next {next:?} +{written}",
            calls(&runs)
        ));
        let fine = r.is_err() && again.is_err() && calls(&runs) == 1 && effects2 == effects;
        if !(fine && written == 6 && next.iter().all(|s| s == "Ok(false)/Ok(true)")) {
            seen.push("^^^ BAD".to_owned());
        }
    }
    assert!(!seen.iter().any(|s| s == "^^^ BAD"), "{}", seen.join("\n"));
}

/// Writes an effect, then `PREPARE TRANSACTION 'gid'` as its last statement.
#[idempotent(key = key, scope = none, fingerprint(key))]
#[retryable(max = 3, deadline_ms = 3000)]
async fn prepares_last(
    conn: &mut AsyncPgConnection,
    key: &str,
    gid: &str,
) -> Result<i64, AppError> {
    let id = insert_effect(conn, key, 1).await?;
    conn.batch_execute(&format!("PREPARE TRANSACTION '{gid}'"))
        .await?;
    Ok(id)
}

/// Needs `max_prepared_transactions > 0` (skipped otherwise: the refusal
/// is pinned by `attack_body_ends_or_fails_the_transaction`). Held, as
/// documented: `TransactionEnded { committed: true }`, not replayed. The
/// prepared transaction outlives the session with the body's write and the
/// key's lock: a repeat waits its whole deadline (`Exhausted`), other keys
/// on the same connection work; once someone runs `COMMIT PREPARED` the
/// write is committed without a record, and the key runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_body_prepares_a_two_phase_transaction() {
    let env = env(2).await;
    if env
        .scalar("SELECT current_setting('max_prepared_transactions')::bigint")
        .await
        == 0
    {
        return;
    }
    let pool = pool_of(&env.db, 1);
    let gid = format!(
        "idem_attack_{}",
        env.scalar("SELECT pg_backend_pid()::bigint").await
    );
    let r = prepares_last(&pool, "2pc", &gid).await;
    let prepared = env
        .scalar("SELECT count(*) FROM pg_prepared_xacts WHERE gid LIKE 'idem_attack_%'")
        .await;
    let (effects, records) = (env.effects("2pc").await, records_of(&env, "2pc").await);
    let started = Instant::now();
    let again = prepares_last(&pool, "2pc", &format!("{gid}b")).await;
    let waited = started.elapsed();
    let (next, written) = next_callers(&env, &pool, "2pc-next").await;
    // An operator (or the application) resolves the prepared transaction.
    env.client
        .batch_execute(&format!("COMMIT PREPARED '{gid}'"))
        .await
        .ok();
    let (effects2, records2) = (env.effects("2pc").await, records_of(&env, "2pc").await);
    let report = format!(
        "first {r:?}: prepared {prepared}, effects {effects}, records {records}; \
         again {again:?} after {waited:?}; next {next:?} +{written}; \
         after COMMIT PREPARED: effects {effects2}, records {records2}"
    );
    assert!(
        matches!(
            r,
            Err(AppError::Idem(idem::Error::TransactionEnded {
                committed: true
            }))
        ) && (prepared, effects, records) == (1, 0, 0)
            && matches!(again, Err(AppError::Idem(idem::Error::Exhausted { .. })))
            && written == 6
            && (effects2, records2) == (1, 0),
        "{report}"
    );
}

/// Writes effect 1, runs `fail` and swallows its error, runs `then`, writes
/// effect 2, answers `Ok`.
#[idempotent(key = key, scope = none, fingerprint(key))]
#[retryable(max = 3, deadline_ms = 5000)]
async fn swallows(
    conn: &mut AsyncPgConnection,
    key: &str,
    fail: &str,
    then: &str,
) -> Result<i64, AppError> {
    insert_effect(conn, key, 1).await?;
    let _ = conn.batch_execute(fail).await;
    if !then.is_empty() {
        conn.batch_execute(then).await?;
    }
    insert_effect(conn, key, 2).await
}

/// Held: a deferred unique violation at `COMMIT` is an error, nothing
/// committed, the key free; a deferred 40001 at `COMMIT` is replayed and
/// commits once; `CALL` of a procedure that commits and a `DO` block that
/// commits are refused (invalid transaction termination), nothing commits.
// Found by a hostile pass: a failed statement swallowed, then `ROLLBACK
// AND CHAIN` (which clears the failure), then a write answered `Ok` with
// the first write gone, for 22012 and 40001 alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_body_hides_a_failure_or_fails_at_commit() {
    let env = env(2).await;
    env.client
        .batch_execute(
            "CREATE SEQUENCE once; CREATE TABLE deferred (x int UNIQUE DEFERRABLE INITIALLY DEFERRED);
             CREATE FUNCTION fail_once() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
               IF nextval('once') = 1 THEN RAISE EXCEPTION 'late' USING ERRCODE = 'serialization_failure'; END IF;
               RETURN NULL; END $$;
             CREATE TABLE late (x int);
             CREATE CONSTRAINT TRIGGER late AFTER INSERT ON late DEFERRABLE INITIALLY DEFERRED
               FOR EACH ROW EXECUTE FUNCTION fail_once();
             CREATE PROCEDURE commits() LANGUAGE plpgsql AS $$ BEGIN COMMIT; END $$;",
        )
        .await
        .unwrap();
    let serialization =
        "DO $$ BEGIN RAISE EXCEPTION 'x' USING ERRCODE = 'serialization_failure'; END $$";
    let cases = [
        ("hide-div", "SELECT 1/0", "ROLLBACK AND CHAIN"),
        ("hide-40001", serialization, "ROLLBACK AND CHAIN"),
        ("commit-23505", "INSERT INTO deferred VALUES (1), (1)", ""),
        ("commit-40001", "INSERT INTO late VALUES (1)", ""),
        ("call-commit", "SELECT 1", "CALL commits()"),
        ("do-commit", "SELECT 1", "DO $$ BEGIN COMMIT; END $$"),
    ];
    let pool = pool_of(&env.db, 1);
    let mut seen = Vec::new();
    for (key, fail, then) in cases {
        let r = swallows(&pool, key, fail, then).await;
        let (effects, records) = (env.effects(key).await, records_of(&env, key).await);
        let again = swallows(&pool, key, "SELECT 1", "").await;
        let (effects2, records2) = (env.effects(key).await, records_of(&env, key).await);
        seen.push(format!(
            "{key}: {r:?} -> effects {effects} records {records}; again {again:?} -> effects {effects2} records {records2}"
        ));
        // Ok only with its record; never twice.
        let fine = r.as_ref().map_or(true, |_| records == 1)
            && effects == 2 * records
            && records2 == 1
            && effects2 == 2;
        if !fine {
            seen.push("^^^ BAD".to_owned());
        }
    }
    let (next, written) = next_callers(&env, &pool, "hide-next").await;
    seen.push(format!("next {next:?} +{written}"));
    assert!(
        !seen.iter().any(|s| s == "^^^ BAD") && written == 6,
        "{}",
        seen.join("\n")
    );
}
