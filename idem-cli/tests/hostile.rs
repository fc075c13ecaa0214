//! The `idem` binary against what a hostile tester tried: stored data that
//! would drive the terminal, doctor options that overflowed, output to a
//! full disk, multi-host URLs, and exit codes that disagreed. Each test
//! counts what the database holds before and after.

use std::process::{Command, Stdio};

use diesel::sql_types::BigInt;
use diesel_async::AsyncPgConnection;
use idem::{idempotent, Pool};
use idem_testing::TestDatabase;
use tokio_postgres::Client;

mod common;
use common::{count, idem, json, migrated};

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
            &[&scope, &NASTY.to_owned()],
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

    // `jobs requeue --all` leaving a dead job dead (a live job of its kind
    // and key exists) exits 1, as for one id; the other is requeued.
    client
        .batch_execute(
            "INSERT INTO idem_jobs (kind, key, payload, state, last_error, failed_at)
             VALUES ('refund', 'a', '{}', 'dead', 'no', now()),
                    ('refund', 'a', '{}', 'due', NULL, NULL),
                    ('refund', 'b', '{}', 'dead', 'no', now())",
        )
        .await
        .expect("two dead jobs, one beside a live one");
    let (code, out, err) = idem(url, &["jobs", "requeue", "--all"]);
    assert_eq!(code, 1, "{out}{err}");
    assert_eq!(
        out,
        "requeued 1 of 2 dead job(s); 1 left dead: a live job of its kind and key exists\n"
    );
    let (code, out, _) = idem(url, &["--json", "jobs", "requeue", "--all"]);
    assert_eq!(code, 1, "{out}");
    assert_eq!(json(&out)[0]["result"], "live_exists", "{out}");
    client
        .batch_execute("DELETE FROM idem_jobs WHERE key = 'a' AND state = 'due'")
        .await
        .expect("the live job done");
    let (code, out, _) = idem(url, &["jobs", "requeue", "--all"]);
    assert_eq!((code, out.as_str()), (0, "requeued 1 of 1 dead job(s)\n"));
}

