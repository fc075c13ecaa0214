//! Hostile tests of local mode's statements riding on `BEGIN` and `COMMIT`
//! as SQL text (`PREPARE`d once per session, values as literals). Every
//! effect is counted in the database through the side connection.

use super::*;

/// Writes one effect tagged `tag`, after running `sql` (if not empty) as a
/// simple query of the body; answers `response`.
#[idempotent(key = key, scope = none, fingerprint(tag, sql))]
#[retryable(max = 3, deadline_ms = 5000)]
pub(super) async fn body_runs(
    conn: &mut AsyncPgConnection,
    key: &str,
    tag: &str,
    sql: &str,
) -> Result<i64, AppError> {
    if !sql.is_empty() {
        conn.batch_execute(sql).await?;
    }
    insert_effect(conn, tag, 1).await
}

/// The same, without `#[retryable]`: one attempt.
#[idempotent(key = key, scope = none, fingerprint(tag, sql))]
pub(super) async fn body_runs_once(
    conn: &mut AsyncPgConnection,
    key: &str,
    tag: &str,
    sql: &str,
) -> Result<i64, AppError> {
    if !sql.is_empty() {
        conn.batch_execute(sql).await?;
    }
    insert_effect(conn, tag, 1).await
}

/// A plain transaction (no key) that runs `sql` on a pooled connection.
#[retryable(max = 1, deadline_ms = 5000)]
async fn plain_sql(conn: &mut AsyncPgConnection, sql: &str) -> Result<(), AppError> {
    conn.batch_execute(sql).await?;
    Ok(())
}

static HEALTHY: AtomicU32 = AtomicU32::new(0);

/// Three idempotent calls with fresh keys on `pool`: each must succeed and
/// write its effect once (reported all together, to show whether a bad
/// connection stays bad).
async fn three_fresh_calls(env: &Env, pool: &Pool, tag: &str) {
    let before = env.effects(tag).await;
    let mut results = Vec::new();
    for i in 0..3 {
        let key = format!("{tag}-fresh-{}-{i}", HEALTHY.fetch_add(1, Ordering::SeqCst));
        results.push(body_runs(pool, &key, tag, "").await.map(|v| v.replayed));
    }
    let after = env.effects(tag).await;
    assert!(
        results.iter().all(|r| matches!(r, Ok(false))) && after == before + 3,
        "calls after the attack: {results:?}; effects {before} -> {after}"
    );
}

/// Calls `body_runs` with fresh keys on `pool` and asserts they all work
/// and each wrote its effect once: the connection is healthy.
pub(super) async fn healthy(env: &Env, pool: &Pool, tag: &str, n: usize) {
    let before = env.effects(tag).await;
    for i in 0..n {
        let key = format!(
            "{tag}-healthy-{}-{i}",
            HEALTHY.fetch_add(1, Ordering::SeqCst)
        );
        let r = body_runs(pool, &key, tag, "").await;
        assert!(
            matches!(&r, Ok(v) if !v.replayed),
            "call {i} after the attack: {r:?}"
        );
        let again = body_runs(pool, &key, tag, "").await;
        assert!(matches!(&again, Ok(v) if v.replayed), "{again:?}");
    }
    assert_eq!(env.effects(tag).await, before + n as i64);
}

// ---------------------------------------------------------------------------
// Prepared statements tracked on the wire
// ---------------------------------------------------------------------------

/// A body that prepares and deallocates a statement of its OWN: the wire sees
/// a `DEALLOCATE` tag and forgets all of idem's statements, which are still
/// prepared on the session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_body_deallocates_its_own_statement() {
    let env = env(2).await;
    let pool = pool_of(&env.db, 1);
    // Warm: idem's statements are prepared on the one connection.
    healthy(&env, &pool, "dealloc-own", 1).await;
    let r = body_runs(
        &pool,
        "own",
        "dealloc-own",
        "PREPARE app_stmt AS SELECT 1; DEALLOCATE app_stmt",
    )
    .await;
    assert!(matches!(&r, Ok(v) if !v.replayed), "{r:?}");
    assert_eq!(env.effects("dealloc-own").await, 2, "its effect, once");
    // And the connection is still usable by idempotent calls.
    healthy(&env, &pool, "dealloc-own", 3).await;
}

