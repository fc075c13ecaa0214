//! Hostile tests of local mode's riding statements in the extended protocol:
//! bodies that pipeline their own queries, leave savepoints or strays,
//! swap or shadow what idem's statements name, responses that span many
//! socket writes and reads, takeovers of expired records under row locks,
//! and backends killed mid-body. Effects are counted in the database.

use super::attack::{body_runs, healthy};
use super::*;
use diesel_async::{AnsiTransactionManager, TransactionManager};

diesel::table! {
    effects (id) {
        id -> Int8,
        tag -> Text,
        n -> Int8,
    }
}

/// `SELECT count(*)` of the records of `key`.
pub(super) async fn records_of(env: &Env, key: &str) -> i64 {
    env.client
        .query_one("SELECT count(*) FROM idem_requests WHERE key = $1", &[&key])
        .await
        .unwrap()
        .get(0)
}

fn transaction_pooling(env: &Env) -> bool {
    env.db.via().is_transaction_pooling()
}

// ---------------------------------------------------------------------------
// Bodies that pipeline their own extended-protocol queries
// ---------------------------------------------------------------------------

/// Four statements pipelined on `&AsyncPgConnection` and joined: three
/// inserts (the cached DSL statement) and one that fails when `fail`; with
/// `swallow`, the join's error is dropped and the body answers `Ok`.
#[idempotent(key = key, scope = none, fingerprint(fail, swallow))]
#[retryable(max = 3, deadline_ms = 10000)]
async fn pipelined(
    conn: &mut AsyncPgConnection,
    key: &str,
    fail: bool,
    swallow: bool,
) -> Result<i64, AppError> {
    let shared: &AsyncPgConnection = conn;
    let (mut a, mut b, mut c, mut d) = (shared, shared, shared, shared);
    let ins = |n: i64| {
        diesel::insert_into(effects::table).values((effects::tag.eq("pipe"), effects::n.eq(n)))
    };
    let check = diesel::sql_query(if fail {
        "SELECT pg_sleep(0.05), 1 / 0"
    } else {
        "SELECT pg_sleep(0.05)"
    });
    let joined = tokio::try_join!(
        ins(1).execute(&mut a),
        check.execute(&mut b),
        ins(2).execute(&mut c),
        ins(3).execute(&mut d),
    );
    match joined {
        Ok((x, _, y, z)) => Ok((x + y + z) as i64),
        Err(_) if swallow => Ok(-1),
        Err(e) => Err(e.into()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_ext_pipelined_queries_in_the_body() {
    let env = env(2).await;
    let pool = pool_of(&env.db, 1);
    for _ in 0..2 {
        // Cold, then warm (diesel's statement cache holds the insert).
        let key = format!("pipe-{}", env.effects("pipe").await);
        let r = pipelined(&pool, &key, false, false).await;
        assert!(matches!(&r, Ok(v) if !v.replayed && v.value == 3), "{r:?}");
        let again = pipelined(&pool, &key, false, false).await;
        assert!(
            matches!(&again, Ok(v) if v.replayed && v.value == 3),
            "{again:?}"
        );
        assert_eq!(records_of(&env, &key).await, 1);
    }
    assert_eq!(env.effects("pipe").await, 6);
    // One fails while the others are in flight: nothing commits.
    let r = pipelined(&pool, "pipe-fail", true, false).await;
    assert!(r.is_err(), "{r:?}");
    // The body swallows the failure and answers Ok: never Ok without COMMIT.
    let r = pipelined(&pool, "pipe-swallow", true, true).await;
    assert!(r.is_err(), "a swallowed failure must not answer Ok: {r:?}");
    assert_eq!(env.effects("pipe").await, 6, "{r:?}");
    assert_eq!(records_of(&env, "pipe-fail").await, 0);
    assert_eq!(records_of(&env, "pipe-swallow").await, 0);
    healthy(&env, &pool, "pipe-after", 2).await;
}

fn row(
    tag: &str,
    n: i64,
) -> impl diesel::query_builder::QueryFragment<diesel::pg::Pg> + diesel::query_builder::QueryId + '_
{
    diesel::insert_into(effects::table).values((effects::tag.eq(tag), effects::n.eq(n)))
}

/// Writes one effect (the DSL insert, so diesel caches its statement),
/// then leaves `n` more of the same polled once and dropped: their `Bind`
/// and `Execute` are on their way when the body returns.
#[idempotent(key = key, scope = none, fingerprint(n))]
#[retryable(max = 1, deadline_ms = 10000)]
async fn pipelined_strays(
    conn: &mut AsyncPgConnection,
    key: &str,
    n: i64,
) -> Result<i64, AppError> {
    row("strays", 1).execute(conn).await?;
    let shared: &AsyncPgConnection = conn;
    for i in 0..n {
        let mut c = shared;
        let fut = row("strays-extra", i).execute(&mut c);
        let _ = futures_util::FutureExt::now_or_never(fut);
    }
    Ok(n)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_ext_dropped_pipelined_futures_at_commit() {
    let env = env(2).await;
    let pool = pool_of(&env.db, 1);
    let (mut recorded, mut extra) = (0, 0);
    for n in 1..=6 {
        let key = format!("strays-{n}");
        let r = pipelined_strays(&pool, &key, n).await;
        let committed = records_of(&env, &key).await;
        recorded += committed;
        let now = env.effects("strays-extra").await;
        // A stray that reached the server belongs to the body: it commits
        // with the record or not at all (one never sent never runs).
        assert_eq!(env.effects("strays").await, recorded, "{r:?}");
        assert!(now - extra <= committed * n, "{r:?}: {extra} -> {now}");
        extra = now;
        if r.is_ok() {
            assert_eq!(committed, 1, "{r:?}");
        }
    }
    // Behind a transaction pooler no statement is cached, so none is sent.
    assert!(extra > 0 || transaction_pooling(&env), "no stray ran");
    healthy(&env, &pool, "strays-after", 2).await;
}

// ---------------------------------------------------------------------------
// Savepoints
// ---------------------------------------------------------------------------

/// Nested `conn.transaction(..)`s: the innermost fails and is caught by its
/// parent, which then writes again; `leave_open`: the body opens a
/// savepoint through diesel-async's transaction manager and returns with it
/// open, so the manager's depth is 2 at idem's COMMIT.
#[idempotent(key = key, scope = none, fingerprint(leave_open))]
#[retryable(max = 1, deadline_ms = 10000)]
async fn nested(
    conn: &mut AsyncPgConnection,
    key: &str,
    leave_open: bool,
) -> Result<i64, AppError> {
    insert_effect(conn, "nest-outer", 1).await?;
    conn.transaction::<_, AppError, _>(async |c| {
        insert_effect(c, "nest-mid", 1).await?;
        let inner: Result<(), AppError> = c
            .transaction::<_, AppError, _>(async |c2| {
                insert_effect(c2, "nest-inner", 1).await?;
                diesel::sql_query("SELECT 1 / 0").execute(c2).await?;
                Ok(())
            })
            .await;
        assert!(inner.is_err());
        insert_effect(c, "nest-mid", 1).await?;
        Ok(())
    })
    .await?;
    if leave_open {
        AnsiTransactionManager::begin_transaction(conn).await?;
        insert_effect(conn, "nest-open", 1).await?;
    }
    Ok(1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_ext_nested_savepoints_and_one_left_open() {
    let env = env(2).await;
    let pool = pool_of(&env.db, 1);
    let r = nested(&pool, "nest", false).await;
    assert!(matches!(&r, Ok(v) if !v.replayed), "{r:?}");
    let again = nested(&pool, "nest", false).await;
    assert!(matches!(&again, Ok(v) if v.replayed), "{again:?}");
    assert_eq!(env.effects("nest-outer").await, 1);
    assert_eq!(env.effects("nest-mid").await, 2);
    assert_eq!(env.effects("nest-inner").await, 0);
    // A savepoint left open: COMMIT would be a RELEASE, which the wire
    // must not let out in place of idem's record and COMMIT. Nothing
    // commits, and the call says why (not CommitUnknown: nothing was sent).
    for _ in 0..2 {
        let r = nested(&pool, "nest-open", true).await;
        assert!(matches_idem(&r, "SavepointOpen"), "{r:?}");
        assert_eq!(records_of(&env, "nest-open").await, 0, "{r:?}");
        assert_eq!(env.effects("nest-open").await, 0, "{r:?}");
        assert_eq!(env.effects("nest-outer").await, 1, "{r:?}");
    }
    healthy(&env, &pool, "nest-after", 2).await;
}

// ---------------------------------------------------------------------------
// What idem's statements name: swapped or shadowed by a body
// ---------------------------------------------------------------------------

/// A body swaps idem's prepared completing statement for its own, under the
/// same name and parameter count, where the wire cannot see it (inside a
/// DO block). The `COMMIT` it rides with has run by the time its answer
/// says it wrote nothing: the call answers `RecordNotWritten` (the effect
/// committed without a record, as the error says: a repeat runs again), and
/// the connection is closed, so no later call meets the swapped statement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_ext_body_swaps_idem_statement_unseen() {
    let env = env(2).await;
    if transaction_pooling(&env) {
        return; // nothing of idem's is prepared behind a transaction pooler
    }
    let pool = pool_of(&env.db, 1);
    healthy(&env, &pool, "swap-warm", 1).await;
    let swap = "DO $$ BEGIN EXECUTE 'DEALLOCATE idem_complete_v1'; \
                EXECUTE 'PREPARE idem_complete_v1(text, text, text, text, text, text, text, text) \
                AS SELECT 1'; END $$";
    let r = body_runs(&pool, "swap", "swap", swap).await;
    assert!(matches_idem(&r, "RecordNotWritten"), "{r:?}");
    let first = (env.effects("swap").await, records_of(&env, "swap").await);
    assert_eq!(first, (1, 0), "{r:?}");
    // The connection went: a later key on the pool records as it should.
    let later = body_runs(&pool, "swap-later", "swap-later", "").await;
    assert!(matches!(&later, Ok(v) if !v.replayed), "{later:?}");
    let again = body_runs(&pool, "swap-later", "swap-later", "").await;
    assert!(matches!(&again, Ok(v) if v.replayed), "{again:?}");
    assert_eq!(env.effects("swap-later").await, 1);
    assert_eq!(records_of(&env, "swap-later").await, 1);
}

/// A body swaps, unseen, the prepared `BEGIN` of the next call for a
/// `SELECT`: what runs under its name opens no transaction, and the lock,
/// the read and the body would each commit on their own, the effect
/// without its record. The connection goes before the body runs, and the
/// call runs on another, once, with its record (before the check: the
/// effect committed, no record, `TransactionEnded`, and every later call
/// on that connection the same).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_ext_body_swaps_the_prepared_begin_unseen() {
    let env = env(2).await;
    if transaction_pooling(&env) {
        return; // nothing of idem's is prepared behind a transaction pooler
    }
    let pool = pool_of(&env.db, 1);
    healthy(&env, &pool, "begin-warm", 1).await;
    let swap = "DO $$ BEGIN EXECUTE 'DEALLOCATE idem_begin_read_committed_v1'; \
                EXECUTE 'PREPARE idem_begin_read_committed_v1 AS SELECT 1'; END $$";
    let r = body_runs(&pool, "begin-swap", "begin-swap", swap).await;
    assert!(matches!(&r, Ok(v) if !v.replayed), "{r:?}");
    // Each call's effect once, and its repeat a replay (its record).
    healthy(&env, &pool, "begin-next", 2).await;
}

/// The same swap, visible: `DEALLOCATE ALL` then `PREPARE` of the names of
/// the next generation, which idem must parse again (and meet taken).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_ext_body_takes_the_next_generation_names() {
    let env = env(2).await;
    if transaction_pooling(&env) {
        return;
    }
    let pool = pool_of(&env.db, 1);
    healthy(&env, &pool, "gen-warm", 1).await;
    let take = "DEALLOCATE ALL; \
        PREPARE idem_complete_v1_g1(text, text, text, text, text, text, text, text) AS SELECT 1; \
        PREPARE idem_lock_v1_g1(text) AS SELECT 1; \
        PREPARE idem_read_v1_g1(text, text) AS SELECT 1 WHERE false";
    let r = body_runs(&pool, "gen", "gen", take).await;
    assert_eq!(
        env.effects("gen").await,
        records_of(&env, "gen").await,
        "{r:?}"
    );
    let again = body_runs(&pool, "gen", "gen", take).await;
    assert_eq!(
        env.effects("gen").await,
        records_of(&env, "gen").await,
        "{again:?}"
    );
    assert!(env.effects("gen").await <= 1, "{r:?} / {again:?}");
    healthy(&env, &pool, "gen-after", 3).await;
}

/// A body shadows `idem_requests` with a temporary table of the same shape
/// that goes at its COMMIT: the record would vanish with it while the
/// effect stays. The record's insert refuses a temporary table, so nothing
/// commits; without the shadow the key then runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_ext_temp_table_shadows_the_record() {
    let env = env(2).await;
    let pool = pool_of(&env.db, 1);
    healthy(&env, &pool, "temp-warm", 1).await;
    let shadow =
        "CREATE TEMP TABLE idem_requests (LIKE public.idem_requests INCLUDING ALL) ON COMMIT DROP";
    for _ in 0..2 {
        let r = body_runs(&pool, "temp", "temp", shadow).await;
        let refused = format!("{r:?}");
        assert!(
            refused.contains("idem_requests is a temporary table"),
            "{refused}"
        );
        assert_eq!(env.effects("temp").await, 0, "{refused}");
    }
    let r = body_runs(&pool, "temp", "temp", "").await;
    assert!(matches!(&r, Ok(v) if !v.replayed), "{r:?}");
    let again = body_runs(&pool, "temp", "temp", "").await;
    assert!(matches!(&again, Ok(v) if v.replayed), "{again:?}");
    assert_eq!(env.effects("temp").await, 1);
    assert_eq!(records_of(&env, "temp").await, 1);
}

// ---------------------------------------------------------------------------
// Values: NUL, odd unicode, a response of megabytes
// ---------------------------------------------------------------------------

#[idempotent(key = key, scope = scope, fingerprint(response), max_response_bytes = 4194304)]
#[retryable(max = 4, deadline_ms = 30000)]
async fn echo_big(
    conn: &mut AsyncPgConnection,
    scope: &str,
    key: &str,
    response: &serde_json::Value,
) -> Result<serde_json::Value, AppError> {
    insert_effect(conn, "big", 1).await?;
    Ok(response.clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_ext_nul_and_odd_unicode_values() {
    let env = env(2).await;
    let pool = pool_of(&env.db, 1);
    // A NUL in the response: refused before anything commits.
    let r = echo_big(
        &pool,
        "s",
        "nul-resp",
        &serde_json::json!({ "a\u{0}": "b\u{0}" }),
    )
    .await;
    assert!(r.is_err(), "{r:?}");
    // A NUL in the key: refused (control character).
    let r = echo_big(&pool, "s", "nul\u{0}key", &serde_json::json!(1)).await;
    assert!(r.is_err(), "{r:?}");
    assert_eq!((env.effects("big").await, env.records().await), (0, 0));
    // A NUL in the scope (hashed; its label is JSON text), noncharacters,
    // the last code point, a BOM, combining marks.
    let odd = [
        ("nul\u{0}scope", "k-nul-scope"),
        ("\u{FFFF}\u{FFFE}", "\u{FDD0}\u{10FFFF}"),
        ("\u{FEFF}", "e\u{301}\u{301}\u{301}"),
        ("😀", "\u{7F}"),
    ];
    for (i, (scope, key)) in odd.iter().enumerate() {
        let value = serde_json::json!({ "scope": scope, "key": key, "nul-escaped": "\\u0000" });
        let r = echo_big(&pool, scope, key, &value).await;
        if r.is_err() {
            // Refused as invalid: nothing written.
            assert_eq!(
                env.effects("big").await as usize,
                i.min(env.records().await as usize)
            );
            continue;
        }
        let again = echo_big(&pool, scope, key, &value).await;
        assert!(
            matches!(&again, Ok(v) if v.replayed && v.value == value),
            "{key:?}: {again:?}"
        );
    }
    assert_eq!(env.effects("big").await, env.records().await);
    healthy(&env, &pool, "odd-after", 1).await;
}

/// A response of about 1.5 MB (quotes, backslashes, multibyte and control
/// characters): the COMMIT unit goes out in many socket writes and the
/// replay's row comes back in many reads. Four duplicates race on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn attack_ext_megabyte_response_written_and_replayed() {
    let env = env(6).await;
    let chunk = "\\\"'é😀\u{1}\n$1 ; COMMIT";
    let big = serde_json::json!({
        "s": chunk.repeat(1_500_000 / chunk.len()),
        "arr": (0..2000).collect::<Vec<i64>>(),
    });
    assert!(big.to_string().len() > 1_500_000 && big.to_string().len() < 4194304);
    let pool = pool_of(&env.db, 4);
    let tasks: Vec<_> = (0..4)
        .map(|_| {
            let (pool, big) = (pool.clone(), big.clone());
            tokio::spawn(async move { echo_big(&pool, "mb", "mb", &big).await })
        })
        .collect();
    let mut fresh = 0;
    for t in tasks {
        let r = t.await.unwrap();
        let v = r.unwrap_or_else(|e| panic!("{e:?}"));
        assert!(v.value == big, "a replay answered another value");
        fresh += usize::from(!v.replayed);
    }
    assert_eq!(fresh, 1);
    assert_eq!(env.effects("big").await, 1);
    let stored: serde_json::Value = env
        .client
        .query_one("SELECT response FROM idem_requests WHERE key = 'mb'", &[])
        .await
        .unwrap()
        .get(0);
    assert!(stored == big, "the stored response differs");
    // Replays on the warm connections, one after another.
    for _ in 0..3 {
        let r = echo_big(&pool, "mb", "mb", &big).await.unwrap();
        assert!(r.replayed && r.value == big);
    }
    assert_eq!(env.effects("big").await, 1);
    healthy(&env, &pool, "mb-after", 2).await;
}

// ---------------------------------------------------------------------------
// Takeover of an expired record, under row locks
// ---------------------------------------------------------------------------

#[idempotent(key = key, scope = none, fingerprint(tag), ttl_s = 1)]
#[retryable(max = 6, deadline_ms = 20000)]
async fn short_lived(conn: &mut AsyncPgConnection, key: &str, tag: &str) -> Result<i64, AppError> {
    insert_effect(conn, tag, 1).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn attack_ext_takeover_under_a_held_record_row() {
    let env = env(6).await;
    let pool = pool_of(&env.db, 4);
    assert!(!short_lived(&pool, "to", "to").await.unwrap().replayed);
    tokio::time::sleep(Duration::from_millis(1300)).await;
    // Hold the expired record's row: the takeovers wait on it at COMMIT.
    let mut side = side_connection(env.db.url()).await;
    let holder = side.transaction().await.unwrap();
    holder
        .batch_execute("SELECT 1 FROM idem_requests WHERE key = 'to' FOR UPDATE")
        .await
        .unwrap();
    let tasks: Vec<_> = (0..3)
        .map(|_| {
            let pool = pool.clone();
            tokio::spawn(async move { short_lived(&pool, "to", "to").await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(400)).await;
    holder.commit().await.unwrap();
    let mut fresh = 0;
    for t in tasks {
        let r = t.await.unwrap();
        fresh += usize::from(matches!(&r, Ok(v) if !v.replayed));
        assert!(r.is_ok() || matches_idem(&r, "InProgress"), "{r:?}");
    }
    assert_eq!(fresh, 1);
    assert_eq!(env.effects("to").await, 2, "one run before, one takeover");
    assert_eq!(env.state("to").await.as_deref(), Some("completed"));
    // Expired again; the holder revives the record while a takeover waits
    // on its row: the takeover must not overwrite a live record.
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let holder = side.transaction().await.unwrap();
    holder
        .batch_execute(
            "UPDATE idem_requests SET expires_at = now() + interval '1 hour' WHERE key = 'to'",
        )
        .await
        .unwrap();
    let call = {
        let pool = pool.clone();
        tokio::spawn(async move { short_lived(&pool, "to", "to").await })
    };
    tokio::time::sleep(Duration::from_millis(400)).await;
    holder.commit().await.unwrap();
    let r = call.await.unwrap();
    let effects = env.effects("to").await;
    assert!(
        effects == 2 || (effects == 3 && matches!(&r, Ok(v) if !v.replayed)),
        "{r:?}, effects {effects}"
    );
    assert_eq!(records_of(&env, "to").await, 1);
    healthy(&env, &pool, "to-after", 1).await;
}

// ---------------------------------------------------------------------------
// Backends killed, sessions left with a foreign encoding
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_ext_backend_terminated_mid_body() {
    let env = env(2).await;
    let pool = pool_of(&env.db, 1);
    healthy(&env, &pool, "kill-warm", 1).await;
    let call = {
        let pool = pool.clone();
        tokio::spawn(async move { body_runs(&pool, "kill", "kill", "SELECT pg_sleep(0.6)").await })
    };
    // Killed as soon as it sleeps (polled, not after a fixed nap, which a
    // loaded machine can outrun or fall behind); only the first attempt.
    let started = Instant::now();
    let killed = loop {
        let killed: i64 = env
            .scalar(
                "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE datname = current_database() AND query LIKE '%pg_sleep(0.6)%' AND pid <> pg_backend_pid() \
                 AND query NOT LIKE '%pg_stat_activity%') t",
            )
            .await;
        if killed >= 1 || started.elapsed() > Duration::from_secs(10) {
            break killed;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let r = call.await.unwrap();
    assert!(killed >= 1, "{r:?}");
    let effects = env.effects("kill").await;
    assert_eq!(effects, records_of(&env, "kill").await, "{r:?}");
    assert!(
        matches!(&r, Ok(v) if !v.replayed),
        "replayed on a fresh connection: {r:?}"
    );
    assert_eq!(effects, 1);
    let again = body_runs(&pool, "kill", "kill", "SELECT pg_sleep(0.6)").await;
    assert!(matches!(&again, Ok(v) if v.replayed), "{again:?}");
    healthy(&env, &pool, "kill-after", 1).await;
}

/// A plain transaction (no key) that commits a session-level
/// `client_encoding`: the pooled connection then cannot carry idem's
/// statements; idempotent calls must still work (another connection) and
/// never write without their record.
#[retryable(max = 1, deadline_ms = 5000)]
async fn plain(conn: &mut AsyncPgConnection, sql: &str) -> Result<(), AppError> {
    conn.batch_execute(sql).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_ext_session_left_in_a_foreign_encoding() {
    let env = env(2).await;
    if transaction_pooling(&env) {
        return; // a session's settings are not the client's there
    }
    let pool = pool_of(&env.db, 1);
    healthy(&env, &pool, "enc-warm", 1).await;
    plain(&pool, "SET client_encoding = 'LATIN1'")
        .await
        .unwrap();
    let mut results = Vec::new();
    for i in 0..3 {
        let key = format!("latin-{i}");
        results.push(body_runs(&pool, &key, "enc", "").await.map(|v| v.replayed));
    }
    let records = env
        .scalar("SELECT count(*) FROM idem_requests WHERE key LIKE 'latin-%'")
        .await;
    assert_eq!(env.effects("enc").await, records, "{results:?}");
    assert!(
        results.iter().all(|r| matches!(r, Ok(false))),
        "a connection left in LATIN1 keeps failing idempotent calls: {results:?}"
    );
}
