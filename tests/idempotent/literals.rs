//! Local mode writes its key, scope and response into SQL text: the lock and
//! the read ride on `BEGIN`, the record on `COMMIT`, which diesel-async sends
//! as simple queries, where nothing can be bound. Values chosen to break out
//! of a literal (quotes, backslashes under either string setting, dollar
//! quotes, comments, semicolons) are stored exactly as given, replay exactly,
//! and run nothing of their own.

use super::*;

/// Writes an effect and answers with `response`, under `scope`.
#[idempotent(key = key, scope = scope, fingerprint(response))]
async fn echo(
    conn: &mut AsyncPgConnection,
    scope: &str,
    key: &str,
    response: &serde_json::Value,
) -> Result<serde_json::Value, AppError> {
    insert_effect(conn, "literal", 1).await?;
    Ok(response.clone())
}

const HOSTILE: [&str; 9] = [
    "it's",
    r"back\slash",
    r"\'; SELECT pg_sleep(5); --",
    "'); DROP TABLE effects; --",
    "E'x' || 'y'",
    "$$; DROP TABLE effects; $$",
    "/* open comment",
    "ключ ✓ 鍵",
    r"\\x00ff",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn values_that_would_break_a_literal_are_stored_and_replayed_exactly() {
    let env = env(4).await;
    for standard_strings in ["on", "off"] {
        // Under both readings of a backslash in a plain literal.
        env.client
            .batch_execute(&format!(
                "ALTER DATABASE {} SET standard_conforming_strings = {standard_strings}",
                env.db.name()
            ))
            .await
            .unwrap();
        let pool = pool_of(&env.db, 2);
        for (i, text) in HOSTILE.iter().enumerate() {
            let key = format!("{standard_strings}-{i}-{text}");
            let scope = format!("scope {text}");
            let response = serde_json::json!({ "echo": text, "nested": [text, { (*text): text }] });
            let first = echo(&pool, &scope, &key, &response).await.unwrap();
            assert!(!first.replayed, "{key}");
            let again = echo(&pool, &scope, &key, &response).await.unwrap();
            assert!(again.replayed, "{key}: the second call replays");
            assert_eq!(again.value, response, "{key}: replayed exactly");
            // The record holds the key, the scope's label and the response
            // as given, read back with bind parameters.
            let row = env
                .client
                .query_one(
                    "SELECT scope_label, response FROM idem_requests WHERE key = $1",
                    &[&key],
                )
                .await
                .unwrap_or_else(|e| panic!("{key}: one record under the exact key: {e}"));
            let label: Option<String> = row.get(0);
            let stored: serde_json::Value = row.get(1);
            assert_eq!(
                label.as_deref(),
                Some(serde_json::to_string(&scope).unwrap().as_str())
            );
            assert_eq!(stored, response, "{key}");
        }
    }
    let n = HOSTILE.len() as i64 * 2;
    assert_eq!(
        env.effects("literal").await,
        n,
        "one effect per key, nothing else ran"
    );
    assert_eq!(env.records().await, n, "one record per key");
}

/// Writes an effect, after running `drop` (a body's own `DEALLOCATE` or
/// `DISCARD`) when given.
#[idempotent(key = key, scope = none, fingerprint(drop))]
#[retryable(max = 2, deadline_ms = 1500)]
async fn prepared_on_one_connection(
    conn: &mut AsyncPgConnection,
    key: &str,
    drop: Option<&str>,
) -> Result<i64, AppError> {
    if let Some(sql) = drop {
        conn.batch_execute(sql).await?;
    }
    insert_effect(conn, "prepared", 1).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn statements_prepared_on_a_session_survive_failures_and_a_body_that_drops_them() {
    let env = env(2).await;
    // One connection, so every call meets what the calls before left on it.
    let pool = pool_of(&env.db, 1);
    let call = |key: &'static str, drop: Option<&'static str>| {
        let pool = pool.clone();
        async move { prepared_on_one_connection(&pool, key, drop).await }
    };
    assert!(!call("first", None).await.unwrap().replayed);
    // The lock is held elsewhere: this call's lock waits past its deadline,
    // after its statements were prepared in the same message.
    let scope = idem::idempotency::scope_hash(&()).unwrap();
    let lock = idem::__private::lock_key(&scope, "held");
    let mut side = side_connection(env.db.url()).await;
    let holder = side.transaction().await.unwrap();
    tokio_postgres::GenericClient::execute(&holder, "SELECT pg_advisory_xact_lock($1)", &[&lock])
        .await
        .unwrap();
    let held = call("held", None).await;
    assert!(held.is_err(), "{held:?}");
    holder.commit().await.unwrap();
    // Prepared once, never again: no "already exists" after the failure.
    assert!(!call("held", None).await.unwrap().replayed);
    // The body drops one of them (the server says only DEALLOCATE, not
    // which), then all of them: each next call prepares them again. Behind
    // a transaction pooler nothing of idem's is prepared (its statements are
    // written out whole), so there is none to drop by name.
    let one = if env.db.via().is_transaction_pooling() {
        Some("DEALLOCATE ALL")
    } else {
        Some("DEALLOCATE idem_read_v1")
    };
    assert!(!call("one", one).await.unwrap().replayed);
    assert!(!call("after one", None).await.unwrap().replayed);
    let all = Some("DEALLOCATE ALL");
    assert!(!call("all", all).await.unwrap().replayed);
    for (key, drop) in [
        ("after all", None),
        ("first", None),
        ("held", None),
        ("one", one),
        ("all", all),
    ] {
        let answer = call(key, drop).await.unwrap();
        assert_eq!(answer.replayed, key != "after all", "{key}");
    }
    assert_eq!(env.effects("prepared").await, 6, "one effect per key");
}
