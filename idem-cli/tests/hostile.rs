//! The `idem` binary against what a hostile tester tried: stored data that
//! would drive the terminal, doctor options that overflowed, output to a
//! full disk, multi-host URLs, and exit codes that disagreed. Each test
//! counts what the database holds before and after.

use std::process::{Command, Stdio};

use idem_testing::TestDatabase;
use tokio_postgres::Client;

mod common;
use common::{idem, json};

/// A fresh, migrated database and a client on it.
async fn migrated() -> (TestDatabase, Client) {
    let db = TestDatabase::create().await.expect("a database");
    let client = idem_testing::connect(db.url()).await.expect("connect");
    let pool = idem::pool::build_pool(db.url()).expect("pool");
    let mut conn = pool.get().await.expect("conn");
    idem::migrate(&mut conn).await.expect("migrated");
    (db, client)
}

async fn count(client: &Client, sql: &str) -> i64 {
    client
        .query_one(sql, &[])
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .get(0)
}

/// The control characters in `s` that are not line ends of the output.
fn controls(s: &str) -> Vec<char> {
    s.chars().filter(|c| c.is_control() && *c != '\n').collect()
}

/// What an attacker stores: ESC sequences (clear the screen, set the
/// window title, colours), BEL, CR and a line break.
const NASTY: &str = "a\u{1b}[2J\u{1b}]0;owned\u{7}b\rc\u{1b}[31m\nd\u{9b}e";

#[tokio::test]
async fn text_output_shows_control_characters_escaped() {
    let (db, client) = migrated().await;
    let url = db.url();
    let scope = idem::idempotency::scope_hash(&7_i64).expect("scope");
    client
        .execute(
            "INSERT INTO idem_requests (scope, scope_label, key, operation, fingerprint, mode,
                                        state, expires_at)
             VALUES ($1, $2, $2, $2, decode(repeat('00', 32), 'hex'), 'local', 'unknown',
                     now() + interval '1 day')",
            &[&scope, &NASTY],
        )
        .await
        .expect("a record");
    client
        .execute(
            "INSERT INTO idem_jobs (kind, key, payload, state, last_error, failed_at)
             VALUES ($1, $1, '{}', 'dead', $1, now())",
            &[&NASTY],
        )
        .await
        .expect("a dead job");
    client
        .execute(
            "INSERT INTO idem_outbox (id, key, seq, subject, kind, version, payload, state,
                                      last_error)
             VALUES (gen_random_uuid(), $1, 1, $1, $1, 1, '{}', 'dead', $1)",
            &[&NASTY],
        )
        .await
        .expect("a dead event");
    client
        .execute(
            "INSERT INTO idem_inbox (consumer, msg_id, state, deliveries, last_error, payload)
             VALUES ($1, $1, 'dead', 3, $1, '\\x00')",
            &[&NASTY],
        )
        .await
        .expect("a dead letter");
    // A table of the application's with a version column: doctor names it.
    client
        .batch_execute(&format!(
            "CREATE TABLE \"{}\" (id int, version bigint)",
            NASTY.replace('"', "")
        ))
        .await
        .expect("a table");

    for args in [
        &["key", "show", "--scope", "7", NASTY][..],
        &["jobs", "dead"],
        &["jobs", "dead", "--show-payload"],
        &["outbox", "dead"],
        &["inbox", "stats"],
        &["inbox", "dead", "--consumer", NASTY],
        &["doctor"],
    ] {
        let (_, out, err) = idem(url, args);
        assert_eq!(controls(&out), Vec::<char>::new(), "{args:?}: {out:?}");
        assert_eq!(controls(&err), Vec::<char>::new(), "{args:?}: {err:?}");
        assert!(out.contains("\\u{1b}"), "{args:?}: escaped, visible: {out}");
        // JSON keeps the data as it is (serde escapes it).
        if args[0] != "doctor" {
            let mut with_json = vec!["--json"];
            with_json.extend_from_slice(args);
            let (code, out, err) = idem(url, &with_json);
            assert_eq!(code, 0, "{args:?}: {err}");
            let stored = serde_json::Value::from(NASTY).to_string();
            assert!(
                json(&out).to_string().contains(stored.trim_matches('"')),
                "{out}"
            );
        }
    }
    // Nothing was changed by looking.
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM idem_jobs WHERE state = 'dead'"
        )
        .await,
        1
    );
}

