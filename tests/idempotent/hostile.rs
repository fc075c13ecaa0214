//! Input chosen to break the key space or the stored record: scopes whose
//! maps serialize in random order or are too large for an index, responses
//! and final errors that PostgreSQL cannot store or idem could not read back.
//! Each is refused before anything commits (or, for a final error, answered
//! unrecorded), and the key stays usable.

use super::*;

// ---------------------------------------------------------------------------
// Scopes
// ---------------------------------------------------------------------------

#[idempotent(key = key, scope = scope, fingerprint(n))]
async fn under_scope(
    conn: &mut AsyncPgConnection,
    scope: &HashMap<String, String>,
    key: &str,
    n: i64,
) -> Result<i64, AppError> {
    insert_effect(conn, "scoped", n).await
}

/// A scope built afresh each time: a `HashMap` iterates in a different
/// order in every instance.
fn principal(extra: usize) -> HashMap<String, String> {
    let mut scope: HashMap<String, String> = (0..12)
        .map(|i| (format!("claim-{i}"), format!("value-{i}")))
        .collect();
    scope.insert("filler".into(), "x".repeat(extra));
    scope
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_logical_scope_is_one_key_space_whatever_its_map_order() {
    let env = env(2).await;
    for _ in 0..20 {
        under_scope(&env.pool, &principal(0), "same-key", 1)
            .await
            .unwrap();
    }
    assert_eq!(
        env.effects("scoped").await,
        1,
        "ran once, replayed 19 times"
    );
    assert_eq!(env.records().await, 1);
    // Stored as a fixed-size hash; the readable label is kept only when short.
    let width = env
        .scalar("SELECT max(octet_length(scope))::bigint FROM idem_requests")
        .await;
    assert_eq!(width, 64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_scope_of_any_size_fits() {
    let env = env(2).await;
    for size in [4 * 1024, 1024 * 1024] {
        let key = format!("big-{size}");
        let first = under_scope(&env.pool, &principal(size), &key, 7)
            .await
            .unwrap();
        let again = under_scope(&env.pool, &principal(size), &key, 7)
            .await
            .unwrap();
        assert!(!first.replayed && again.replayed, "{size}");
    }
    assert_eq!(env.effects("scoped").await, 2);
    let labels = env
        .scalar("SELECT count(scope_label) FROM idem_requests")
        .await;
    assert_eq!(labels, 0, "no unbounded label is kept");
    // A different principal is another key space: it runs.
    let mut other = principal(0);
    other.insert("claim-0".into(), "someone else".into());
    assert!(
        !under_scope(&env.pool, &other, "big-4096", 7)
            .await
            .unwrap()
            .replayed
    );
}

// ---------------------------------------------------------------------------
// Responses and final errors that cannot be stored
// ---------------------------------------------------------------------------

/// Writes a row, then answers with `response`, or declines echoing it.
#[idempotent(key = key, scope = none, fingerprint(response, decline))]
async fn answer(
    conn: &mut AsyncPgConnection,
    key: &str,
    response: &serde_json::Value,
    decline: bool,
) -> Result<serde_json::Value, AppError> {
    insert_effect(conn, "answer", 1).await?;
    if decline {
        return Err(AppError::Declined(Declined::Rejected {
            input: response.clone(),
        }));
    }
    Ok(response.clone())
}

fn nested(depth: usize) -> serde_json::Value {
    (0..depth).fold(serde_json::json!("core"), |inner, _| {
        serde_json::json!([inner])
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_response_that_cannot_be_stored_commits_nothing_and_leaves_the_key_free() {
    let env = env(2).await;
    let nul = serde_json::json!({ "note": "a\u{0}b" });
    let nul_key = serde_json::json!({ "a\u{0}": 1 });
    let deep = nested(128);
    for (response, expected) in [
        (&nul, idem::Unstorable::NulCharacter),
        (&nul_key, idem::Unstorable::NulCharacter),
        (
            &deep,
            idem::Unstorable::TooDeep {
                limit: idem::idempotency::MAX_STORED_DEPTH,
            },
        ),
    ] {
        let result = answer(&env.pool, "k", response, false).await;
        match &result {
            Err(AppError::Idem(e @ idem::Error::Unstorable(why))) => {
                assert_eq!(*why, expected);
                assert_eq!(e.http_status(), 422);
            }
            other => panic!("expected an unstorable response, got {other:?}"),
        }
    }
    assert_eq!(
        env.effects("answer").await,
        0,
        "the body's writes rolled back"
    );
    assert_eq!(env.records().await, 0, "the key is not poisoned");

    // The deepest response accepted is read back on replay.
    let deepest = nested(idem::idempotency::MAX_STORED_DEPTH - 1);
    let first = answer(&env.pool, "k", &deepest, false).await.unwrap();
    let again = answer(&env.pool, "k", &deepest, false).await.unwrap();
    assert!(!first.replayed && again.replayed);
    assert_eq!(again.value, deepest);
    assert_eq!(env.effects("answer").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_final_error_that_cannot_be_stored_is_answered_unrecorded() {
    let env = env(2).await;
    let nul = serde_json::json!("a\u{0}b");
    let huge = serde_json::json!("x".repeat(100 * 1024));
    for input in [&nul, &huge, &nested(128)] {
        let result = answer(&env.pool, "declined", input, true).await;
        match result {
            Err(AppError::Declined(Declined::Rejected { input: echoed })) => {
                assert_eq!(&echoed, input)
            }
            other => panic!("expected the decline itself, got {other:?}"),
        }
    }
    assert_eq!(env.effects("answer").await, 0);
    assert_eq!(env.records().await, 0, "nothing recorded, the key is free");
    // A decline that can be stored is stored as before.
    let fine = serde_json::json!("short");
    for _ in 0..2 {
        let result = answer(&env.pool, "declined", &fine, true).await;
        assert!(matches!(result, Err(AppError::Declined(_))), "{result:?}");
    }
    let (state, outcome, _) = env.record("declined").await.unwrap();
    assert_eq!(
        (state.as_str(), outcome.as_deref()),
        ("completed", Some("error"))
    );
}

// ---------------------------------------------------------------------------
// Fingerprints: values JSON would merge stay apart
// ---------------------------------------------------------------------------

/// One parameter whose variants serialize as their bare content, so only the
/// fingerprint's encoding tells them apart.
#[derive(Debug, Serialize)]
#[serde(untagged)]
enum Arg {
    Float(Option<f64>),
    Unit(()),
    IntKeys(std::collections::BTreeMap<i64, i64>),
    StrKeys(std::collections::BTreeMap<String, i64>),
}

#[idempotent(key = key, scope = none, fingerprint(arg))]
async fn with_arg(conn: &mut AsyncPgConnection, key: &str, arg: &Arg) -> Result<i64, AppError> {
    insert_effect(conn, "arg", 1).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn values_that_json_merges_are_different_requests() {
    let env = env(2).await;
    let int_keys = Arg::IntKeys([(1, 5)].into_iter().collect());
    let str_keys = Arg::StrKeys([("1".to_owned(), 5)].into_iter().collect());
    let groups: [(&str, Vec<Arg>); 2] = [
        (
            "float",
            vec![
                Arg::Float(Some(f64::NAN)),
                Arg::Float(None),
                Arg::Float(Some(f64::INFINITY)),
                Arg::Float(Some(f64::NEG_INFINITY)),
                Arg::Unit(()),
            ],
        ),
        ("map", vec![int_keys, str_keys]),
    ];
    for (key, args) in &groups {
        let (first, others) = args.split_first().unwrap();
        assert!(!with_arg(&env.pool, key, first).await.unwrap().replayed);
        for other in others {
            let result = with_arg(&env.pool, key, other).await;
            assert!(
                matches!(
                    result,
                    Err(AppError::Idem(idem::Error::FingerprintMismatch))
                ),
                "{first:?} and {other:?} must be different requests: {result:?}"
            );
        }
        // The same value again is the same request (one NaN).
        assert!(with_arg(&env.pool, key, first).await.unwrap().replayed);
    }
    assert_eq!(env.effects("arg").await, 2);
}