/// `DEALLOCATE` run where the wire cannot see its tag (plpgsql `EXECUTE`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_body_deallocates_inside_a_do_block() {
    let env = env(2).await;
    let pool = pool_of(&env.db, 1);
    healthy(&env, &pool, "dealloc-do", 1).await;
    let r = body_runs(
        &pool,
        "do",
        "dealloc-do",
        "DO $$ BEGIN EXECUTE 'DEALLOCATE ALL'; END $$",
    )
    .await;
    let effects = env.effects("dealloc-do").await;
    // Whatever the answer, never an effect without its record.
    match &r {
        Ok(v) => {
            assert!(!v.replayed);
            assert_eq!(effects, 2);
            assert_eq!(env.state("do").await.as_deref(), Some("completed"));
        }
        Err(_) => {
            assert_eq!(effects, 1, "{r:?}");
            assert_eq!(env.state("do").await, None);
        }
    }
    // The connection must not be left unusable for idempotent calls.
    three_fresh_calls(&env, &pool, "dealloc-do").await;
}

/// The application, on a pooled connection idem has not used yet, prepares a
/// statement under one of idem's names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_application_prepares_a_name_idem_uses() {
    let env = env(2).await;
    let pool = pool_of(&env.db, 1);
    plain_sql(&pool, "PREPARE idem_complete_v1 AS SELECT 1")
        .await
        .expect("the application's own statement");
    let r = body_runs(&pool, "named", "named", "").await;
    let effects = env.effects("named").await;
    // Never the effect without its record.
    assert_eq!(
        effects,
        i64::from(env.state("named").await.is_some()),
        "{r:?}"
    );
    // After a collision the pool must recover (a fresh connection, or the
    // statement prepared under another name): idempotent calls work again.
    three_fresh_calls(&env, &pool, "named").await;
}

/// A body drops one of idem's statements by name (tag `DEALLOCATE`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_body_deallocates_one_idem_statement_by_name() {
    let env = env(2).await;
    let pool = pool_of(&env.db, 1);
    if env.db.via().is_transaction_pooling() {
        // Behind a transaction pooler nothing of idem's is prepared to drop.
        return;
    }
    healthy(&env, &pool, "dealloc-one", 1).await;
    let r = body_runs(&pool, "one", "dealloc-one", "DEALLOCATE idem_read_v1").await;
    assert!(matches!(&r, Ok(v) if !v.replayed), "{r:?}");
    assert_eq!(env.effects("dealloc-one").await, 2);
    healthy(&env, &pool, "dealloc-one", 2).await;
}

/// `DEALLOCATE ALL` and `DISCARD ALL` outside any idempotent call, on the
/// pooled connection: seen, statements prepared again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_deallocate_all_and_discard_all_between_calls() {
    let env = env(2).await;
    let pool = pool_of(&env.db, 1);
    healthy(&env, &pool, "between", 1).await;
    plain_sql(&pool, "DEALLOCATE ALL").await.unwrap();
    healthy(&env, &pool, "between", 1).await;
    // DISCARD ALL cannot run in a transaction: refused, nothing changes.
    assert!(plain_sql(&pool, "DISCARD ALL").await.is_err());
    healthy(&env, &pool, "between", 1).await;
    // A body's DEALLOCATE ALL (documented).
    let r = body_runs(&pool, "dall", "between", "DEALLOCATE ALL").await;
    assert!(matches!(&r, Ok(v) if !v.replayed), "{r:?}");
    healthy(&env, &pool, "between", 1).await;
}

// ---------------------------------------------------------------------------
// Session settings changed by a body
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_session_settings_in_the_body() {
    let env = env(2).await;
    let pool = pool_of(&env.db, 1);
    let settings = [
        "SET standard_conforming_strings = off",
        "SET LOCAL standard_conforming_strings = off",
        "SET backslash_quote = off",
        "SET bytea_output = escape",
        "SET plan_cache_mode = force_generic_plan",
        "SET plan_cache_mode = force_custom_plan",
        "SET IntervalStyle = sql_standard",
        "SET DateStyle = 'SQL, DMY'",
        "SET TimeZone = 'Pacific/Chatham'",
        "SET escape_string_warning = off",
        "SET extra_float_digits = -15",
        "SET search_path = public, pg_catalog",
    ];
    for (i, setting) in settings.iter().enumerate() {
        // Keys and scope with quotes and backslashes, so literals matter.
        let key = format!(r"k{i}\'; \\ '' $1 $$ {setting}");
        let r = body_runs(&pool, &key, "settings", setting).await;
        assert!(matches!(&r, Ok(v) if !v.replayed), "{setting}: {r:?}");
        let again = body_runs(&pool, &key, "settings", setting).await;
        assert!(
            matches!(&again, Ok(v) if v.replayed),
            "{setting}: {again:?}"
        );
        assert_eq!(env.effects("settings").await, i as i64 + 1, "{setting}");
        assert_eq!(env.state(&key).await.as_deref(), Some("completed"), "{key}");
    }
    healthy(&env, &pool, "settings", 2).await;
}