#[tokio::test]
async fn doctor_relay_values_are_bounded_and_never_overflow() {
    let db = TestDatabase::create().await.expect("a database");
    let url = db.url();
    let nats = ["--nats-url", "nats://127.0.0.1:1", "--stream", "S"];
    // Beyond any relay's settings: a usage error, before any connection.
    for extra in [
        &[
            "--relay-backoff-base",
            "99999999999d",
            "--relay-backoff-max",
            "99999999999d",
            "--relay-max-attempts",
            "2200",
        ][..],
        &["--relay-max-attempts", "4294967295"],
        &["--relay-max-attempts", "0"],
        &["--relay-lease", "8d"],
    ] {
        let mut args = vec!["doctor"];
        args.extend_from_slice(&nats);
        args.extend_from_slice(extra);
        let (code, out, err) = idem(url, &args);
        assert_eq!(code, 2, "{extra:?}: {out}{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    // At the bounds: the check runs (NATS is not there: FAIL, exit 1).
    let mut args = vec!["doctor"];
    args.extend_from_slice(&nats);
    args.extend_from_slice(&[
        "--relay-lease",
        "7d",
        "--relay-backoff-base",
        "7d",
        "--relay-backoff-max",
        "7d",
        "--relay-max-attempts",
        "10000",
    ]);
    let (code, out, err) = idem(url, &args);
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("FAIL  nats stream"), "{out}");
}

#[tokio::test]
async fn a_stream_without_a_nats_url_is_a_usage_error() {
    let db = TestDatabase::create().await.expect("a database");
    for which in ["--stream", "--subject"] {
        let (code, out, err) = idem(db.url(), &["doctor", which, "ORDERS"]);
        assert_eq!(code, 2, "{which}: {out}{err}");
        assert!(
            err.contains("--stream/--subject need --nats-url or NATS_URL"),
            "{err}"
        );
        assert_eq!(out, "", "nothing checked");
    }
}

#[tokio::test]
async fn doctor_to_a_full_disk_says_one_line_without_a_panic() {
    let db = TestDatabase::create().await.expect("a database");
    for args in [&["doctor"][..], &["--json", "doctor"]] {
        let full = std::fs::File::create("/dev/full").expect("/dev/full");
        let out = Command::new(env!("CARGO_BIN_EXE_idem"))
            .env_remove("NATS_URL")
            .args(["--database-url", db.url()])
            .args(args)
            .stdout(full)
            .output()
            .expect("the binary runs");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.starts_with("idem: could not write the output: "),
            "{err}"
        );
        assert!(!err.contains("panicked") && !err.contains(".rs"), "{err}");
        // A reader that stopped reading is no error.
        let mut child = Command::new(env!("CARGO_BIN_EXE_idem"))
            .env_remove("NATS_URL")
            .args(["--database-url", db.url()])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the binary runs");
        drop(child.stdout.take());
        let out = child.wait_with_output().expect("it ends");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{err}");
        assert_eq!(err, "");
    }
}

#[tokio::test]
async fn a_multi_host_url_naming_the_servers_port_is_direct() {
    let db = TestDatabase::create().await.expect("a database");
    let url = db.url();
    // postgres://user@host:port/db -> postgres://user@127.0.0.1:1,host:port/db
    let (head, rest) = url.split_once('@').expect("user@host");
    let multi = format!("{head}@127.0.0.1:1,{rest}");
    let (_, out, err) = idem(&multi, &["doctor"]);
    assert!(out.contains("ok    pooler"), "{multi}: {out}{err}");
}

#[tokio::test]
async fn exit_codes_agree_and_json_always_answers() {
    let (db, client) = migrated().await;
    let url = db.url();
    for args in [
        &["outbox", "requeue", "abc"][..],
        &["outbox", "discard", "abc"],
        &["jobs", "requeue", "abc"],
        &["jobs", "discard", "abc"],
        &["purge", "--expired", "--batch", "0"],
        &[
            "inbox",
            "purge",
            "--consumer",
            "c",
            "--older-than",
            "1d",
            "--batch",
            "0",
        ],
    ] {
        let (code, out, err) = idem(url, args);
        assert_eq!(code, 2, "{args:?}: {out}{err}");
    }

    // A live claim: --json says why nothing was settled, as "not found" does.
    let scope = idem::idempotency::scope_hash(&7_i64).expect("scope");
    client
        .execute(
            "INSERT INTO idem_requests (scope, key, operation, fingerprint, mode, state,
                                        expires_at, lease_until, owner)
             VALUES ($1, 'live', 'refund', decode(repeat('00', 32), 'hex'), 'external',
                     'in_progress', now() + interval '1 day', now() + interval '10 minutes',
                     decode(repeat('11', 16), 'hex'))",
            &[&scope],
        )
        .await
        .expect("a live claim");
    let (code, out, err) = idem(
        url,
        &[
            "--json",
            "key",
            "settle",
            "--scope",
            "7",
            "live",
            "--released",
        ],
    );
    assert_eq!(code, 1, "{err}");
    let doc = json(&out);
    assert_eq!(doc["settled"], false, "{doc}");
    assert_eq!(doc["key"], "live", "{doc}");
    assert!(
        doc["refused"].as_str().unwrap_or("").contains("--force"),
        "{doc}"
    );
    assert!(doc["lease_left"].as_f64().unwrap_or(0.0) > 0.0, "{doc}");
    let (code, out, _) = idem(
        url,
        &[
            "--json",
            "key",
            "settle",
            "--scope",
            "7",
            "gone",
            "--released",
        ],
    );
    assert_eq!(code, 1);
    assert_eq!(json(&out)["settled"], false);
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM idem_requests WHERE state = 'in_progress'"
        )
        .await,
        1,
        "the live claim is untouched"
    );
}
