//! Hostile pass (helper, session 70) on f15572c: `idem jobs dead` marks a
//! payload it could not read back. Tried: `--json` with and without
//! `--show-payload` (the flag stays when the payload is hidden, so that a
//! script knows what `payload_bytes` measured), a readable payload that is
//! a JSON string of the very stored text of an unreadable one, unicode and
//! escapes in that text, `--kind`, `--limit`/`--offset`. Sizes are checked
//! against `octet_length(payload::text)` read from the database.

use tokio_postgres::Client;

mod common;
use common::{count, idem, json, migrated};

/// A dead job of `kind` and `key` whose payload is `payload` (SQL text),
/// dead `ago` seconds (the listing's order).
async fn dead(client: &Client, kind: &str, key: &str, payload: &str, ago: i32) {
    client
        .execute(
            "INSERT INTO idem_jobs (kind, key, payload, state, last_error, failed_at)
             VALUES ($1, $2, $3::text::jsonb, 'dead', 'no', now() - $4::int4 * interval '1 second')",
            &[&kind, &key, &payload, &ago],
        )
        .await
        .unwrap_or_else(|e| panic!("{key}: {e}"));
}

async fn stored_text(client: &Client, key: &str) -> String {
    client
        .query_one(
            "SELECT payload::text FROM idem_jobs WHERE key = $1",
            &[&key],
        )
        .await
        .expect("one job")
        .get(0)
}

/// `(key, payload_unreadable, payload_bytes or payload)` of each row.
fn rows(out: &str) -> Vec<(String, bool, serde_json::Value)> {
    json(out)
        .as_array()
        .expect("a list")
        .iter()
        .map(|r| {
            let shown = r.get("payload").or_else(|| r.get("payload_bytes"));
            (
                r["key"].as_str().expect("a key").to_owned(),
                r["payload_unreadable"].as_bool().expect("the flag"),
                shown.cloned().expect("payload or its size"),
            )
        })
        .collect()
}

#[tokio::test]
async fn attack53_the_unreadable_flag_and_sizes_in_json_and_table() {
    let (db, client) = migrated().await;
    let url = db.url();
    let unreadable = r#"{"n": 1e400, "s": "é ✓ \"q\" \n\t\u0001 \\ unreadable: x"}"#;
    dead(&client, "mail", "u", unreadable, 30).await;
    let text = stored_text(&client, "u").await;
    client
        .execute(
            "INSERT INTO idem_jobs (kind, key, payload, state, last_error, failed_at)
             VALUES ('mail', 's', to_jsonb($1::text), 'dead', 'no', now() - interval '20 seconds')",
            &[&text],
        )
        .await
        .expect("a string payload");
    let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
    dead(&client, "sms", "deep", &deep, 10).await;
    let octets = |key: &'static str| {
        let client = &client;
        async move {
            count(
                client,
                &format!(
                    "SELECT octet_length(payload::text)::bigint FROM idem_jobs WHERE key = '{key}'"
                ),
            )
            .await
        }
    };
    let (u_bytes, s_bytes, deep_bytes) =
        (octets("u").await, octets("s").await, octets("deep").await);

    // Hidden: the flag stays, each size is the stored text's (a string's
    // with its quotes and escapes, as jsonb prints it too).
    let (code, out, err) = idem(url, &["--json", "jobs", "dead"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        rows(&out),
        [
            ("u".to_owned(), true, u_bytes.into()),
            ("s".to_owned(), false, s_bytes.into()),
            ("deep".to_owned(), true, deep_bytes.into()),
        ],
        "{out}"
    );
    // Shown: the same text for both mail rows, told apart by the flag.
    let (code, out, err) = idem(url, &["--json", "jobs", "dead", "--show-payload"]);
    assert_eq!(code, 0, "{err}");
    let shown = rows(&out);
    assert_eq!(shown[0].2, serde_json::Value::String(text.clone()), "{out}");
    assert_eq!(shown[1].2, shown[0].2, "{out}");
    assert_eq!(
        shown.iter().map(|r| r.1).collect::<Vec<_>>(),
        [true, false, true]
    );
    // --kind and pages keep each flag with its row.
    let (code, out, _) = idem(url, &["--json", "jobs", "dead", "--kind", "sms"]);
    assert_eq!(code, 0);
    assert_eq!(rows(&out), [("deep".to_owned(), true, deep_bytes.into())]);
    let (code, out, _) = idem(
        url,
        &[
            "--json", "jobs", "dead", "--kind", "mail", "--limit", "1", "--offset", "1",
        ],
    );
    assert_eq!(code, 0);
    assert_eq!(rows(&out), [("s".to_owned(), false, s_bytes.into())]);

    // The table: hidden, the unreadable ones said so, once each.
    let (code, out, _) = idem(url, &["jobs", "dead"]);
    assert_eq!(code, 0);
    assert_eq!(out.matches(", unreadable").count(), 2, "{out}");
    assert!(
        out.contains(&format!("hidden, {u_bytes} B, unreadable")),
        "{out}"
    );
    assert!(out.contains(&format!("hidden, {s_bytes} B")), "{out}");
    // Shown: the unreadable one prefixed; the string one, whose text says
    // "unreadable: x", is printed as a JSON string, unprefixed.
    let (code, out, _) = idem(url, &["jobs", "dead", "--kind", "mail", "--show-payload"]);
    assert_eq!(code, 0);
    assert_eq!(out.matches("unreadable: \"").count(), 1, "{out}");
}