/// `SET LOCAL search_path` to a schema without `idem_requests`: the record
/// cannot be written, so nothing may commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_search_path_without_idem_requests() {
    let env = env(2).await;
    env.client
        .batch_execute("CREATE SCHEMA tenant_a; CREATE TABLE tenant_a.effects (LIKE public.effects INCLUDING ALL)")
        .await
        .unwrap();
    let pool = pool_of(&env.db, 1);
    let r = body_runs(&pool, "sp", "sp", "SET LOCAL search_path = tenant_a").await;
    let public = env.effects("sp").await;
    let tenant = env.scalar("SELECT count(*) FROM tenant_a.effects").await;
    let records = env.records().await;
    assert!(r.is_err(), "{r:?}");
    assert_eq!((public, tenant, records), (0, 0, 0), "{r:?}");
    healthy(&env, &pool, "sp", 2).await;
}

// ---------------------------------------------------------------------------
// Bodies that play with the transaction
// ---------------------------------------------------------------------------

/// A body that uses savepoints: an inner failure rolled back to its savepoint.
#[idempotent(key = key, scope = none, fingerprint(fail_inner))]
#[retryable(max = 3, deadline_ms = 5000)]
async fn with_savepoints(
    conn: &mut AsyncPgConnection,
    key: &str,
    fail_inner: bool,
) -> Result<i64, AppError> {
    let outer = insert_effect(conn, "savepoint", 1).await?;
    let inner: Result<i64, AppError> = conn
        .transaction::<_, AppError, _>(async |c| {
            insert_effect(c, "savepoint-inner", 1).await?;
            if fail_inner {
                diesel::sql_query("SELECT 1 / 0").execute(c).await?;
            }
            Ok(7)
        })
        .await;
    assert_eq!(inner.is_err(), fail_inner);
    Ok(outer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_savepoints_in_the_body() {
    let env = env(2).await;
    let pool = pool_of(&env.db, 1);
    for (key, fail) in [("sp-ok", false), ("sp-fail", true)] {
        let r = with_savepoints(&pool, key, fail).await;
        assert!(matches!(&r, Ok(v) if !v.replayed), "{key}: {r:?}");
        let again = with_savepoints(&pool, key, fail).await;
        assert!(matches!(&again, Ok(v) if v.replayed), "{key}: {again:?}");
    }
    assert_eq!(env.effects("savepoint").await, 2);
    assert_eq!(
        env.effects("savepoint-inner").await,
        1,
        "the failed one rolled back"
    );
    assert_eq!(env.records().await, 2);
    healthy(&env, &pool, "savepoint-after", 2).await;
}

/// Bodies that end the transaction themselves, or leave it failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_body_ends_or_fails_the_transaction() {
    let env = env(2).await;
    let pool = pool_of(&env.db, 1);
    // ROLLBACK then BEGIN: the advisory lock is gone; what it writes after
    // must not commit.
    let r = body_runs(&pool, "rb", "ends", "ROLLBACK; BEGIN").await;
    assert!(r.is_err(), "{r:?}");
    assert_eq!(env.effects("ends").await, 0, "{r:?}");
    assert_eq!(env.records().await, 0);
    // A failed statement whose error the body returns.
    let r = body_runs(&pool, "fail", "ends", "SELECT 1/0").await;
    assert!(r.is_err(), "{r:?}");
    // A failed statement inside a multi-statement batch with a savepoint.
    let r = body_runs(&pool, "fail2", "ends", "SAVEPOINT x; SELECT 1/0").await;
    assert!(r.is_err(), "{r:?}");
    assert_eq!(env.effects("ends").await, 0);
    assert_eq!(env.records().await, 0);
    // PREPARE TRANSACTION needs max_prepared_transactions; refused or not,
    // nothing may stay behind.
    let r = body_runs(&pool, "2pc", "ends", "PREPARE TRANSACTION 'idem_attack'").await;
    assert!(r.is_err(), "{r:?}");
    assert_eq!(env.effects("ends").await, 0);
    healthy(&env, &pool, "ends-after", 2).await;
}

/// Writes an effect, then leaves a statement future polled once and dropped.
#[idempotent(key = key, scope = none, fingerprint(stray))]
#[retryable(max = 1, deadline_ms = 5000)]
async fn leaves_a_stray(
    conn: &mut AsyncPgConnection,
    key: &str,
    stray: &str,
) -> Result<i64, AppError> {
    let id = insert_effect(conn, "stray", 1).await?;
    {
        let fut = conn.batch_execute(stray);
        let _ = tokio::time::timeout(Duration::from_millis(5), fut).await;
    }
    Ok(id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_stray_statement_futures() {
    let env = env(2).await;
    let pool = pool_of(&env.db, 1);
    // A stray that fails after the body returned: nothing commits.
    let r = leaves_a_stray(&pool, "stray-fail", "SELECT pg_sleep(0.2); SELECT 1/0").await;
    assert!(r.is_err(), "{r:?}");
    assert_eq!(env.effects("stray").await, 0);
    assert_eq!(env.records().await, 0);
    // A stray that succeeds: it belongs to the body.
    let r = leaves_a_stray(&pool, "stray-ok", "SELECT pg_sleep(0.2)").await;
    let effects = env.effects("stray").await;
    let recorded = env.state("stray-ok").await.is_some();
    assert_eq!(effects, i64::from(recorded), "{r:?}");
    if r.is_ok() {
        assert!(recorded);
    }
    healthy(&env, &pool, "stray-after", 2).await;
}

// ---------------------------------------------------------------------------
// Values written in as literals
// ---------------------------------------------------------------------------

#[idempotent(key = key, scope = scope, fingerprint(response))]
async fn echo_value(
    conn: &mut AsyncPgConnection,
    scope: &str,
    key: &str,
    response: &serde_json::Value,
) -> Result<serde_json::Value, AppError> {
    insert_effect(conn, "echo", 1).await?;
    Ok(response.clone())
}

fn to_255_bytes(seed: &str) -> String {
    let mut s = String::new();
    while s.len() + seed.len() <= 255 {
        s.push_str(seed);
    }
    while s.len() < 255 {
        s.push('\'');
    }
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_hostile_keys_scopes_and_responses() {
    let env = env(2).await;
    let pool = pool_of(&env.db, 1);
    let huge_backslashes = "\\\"'".repeat(60 * 1024 / 3 / 2 - 200);
    let keys: Vec<String> = vec![
        to_255_bytes("\\"),
        to_255_bytes("'"),
        to_255_bytes("\\'"),
        to_255_bytes("ключ'\\"),
        to_255_bytes("$1"),
        to_255_bytes("😀\\"),
        "$1".into(),
        "$2, $1)".into(),
        "E'".into(),
        "'".into(),
        "\\".into(),
        "U&'\\0041'".into(),
        "'; COMMIT; INSERT INTO effects (tag, n) VALUES ('injected', 1); --".into(),
        "\\'); COMMIT; INSERT INTO effects (tag, n) VALUES ('injected', 1); --".into(),
        "*/ ; /* ".into(),
        "ÿ\u{ff}\u{10FFFF}".into(),
    ];
    let responses = [
        serde_json::json!(huge_backslashes),
        serde_json::json!({ "q": "\"'\\", "u": "\u{1F600}\u{7f}", "ctl": "\n\t\r\u{1}" }),
        serde_json::json!("$1 $2 EXECUTE idem_complete_v1; COMMIT"),
        serde_json::json!({ "\\'": ["'", "\\", "\\\\'", "E'x'"] }),
    ];
    let mut n = 0;
    for (i, key) in keys.iter().enumerate() {
        assert!(key.len() <= 255, "{key}");
        let response = &responses[i % responses.len()];
        let scope = format!("{key}{i}");
        let first = echo_value(&pool, &scope, key, response).await;
        assert!(matches!(&first, Ok(v) if !v.replayed), "{key:?}: {first:?}");
        let again = echo_value(&pool, &scope, key, response).await.unwrap();
        assert!(again.replayed, "{key:?}");
        assert_eq!(&again.value, response, "{key:?}");
        // Another request under the same key is refused and writes nothing.
        let other = echo_value(&pool, &scope, key, &serde_json::json!("other")).await;
        assert!(
            matches_idem(&other, "FingerprintMismatch"),
            "{key:?}: {other:?}"
        );
        n += 1;
        let row = env
            .client
            .query_one("SELECT response FROM idem_requests WHERE key = $1", &[key])
            .await
            .unwrap_or_else(|e| panic!("{key:?}: {e}"));
        let stored: serde_json::Value = row.get(0);
        assert_eq!(&stored, response, "{key:?}");
        assert_eq!(env.effects("echo").await, n, "{key:?}");
    }
    assert_eq!(env.effects("injected").await, 0);
    assert_eq!(env.records().await, n);
    // One byte over the limit: refused before anything is written.
    let over = format!("{}x", to_255_bytes("a"));
    let r = echo_value(&pool, "s", &over, &serde_json::json!(1)).await;
    assert!(r.is_err(), "{r:?}");
    assert_eq!(env.records().await, n);
}

/// A response just under and just over `max_response_bytes` (64 KiB), made of
/// characters that double when quoted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_response_at_the_size_limit() {
    let env = env(2).await;
    let pool = pool_of(&env.db, 1);
    // A JSON string of n backslashes serializes to 2n + 2 bytes.
    let limit = 64 * 1024;
    let under = serde_json::json!("\\".repeat((limit - 2) / 2));
    assert_eq!(under.to_string().len(), limit);
    let over = serde_json::json!("\\".repeat((limit - 2) / 2 + 1));
    let r = echo_value(&pool, "s", "under", &under).await;
    assert!(matches!(&r, Ok(v) if !v.replayed), "{:?}", r.as_ref().err());
    let r = echo_value(&pool, "s", "under", &under).await.unwrap();
    assert!(r.replayed && r.value == under);
    let r = echo_value(&pool, "s", "over", &over).await;
    assert!(r.is_err());
    assert_eq!(env.effects("echo").await, 1, "the refused one rolled back");
    assert_eq!(env.records().await, 1);
    healthy(&env, &pool, "size-after", 1).await;
}

// ---------------------------------------------------------------------------
// Concurrency and locks
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn attack_concurrent_duplicates_without_retryable() {
    let env = env(8).await;
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let pool = env.pool.clone();
            tokio::spawn(async move {
                body_runs_once(&pool, "dup", "dup", "SELECT pg_sleep(0.02)").await
            })
        })
        .collect();
    let mut fresh = 0;
    for t in tasks {
        let r = t.await.unwrap();
        match r {
            Ok(v) => fresh += usize::from(!v.replayed),
            Err(e) => panic!("a duplicate must replay, not fail: {e:?}"),
        }
    }
    assert_eq!(fresh, 1);
    assert_eq!(env.effects("dup").await, 1);
    assert_eq!(env.records().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_lock_held_elsewhere_then_released() {
    let env = env(2).await;
    let pool = pool_of(&env.db, 1);
    let scope = idem::idempotency::scope_hash(&()).unwrap();
    let lock = idem::__private::lock_key(&scope, "locked");
    let mut side = side_connection(env.db.url()).await;
    let holder = side.transaction().await.unwrap();
    tokio_postgres::GenericClient::execute(&holder, "SELECT pg_advisory_xact_lock($1)", &[&lock])
        .await
        .unwrap();
    // Cold connection: statements to prepare in the same message as the wait.
    let call = {
        let pool = pool.clone();
        tokio::spawn(async move { body_runs(&pool, "locked", "locked", "").await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(env.effects("locked").await, 0);
    holder.commit().await.unwrap();
    let r = call.await.unwrap();
    assert!(matches!(&r, Ok(v) if !v.replayed), "{r:?}");
    assert_eq!(env.effects("locked").await, 1);
    healthy(&env, &pool, "locked-after", 2).await;
}
