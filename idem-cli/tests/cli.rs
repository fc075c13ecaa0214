//! The `idem` binary against real databases: a fresh one per test, with
//! records, events and jobs made by the library itself.

use std::process::Command;

use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idem::jobs::{enqueue, Enqueued, Job};
use idem::outbox::{emit, EmitError, Event, EventId};
use idem::pool::build_pool;
use idem::{idempotent, retryable, Pool};
use idem_testing::TestDatabase;
use serde::{Deserialize, Serialize};

mod common;
use common::{idem, json};

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Db(#[from] diesel::result::Error),
    #[error(transparent)]
    Idem(#[from] idem::Error),
    #[error(transparent)]
    Emit(#[from] EmitError),
    #[error(transparent)]
    Enqueue(#[from] idem::jobs::EnqueueError),
    #[error("refused")]
    Refused,
}

impl idem::IdempotentError for AppError {
    type Final = ();
    fn to_final(&self) -> Option<()> {
        None
    }
    fn from_final(_: ()) -> Self {
        AppError::Refused
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Paid {
    order: String,
}

impl Event for Paid {
    const KIND: &'static str = "paid";
    const VERSION: u32 = 1;
    fn key(&self) -> String {
        self.order.clone()
    }
}

impl Job for Paid {
    const KIND: &'static str = "refund";
    fn key(&self) -> String {
        self.order.clone()
    }
}

/// A payment: its record, an event and a compensation job, all by the library.
#[idempotent(key = key, scope = tenant, fingerprint(amount))]
async fn pay(
    conn: &mut AsyncPgConnection,
    tenant: i64,
    key: &str,
    amount: i64,
) -> Result<i64, AppError> {
    let paid = Paid {
        order: format!("order-{amount}"),
    };
    let _: EventId = emit(conn, &paid).await?;
    let _: Enqueued = enqueue(conn, &paid).await?;
    Ok(amount * 100)
}

#[retryable(max = 2)]
async fn noop(_conn: &mut AsyncPgConnection) -> Result<(), AppError> {
    Ok(())
}

async fn migrated(db: &TestDatabase) -> Pool {
    let pool = build_pool(db.url()).expect("pool");
    let mut conn = pool.get().await.expect("conn");
    idem::migrate(&mut conn).await.expect("migrated");
    drop(conn);
    noop(&pool).await.expect("a transaction runs");
    pool
}

#[tokio::test]
async fn migrate_status_and_doctor_before_and_after() {
    let db = TestDatabase::create().await.expect("database");
    let url = db.url();

    let (code, out, _) = idem(url, &["migrate", "status"]);
    assert_eq!(code, 1, "pending migrations: {out}");
    assert!(
        out.contains("1        version_guard") && out.contains("pending"),
        "{out}"
    );

    let (code, out, err) = idem(url, &["doctor"]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("FAIL  migrations"), "{out}");
    let last = idem::migrate::migrations().last().expect("migrations");
    assert!(
        out.contains("1 version_guard")
            && out.contains(&format!("{} {}", last.version(), last.name())),
        "{out}"
    );
    assert!(out.contains("fix: run `idem migrate`"), "{out}");

    let (code, out, _) = idem(url, &["--json", "migrate"]);
    assert_eq!(code, 0, "{out}");
    let applied = json(&out);
    assert_eq!(
        applied.as_array().map(Vec::len),
        Some(idem::migrate::migrations().len())
    );

    let (code, out, _) = idem(url, &["migrate"]);
    assert_eq!(code, 0);
    assert!(out.contains("nothing to apply"), "{out}");

    let (code, out, _) = idem(url, &["--json", "migrate", "status"]);
    assert_eq!(code, 0, "{out}");
    let status = json(&out);
    assert_eq!(status["pending"].as_array().map(Vec::len), Some(0), "{out}");

    let (code, out, err) = idem(url, &["doctor", "--pool-size", "10"]);
    assert_eq!(code, 0, "{out}{err}");
    for name in [
        "server",
        "migrations",
        "version guards",
        "connections",
        "pooler",
        "replication",
        "backlog",
    ] {
        assert!(out.contains(name), "{name} missing: {out}");
    }
    let (code, out, _) = idem(url, &["doctor", "--json", "--pool-size", "100000"]);
    assert_eq!(code, 1, "a pool bigger than max_connections fails: {out}");
    let report = json(&out);
    assert_eq!(report["ok"], false);
    let connections = report["checks"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["name"] == "connections"))
        .expect("a connections check");
    assert_eq!(connections["state"], "fail", "{out}");
}

#[tokio::test]
async fn records_events_and_jobs_made_by_the_library() {
    let db = TestDatabase::create().await.expect("database");
    let url = db.url();
    let pool = migrated(&db).await;
    assert_eq!(
        pay(&pool, 7, "pay-1", 12).await.expect("paid").into_inner(),
        1200
    );

    // The record, under its scope value.
    let (code, out, _) = idem(url, &["key", "show", "--scope", "7", "pay-1"]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("completed") && out.contains("(hidden"),
        "{out}"
    );
    assert!(!out.contains("1200"), "the response is hidden: {out}");
    let (code, out, _) = idem(
        url,
        &[
            "--json",
            "key",
            "show",
            "--scope",
            "7",
            "pay-1",
            "--show-response",
        ],
    );
    assert_eq!(code, 0);
    let rec = json(&out);
    assert_eq!(rec["state"], "completed");
    assert_eq!(rec["outcome"], "ok");
    assert_eq!(rec["response"], 1200);
    assert_eq!(rec["fingerprint"].as_str().map(str::len), Some(64));
    let (code, out, _) = idem(url, &["--json", "key", "show", "--scope", "7", "pay-1"]);
    assert_eq!(code, 0);
    assert!(json(&out).get("response").is_none(), "{out}");
    let (code, _, err) = idem(url, &["key", "show", "--scope", "8", "pay-1"]);
    assert_eq!(code, 1, "another tenant's key is not there");
    assert!(err.contains("no record"), "{err}");

    // The event and the job die as the relay and the worker would park them.
    let mut conn = pool.get().await.expect("conn");
    diesel::sql_query(
        "UPDATE idem_outbox SET state = 'dead', attempts = 5, last_error = 'the broker refused'",
    )
    .execute(&mut conn)
    .await
    .expect("event parked");
    diesel::sql_query(
        "UPDATE idem_jobs SET state = 'dead', attempts = 3, last_error = 'the bank said no', failed_at = now()",
    )
    .execute(&mut conn)
    .await
    .expect("job parked");

    let (code, out, _) = idem(url, &["--json", "outbox", "stats"]);
    assert_eq!(code, 0);
    assert_eq!(json(&out)["dead"], 1, "{out}");
    let (code, out, _) = idem(url, &["outbox", "dead"]);
    assert_eq!(code, 0);
    assert!(
        out.contains("order-12") && out.contains("the broker refused"),
        "{out}"
    );
    let (_, out, _) = idem(url, &["--json", "outbox", "dead"]);
    let id = json(&out)[0]["id"].as_str().expect("an id").to_owned();
    let (code, out, _) = idem(url, &["outbox", "requeue", &id]);
    assert_eq!(code, 0, "{out}");
    let (code, _, _) = idem(url, &["outbox", "requeue", &id]);
    assert_eq!(code, 1, "not dead any more");
    let (_, out, _) = idem(url, &["--json", "outbox", "stats"]);
    assert_eq!(
        (json(&out)["dead"].clone(), json(&out)["pending"].clone()),
        (0.into(), 1.into())
    );
    // An id that is no UUID is a usage error, as for `jobs` (exit 2).
    let (code, _, err) = idem(url, &["outbox", "discard", "not-a-uuid"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("not an event id (a UUID)"), "{err}");

    let (code, out, _) = idem(url, &["jobs", "dead"]);
    assert_eq!(code, 0);
    assert!(
        out.contains("refund") && out.contains("the bank said no"),
        "{out}"
    );
    // Payloads are hidden unless asked for, in text and in JSON.
    let payload = serde_json::json!({"order": "order-12"});
    assert!(
        out.contains(&format!("hidden, {} B", payload.to_string().len())),
        "{out}"
    );
    assert!(!out.contains("{\"order\""), "the payload is hidden: {out}");
    let (code, out, _) = idem(url, &["--json", "jobs", "dead"]);
    assert_eq!(code, 0);
    let rows = json(&out);
    assert_eq!(rows.as_array().map(Vec::len), Some(1), "{out}");
    assert!(rows[0].get("payload").is_none(), "{out}");
    assert_eq!(rows[0]["payload_bytes"], payload.to_string().len(), "{out}");
    assert!(!out.contains("order-12\"}"), "{out}");
    let (code, out, _) = idem(url, &["--json", "jobs", "dead", "--show-payload"]);
    assert_eq!(code, 0);
    assert_eq!(json(&out)[0]["payload"], payload, "{out}");
    let (code, out, _) = idem(url, &["jobs", "dead", "--show-payload"]);
    assert_eq!(code, 0);
    assert!(out.contains(&payload.to_string()), "{out}");
    let (code, out, _) = idem(
        url,
        &["--json", "jobs", "requeue", "--all", "--limit", "10"],
    );
    assert_eq!(code, 0, "{out}");
    assert_eq!(json(&out)[0]["result"], "due", "{out}");
    let (_, out, _) = idem(url, &["--json", "jobs", "stats"]);
    assert_eq!(
        (json(&out)["dead"].clone(), json(&out)["due"].clone()),
        (0.into(), 1.into())
    );

    // Retention: the record expires, the purge deletes it.
    diesel::sql_query("UPDATE idem_requests SET expires_at = now() - interval '1 second'")
        .execute(&mut conn)
        .await
        .expect("expired");
    let (code, out, _) = idem(url, &["--json", "purge", "--expired"]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(json(&out)["deleted"], 1, "{out}");
    let (code, _, _) = idem(url, &["key", "show", "--scope", "7", "pay-1"]);
    assert_eq!(code, 1, "purged");

    let (code, out, _) = idem(url, &["inbox", "stats"]);
    assert_eq!((code, out.as_str()), (0, "(none)\n"));
}

#[test]
fn usage_errors_exit_2_and_bad_urls_exit_1_in_one_line() {
    let (code, _, err) = idem("postgres://x@127.0.0.1:1/db", &["outbox"]);
    assert_eq!(code, 2, "{err}");
    let (code, _, _) = idem("postgres://x@127.0.0.1:1/db", &["purge"]);
    assert_eq!(code, 2, "--expired is required");
    let (code, _, _) = idem(
        "postgres://x@127.0.0.1:1/db",
        &["key", "show", "--scope", "{", "k"],
    );
    assert_eq!(code, 2, "a scope that is not JSON");

    let (code, out, err) = idem("postgres://x@127.0.0.1:1/db", &["outbox", "stats"]);
    assert_eq!(code, 1, "{out}{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with("idem: ") && !err.contains("panicked"),
        "{err}"
    );
    let (code, _, err) = idem("not a url", &["jobs", "stats"]);
    assert_eq!(code, 1, "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");

    // --print-sql needs no database.
    let (code, out, _) = idem("postgres://x@127.0.0.1:1/db", &["migrate", "--print-sql"]);
    assert_eq!(code, 0);
    assert!(out.contains("-- idem migration 1 (version_guard)"), "{out}");
}

/// What a hostile pass broke: a limit of 0 requeued one, a duration that
/// overflows wrapped (or panicked), a closed pipe or a full disk gave a
/// panic's exit 101, and a refused connection said only "db error".
#[test]
fn limits_durations_pipes_and_refused_connections() {
    let url = "postgres://x@127.0.0.1:1/db";
    for args in [
        &["outbox", "requeue", "--all", "--limit", "0"][..],
        &["jobs", "requeue", "--all", "--limit", "0"],
        &["outbox", "dead", "--limit", "0"],
        &[
            "purge",
            "--expired",
            "--outbox-sent-older-than",
            "999999999999999999h",
        ],
        &[
            "inbox",
            "purge",
            "--consumer",
            "c",
            "--older-than",
            "213503982334602d",
        ],
    ] {
        let (code, _, err) = idem(url, args);
        assert_eq!(code, 2, "{args:?}: {err}");
    }

    // The output goes nowhere: a reader that stopped is no error, a full
    // disk is one line and exit 1.
    let full = std::fs::File::create("/dev/full").expect("/dev/full");
    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["--database-url", url, "migrate", "--print-sql"])
        .stdout(full)
        .output()
        .expect("the binary runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    let mut child = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["--database-url", url, "migrate", "--print-sql"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the binary runs");
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("it ends");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // The server's reason, not "db error" alone.
    let server = idem_testing::server_url().expect("a PostgreSQL server");
    if let Some((_, rest)) = server.split_once('@') {
        let (code, _, err) = idem(&format!("postgres://no_such_role_here@{rest}"), &["doctor"]);
        assert_eq!(code, 1, "{err}");
        assert!(err.contains("no_such_role_here"), "{err}");
    }
}

/// A claim whose lease still runs (its request may still be calling the
/// target) is not settled without `--force`: a retry released now could run
/// beside it.
#[tokio::test]
async fn a_live_claim_is_settled_only_with_force() {
    let db = TestDatabase::create().await.expect("a database");
    drop(migrated(&db).await);
    let scope = idem::idempotency::scope_hash(&7_i64).expect("scope");
    let client = idem_testing::connect(db.url()).await.expect("connect");
    tokio_postgres::Client::execute(
        &client,
        "INSERT INTO idem_requests (scope, key, operation, fingerprint, mode, state,
                                        expires_at, lease_until, owner)
             VALUES ($1, 'live', 'refund', decode(repeat('00', 32), 'hex'), 'external',
                     'in_progress', now() + interval '1 day', now() + interval '10 minutes',
                     decode(repeat('11', 16), 'hex'))",
        &[&scope],
    )
    .await
    .expect("a live claim");
    // Released, the record is gone.
    let state = || async {
        client
            .query_opt(
                "SELECT state::text FROM idem_requests WHERE key = 'live'",
                &[],
            )
            .await
            .expect("the record")
            .map(|row| row.get::<_, String>(0))
    };
    let (code, _, err) = idem(
        db.url(),
        &["key", "settle", "--scope", "7", "live", "--released"],
    );
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("--force"), "{err}");
    assert_eq!(state().await.as_deref(), Some("in_progress"), "untouched");
    let (code, _, err) = idem(
        db.url(),
        &[
            "key",
            "settle",
            "--scope",
            "7",
            "live",
            "--released",
            "--force",
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(state().await, None, "released with --force");
}

/// A record held as outcome unknown outlives its retention: no purge
/// deletes it and no call takes it over, so `key show` never calls it
/// expired (it did, and said a purge might delete it).
#[tokio::test]
async fn an_unknown_record_past_its_retention_is_kept_until_settled() {
    let db = TestDatabase::create().await.expect("a database");
    drop(migrated(&db).await);
    let scope = idem::idempotency::scope_hash(&7_i64).expect("scope");
    let client = idem_testing::connect(db.url()).await.expect("connect");
    tokio_postgres::Client::execute(
        &client,
        "INSERT INTO idem_requests (scope, key, operation, fingerprint, mode, state, expires_at)
             VALUES ($1, 'held', 'pay', decode(repeat('00', 32), 'hex'), 'local', 'unknown',
                     now() - interval '1 hour')",
        &[&scope],
    )
    .await
    .expect("a held record past its retention");
    let (code, out, _) = idem(db.url(), &["--json", "key", "show", "--scope", "7", "held"]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(json(&out)["state"], "unknown", "{out}");
    assert_eq!(json(&out)["expired"], false, "{out}");
    let (code, out, _) = idem(db.url(), &["key", "show", "--scope", "7", "held"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("kept until settled"), "{out}");
    let (code, out, _) = idem(db.url(), &["--json", "purge", "--expired"]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(json(&out)["deleted"], 0, "{out}");
    let (code, out, _) = idem(db.url(), &["--json", "key", "show", "--scope", "7", "held"]);
    assert_eq!(
        (code, json(&out)["state"].clone()),
        (0, "unknown".into()),
        "{out}"
    );
}