#[derive(Debug, thiserror::Error)]
enum ChargeError {
    #[error(transparent)]
    Db(#[from] diesel::result::Error),
    #[error(transparent)]
    Idem(#[from] idem::Error),
}
idem::final_errors!(ChargeError);

/// A charge whose effect is a row of `charges`: its response is an `i64`.
#[idempotent(key = key, scope = tenant, fingerprint(amount))]
async fn charge(
    conn: &mut AsyncPgConnection,
    tenant: i64,
    key: &str,
    amount: i64,
) -> Result<i64, ChargeError> {
    use diesel_async::RunQueryDsl as _;
    diesel::sql_query("INSERT INTO charges (amount) VALUES ($1)")
        .bind::<BigInt, _>(amount)
        .execute(conn)
        .await?;
    Ok(amount * 100)
}

/// A record's stored response and state, if there is one.
async fn record(client: &Client, key: &str) -> Option<(String, String)> {
    client
        .query_opt(
            "SELECT response::text, state::text FROM idem_requests WHERE key = $1",
            &[&key],
        )
        .await
        .expect("read")
        .map(|row| (row.get(0), row.get(1)))
}

/// `idem [--json] key settle --scope 7 <key> <rest>`.
fn settle_key(url: &str, key: &str, rest: &[&str], json: bool) -> (i32, String, String) {
    let mut args = if json { vec!["--json"] } else { Vec::new() };
    args.extend_from_slice(&["key", "settle", "--scope", "7", key]);
    args.extend_from_slice(rest);
    idem(url, &args)
}

/// A settled response that does not deserialize as the function's `T` can
/// be corrected with `--force`, and `--released --force` makes the key new.
#[tokio::test]
async fn a_completed_record_is_corrected_or_released_with_force() {
    let (db, client) = migrated().await;
    let url = db.url();
    client
        .batch_execute("CREATE TABLE charges (amount bigint NOT NULL)")
        .await
        .expect("charges");
    let pool: Pool = idem::pool::build_pool(url).expect("pool");
    let charges = || count(&client, "SELECT count(*) FROM charges");

    // The target did it, but the operator settles with a typo: the stored
    // response is not an i64, and every replay fails.
    assert_eq!(
        charge(&pool, 7, "typo", 12).await.expect("charged").value,
        1200
    );
    client
        .execute(
            "UPDATE idem_requests SET state = 'unknown', outcome = NULL, response = NULL
             WHERE key = 'typo'",
            &[],
        )
        .await
        .expect("outcome unknown");
    let (code, _, err) = settle_key(url, "typo", &["--completed", "\"1200\""], false);
    assert_eq!(code, 0, "{err}");
    assert!(
        charge(&pool, 7, "typo", 12).await.is_err(),
        "\"1200\" is no i64"
    );
    // Without --force a completed record is left alone, and says so.
    let (code, out, err) = settle_key(url, "typo", &["--completed", "1200"], false);
    assert_eq!(code, 1, "{out}{err}");
    assert!(format!("{out}{err}").contains("--force"), "{out}{err}");
    assert_eq!(record(&client, "typo").await.expect("kept").0, "\"1200\"");
    // With --force its response is overwritten.
    let (code, out, err) = settle_key(url, "typo", &["--completed", "1200", "--force"], true);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(json(&out)["overwritten"], true, "{out}");
    assert_eq!(
        record(&client, "typo").await,
        Some(("1200".into(), "completed".into()))
    );
    assert_eq!(
        charge(&pool, 7, "typo", 12).await.expect("replayed").value,
        1200
    );
    assert_eq!(charges().await, 1, "replayed, not run again");

    // --released --force deletes a completed record: the key is new again.
    assert_eq!(
        charge(&pool, 7, "again", 5).await.expect("charged").value,
        500
    );
    assert_eq!(charges().await, 2);
    let (code, _, _) = settle_key(url, "again", &["--released"], false);
    assert_eq!(code, 1, "completed: not released without --force");
    assert_eq!(
        charge(&pool, 7, "again", 5).await.expect("replayed").value,
        500
    );
    assert_eq!(charges().await, 2);
    let (code, out, err) = settle_key(url, "again", &["--released", "--force"], false);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(record(&client, "again").await, None, "deleted");
    assert_eq!(
        charge(&pool, 7, "again", 5).await.expect("ran again").value,
        500
    );
    assert_eq!(charges().await, 3, "the key was new again");
}

/// The names of a database's relations, functions, types and triggers,
/// and idem's bookkeeping rows, to compare two databases.
async fn schema(client: &Client) -> Vec<String> {
    let rows = client
        .query(
            "SELECT 'rel ' || relname || ' ' || relkind::text FROM pg_class c
               JOIN pg_namespace n ON n.oid = c.relnamespace WHERE nspname = 'public'
             UNION ALL SELECT 'fn ' || proname FROM pg_proc p
               JOIN pg_namespace n ON n.oid = p.pronamespace WHERE nspname = 'public'
             UNION ALL SELECT 'type ' || typname FROM pg_type t
               JOIN pg_namespace n ON n.oid = t.typnamespace WHERE nspname = 'public'
             UNION ALL SELECT 'trigger ' || tgname FROM pg_trigger WHERE NOT tgisinternal
             UNION ALL SELECT 'migration ' || version || ' ' || name || ' ' || checksum
               FROM idem_schema_migrations
             ORDER BY 1",
            &[],
        )
        .await
        .expect("the catalog");
    rows.iter().map(|r| r.get(0)).collect()
}

/// `idem migrate --print-sql` applied by hand leaves the database as
/// `idem migrate` would: migrated and recorded, so status is current and
/// migrate applies nothing; and it refuses a database already migrated.
#[tokio::test]
async fn the_printed_sql_applied_by_hand_is_recorded() {
    let (code, script, err) = idem("postgres://nowhere.invalid/x", &["migrate", "--print-sql"]);
    assert_eq!(code, 0, "needs no database: {err}");
    let by_hand = TestDatabase::create().await.expect("a database");
    let client = idem_testing::connect(by_hand.url()).await.expect("connect");
    client
        .batch_execute(&script)
        .await
        .expect("the script applies");

    let (code, out, err) = idem(by_hand.url(), &["migrate", "status"]);
    assert_eq!(code, 0, "current: {out}{err}");
    assert!(!out.contains("pending"), "{out}");
    let (code, out, err) = idem(by_hand.url(), &["migrate"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("nothing to apply"), "{out}");
    let (code, out, _) = idem(by_hand.url(), &["doctor"]);
    assert!(out.contains("ok    migrations"), "{code}: {out}");

    // The same objects and rows as `idem migrate` makes.
    let (migrated_db, migrated_client) = migrated().await;
    let applied = schema(&client).await;
    assert_eq!(applied, schema(&migrated_client).await);
    assert_eq!(
        applied
            .iter()
            .filter(|l| l.starts_with("migration "))
            .count(),
        idem::migrate::migrations().len()
    );

    // Applied again, or to a database `idem migrate` made: refused, and
    // nothing changes (one transaction).
    for (db, client) in [(&by_hand, &client), (&migrated_db, &migrated_client)] {
        let before = schema(client).await;
        let e = client.batch_execute(&script).await.expect_err("refused");
        assert!(format!("{e:?}").contains("idem migrate"), "{e:?}");
        // Sent as one message, the rest of it was skipped: the transaction
        // it began is still open, aborted (psql would reach its COMMIT).
        client.batch_execute("ROLLBACK").await.expect("rolled back");
        assert_eq!(schema(client).await, before, "{}", db.url());
    }
}
