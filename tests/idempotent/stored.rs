//! What a key stores (final errors, compound results, bounded responses); bad input is refused.

use super::*;

// ---------------------------------------------------------------------------
// Errors: final ones are stored, the others let a retry run
// ---------------------------------------------------------------------------

#[idempotent(key = key, fingerprint(n), scope = none)]
async fn charge(
    conn: &mut AsyncPgConnection,
    key: &str,
    n: i64,
    script: &Script,
) -> Result<i64, AppError> {
    let id = insert_effect(conn, "charge", n).await?;
    script.run(conn).await?;
    Ok(id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn final_errors_are_stored_and_other_errors_release_the_key() {
    let env = env(4).await;
    let script = Script::new(&[Step::Declined]);

    // A final error: stored, the body's writes rolled back.
    let result = charge(&env.pool, "declined", 10, &script).await;
    assert!(
        matches!(
            &result,
            Err(AppError::Declined(Declined::InsufficientFunds {
                needed: 42
            }))
        ),
        "{result:?}"
    );
    assert_eq!(
        env.effects("charge").await,
        0,
        "the body's writes were rolled back"
    );
    let (state, outcome, response) = env.record("declined").await.unwrap();
    assert_eq!(
        (state.as_str(), outcome.as_deref()),
        ("completed", Some("error"))
    );
    assert!(response.unwrap().contains("InsufficientFunds"));
    // Replayed to later callers, without running the body.
    for _ in 0..2 {
        let result = charge(&env.pool, "declined", 10, &script).await;
        assert!(
            matches!(
                &result,
                Err(AppError::Declined(Declined::InsufficientFunds {
                    needed: 42
                }))
            ),
            "{result:?}"
        );
    }
    assert_eq!(script.calls(), 1);
    // A different request under that key is still refused.
    let result = charge(&env.pool, "declined", 11, &script).await;
    assert!(matches_idem(&result, "FingerprintMismatch"), "{result:?}");

    // A non-final error: nothing stays, not even the claim.
    script.push(Step::Timeout);
    let result = charge(&env.pool, "flaky", 10, &script).await;
    assert!(matches!(result, Err(AppError::Timeout)), "{result:?}");
    assert_eq!(script.calls(), 2);
    assert_eq!(env.record("flaky").await, None, "the claim rolled back");
    assert_eq!(env.effects("charge").await, 0);
    // So a retry really runs again, and then it is stored.
    let retried = charge(&env.pool, "flaky", 10, &script).await.unwrap();
    assert!(!retried.replayed);
    assert_eq!(script.calls(), 3);
    assert_eq!(env.effects("charge").await, 1);
    let replay = charge(&env.pool, "flaky", 10, &script).await.unwrap();
    assert!(replay.replayed);
    assert_eq!(replay.value, retried.value);
    assert_eq!(script.calls(), 3);
}

// ---------------------------------------------------------------------------
// A compound result comes back whole
// ---------------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Written {
    id: i64,
    tag: String,
    n: i64,
}

#[idempotent(key = key, fingerprint(order), scope = none)]
async fn compound(
    conn: &mut AsyncPgConnection,
    key: &str,
    order: i64,
) -> Result<Vec<Written>, AppError> {
    let mut rows = Vec::new();
    for tag in ["order", "line", "outbox"] {
        let id = insert_effect(conn, tag, order).await?;
        rows.push(Written {
            id,
            tag: tag.to_owned(),
            n: order,
        });
    }
    Ok(rows)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_compound_result_is_replayed_whole() {
    let env = env(2).await;
    let first = compound(&env.pool, "c-1", 77).await.unwrap();
    assert!(!first.replayed);
    assert_eq!(first.value.len(), 3);
    let replay = compound(&env.pool, "c-1", 77).await.unwrap();
    assert!(replay.replayed);
    assert_eq!(replay.value, first.value, "every member, in order");
    assert_eq!(env.scalar("SELECT count(*) FROM effects").await, 3);
    // The replayed rows are the rows in the table.
    let rows: Vec<Written> = env
        .client
        .query("SELECT id, tag, n FROM effects ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| Written {
            id: r.get(0),
            tag: r.get(1),
            n: r.get(2),
        })
        .collect();
    assert_eq!(rows, replay.value);
}

// ---------------------------------------------------------------------------
// The stored response is bounded
// ---------------------------------------------------------------------------

#[idempotent(key = key, fingerprint(len), max_response_bytes = 100, scope = none)]
async fn sized(conn: &mut AsyncPgConnection, key: &str, len: usize) -> Result<String, AppError> {
    insert_effect(conn, "sized", len as i64).await?;
    Ok("x".repeat(len))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_oversized_response_commits_nothing() {
    let env = env(2).await;
    // 99 characters are 101 bytes of JSON.
    let result = sized(&env.pool, "big", 99).await;
    match &result {
        Err(AppError::Idem(
            e @ idem::Error::Unstorable(idem::Unstorable::TooLarge { size, limit }),
        )) => {
            assert_eq!((*size, *limit), (101, 100));
            assert_eq!(e.http_status(), 422);
        }
        other => panic!("expected a response too large, got {other:?}"),
    }
    assert_eq!(env.effects("sized").await, 0, "no business row");
    assert_eq!(env.records().await, 0, "no record");
    // The key was not used up: a request that fits (exactly) runs under it.
    let fits = sized(&env.pool, "big", 98).await.unwrap();
    assert!(!fits.replayed);
    assert_eq!(fits.value.len(), 98);
    assert!(sized(&env.pool, "big", 98).await.unwrap().replayed);
    assert_eq!(env.effects("sized").await, 1);
}

// ---------------------------------------------------------------------------
// Bad input: refused before anything is written
// ---------------------------------------------------------------------------

struct OptCmd {
    key: Option<String>,
    n: i64,
}

#[idempotent(key = cmd.key, fingerprint(cmd.n), scope = none)]
async fn optional_key(conn: &mut AsyncPgConnection, cmd: &OptCmd) -> Result<i64, AppError> {
    insert_effect(conn, "optional", cmd.n).await
}

#[idempotent(key = key, fingerprint(doc), scope = none)]
async fn with_doc(
    conn: &mut AsyncPgConnection,
    key: &str,
    doc: &serde_json::Value,
) -> Result<i64, AppError> {
    insert_effect(conn, "doc", doc.is_array() as i64).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_input_is_refused_before_anything_is_written() {
    let env = env(2).await;
    let script = Script::default();
    let long = "k".repeat(256);
    // 128 two-byte characters: 256 bytes.
    let long_utf8 = "é".repeat(128);
    for (key, reason) in [
        ("", "empty"),
        (long.as_str(), "longer than 255 bytes"),
        (long_utf8.as_str(), "longer than 255 bytes"),
        ("a\u{7}b", "control"),
        ("line\nbreak", "control"),
        ("tab\t", "control"),
    ] {
        let result = charge(&env.pool, key, 1, &script).await;
        match &result {
            Err(AppError::Idem(e @ idem::Error::InvalidKey { .. })) => {
                assert_eq!(e.http_status(), 400);
                assert!(e.to_string().contains(reason), "{e} for {key:?}");
            }
            other => panic!("expected an invalid key for {key:?}, got {other:?}"),
        }
    }
    assert_eq!(script.calls(), 0);

    let result = optional_key(&env.pool, &OptCmd { key: None, n: 1 }).await;
    match &result {
        Err(AppError::Idem(e @ idem::Error::MissingKey)) => assert_eq!(e.http_status(), 400),
        other => panic!("expected a missing key, got {other:?}"),
    }

    // Nested past the fingerprint's depth limit: refused, not a stack overflow.
    let deep = (0..200).fold(serde_json::json!(1), |inner, _| serde_json::json!([inner]));
    let result = with_doc(&env.pool, "doc-1", &deep).await;
    match &result {
        Err(AppError::Idem(e @ idem::Error::Unserializable { .. })) => {
            assert!(e.to_string().contains("fingerprint field `doc`"), "{e}")
        }
        other => panic!("expected an unserializable fingerprint, got {other:?}"),
    }

    assert_eq!(env.records().await, 0);
    assert_eq!(env.scalar("SELECT count(*) FROM effects").await, 0);

    // The longest key there is, and an optional key that is given, are fine.
    let longest = "k".repeat(255);
    assert!(
        !charge(&env.pool, &longest, 1, &script)
            .await
            .unwrap()
            .replayed
    );
    let given = OptCmd {
        key: Some("opt-1".into()),
        n: 1,
    };
    assert!(!optional_key(&env.pool, &given).await.unwrap().replayed);
    assert!(optional_key(&env.pool, &given).await.unwrap().replayed);
    assert_eq!(env.records().await, 2);
}
