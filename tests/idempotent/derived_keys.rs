//! Keys derived from scope, operation and fingerprint, and the canonical fingerprint.

use super::*;

// ---------------------------------------------------------------------------
// Derived keys and the canonical fingerprint
// ---------------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct ToolAnswer {
    id: i64,
    idempotent: bool,
}

/// Two tools with the same operation and the same fields, named in another
/// order: one fingerprint, so one derived key.
#[idempotent(scope = who, operation = "tool.write", fingerprint(a, b))]
async fn tool_ab(
    conn: &mut AsyncPgConnection,
    who: &str,
    a: i64,
    b: &str,
) -> Result<ToolAnswer, AppError> {
    let id = insert_effect(conn, &format!("tool:{b}"), a).await?;
    Ok(ToolAnswer {
        id,
        idempotent: false,
    })
}

#[idempotent(scope = who, operation = "tool.write", fingerprint(b, a))]
async fn tool_ba(
    conn: &mut AsyncPgConnection,
    who: &str,
    a: i64,
    b: &str,
) -> Result<ToolAnswer, AppError> {
    let id = insert_effect(conn, &format!("tool:{b}"), a).await?;
    Ok(ToolAnswer {
        id,
        idempotent: false,
    })
}

/// No key and no fingerprint list: every parameter is the fingerprint.
#[idempotent(scope = (who, conversation))]
async fn tool_json(
    conn: &mut AsyncPgConnection,
    who: &str,
    conversation: i64,
    args: &serde_json::Value,
) -> Result<ToolAnswer, AppError> {
    let id = insert_effect(conn, "json", args.to_string().len() as i64).await?;
    Ok(ToolAnswer {
        id,
        idempotent: false,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn derived_keys_replay_the_same_call_in_any_spelling() {
    let env = env(4).await;
    let first = tool_ab(&env.pool, "alice", 5, "x").await.unwrap();
    assert!(!first.replayed);
    let again = tool_ab(&env.pool, "alice", 5, "x").await.unwrap();
    assert!(again.replayed);
    assert_eq!(again.value, first.value);
    // The other function names the fields in the other order: the same call.
    let other_order = tool_ba(&env.pool, "alice", 5, "x").await.unwrap();
    assert!(
        other_order.replayed,
        "fingerprint(b, a) = fingerprint(a, b)"
    );
    assert_eq!(other_order.value, first.value);
    assert_eq!(env.effects("tool:x").await, 1);
    // Another value, or another caller: another call.
    let other_value = tool_ba(&env.pool, "alice", 6, "x").await.unwrap();
    assert!(!other_value.replayed);
    let other_who = tool_ab(&env.pool, "bob", 5, "x").await.unwrap();
    assert!(!other_who.replayed);
    assert_eq!(env.effects("tool:x").await, 3);
    // The derived key is the published one: sha256(scope : operation : fingerprint).
    let fields = [
        idem::idempotency::Field::new("b", &"x").unwrap(),
        idem::idempotency::Field::new("a", &5).unwrap(),
    ];
    let fp = idem::idempotency::fingerprint::fingerprint(&fields);
    let scope = idem::idempotency::scope_hash(&"alice").unwrap();
    let key = idem::idempotency::derived_key(&scope, "tool.write", &fp);
    assert_eq!(key.len(), 64);
    assert_eq!(
        env.scalar(&format!(
            "SELECT count(*) FROM idem_requests WHERE key = '{key}' AND scope = '{scope}' \
             AND scope_label = '\"alice\"'"
        ))
        .await,
        1
    );

    // JSON arguments whose objects list their keys in another order.
    let spelled_one: serde_json::Value = serde_json::from_str(
        r#"{"to":"bob","amount":{"value":30,"currency":"CNY"},"tags":["a","b"]}"#,
    )
    .unwrap();
    let spelled_two: serde_json::Value = serde_json::from_str(
        r#"{"tags":["a","b"],"amount":{"currency":"CNY","value":30},"to":"bob"}"#,
    )
    .unwrap();
    let one = tool_json(&env.pool, "alice", 1, &spelled_one)
        .await
        .unwrap();
    let two = tool_json(&env.pool, "alice", 1, &spelled_two)
        .await
        .unwrap();
    assert!(!one.replayed);
    assert!(
        two.replayed,
        "the key order of a JSON object does not matter"
    );
    assert_eq!(one.value, two.value);
    // The order of an array does.
    let reordered: serde_json::Value = serde_json::from_str(
        r#"{"tags":["b","a"],"amount":{"currency":"CNY","value":30},"to":"bob"}"#,
    )
    .unwrap();
    assert!(
        !tool_json(&env.pool, "alice", 1, &reordered)
            .await
            .unwrap()
            .replayed
    );
    // Another conversation is another call.
    assert!(
        !tool_json(&env.pool, "alice", 2, &spelled_one)
            .await
            .unwrap()
            .replayed
    );
    assert_eq!(env.effects("json").await, 3);
}
