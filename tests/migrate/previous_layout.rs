//! Migration 15 converts the records the previous layout wrote (text labels
//! under seven CHECK constraints) and they read as before: a completed
//! record replays its value or its final error, an external claim past its
//! lease and an unknown outcome are still refused.

use diesel::sql_types::Text;
use idem::pool::{build_pool_with, PoolConfig};
use idem::{idempotent, Pool};
use serde::{Deserialize, Serialize};

use super::*;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Declined {
    why: String,
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] idem::Error),
    #[error("declined: {0:?}")]
    Declined(Declined),
}
idem::final_errors!(AppError::Declined(Declined));

#[idempotent(key = key, scope = none, fingerprint(n))]
async fn double(_conn: &mut AsyncPgConnection, key: &str, n: i64) -> Result<i64, AppError> {
    Ok(2 * n)
}

#[derive(QueryableByName, Debug, PartialEq)]
struct Text1 {
    #[diesel(sql_type = Text)]
    v: String,
}

async fn texts(conn: &mut AsyncPgConnection, sql: &str) -> Vec<String> {
    let rows: Vec<Text1> = diesel::sql_query(sql).load(conn).await.unwrap();
    rows.into_iter().map(|r| r.v).collect()
}

fn pool(url: &str) -> Pool {
    build_pool_with(url, &PoolConfig::default()).expect("a pool")
}

/// The operation and fingerprint (hex) `double(.., 5)` records, read from a
/// database of the current layout.
async fn probe() -> (String, String) {
    let db = idem_testing::TestDatabase::create().await.unwrap();
    let mut conn = AsyncPgConnection::establish(db.url()).await.unwrap();
    migrate(&mut conn).await.unwrap();
    double(&pool(db.url()), "probe", 5).await.expect("a record");
    let row = texts(
        &mut conn,
        "SELECT operation || ' ' || encode(fingerprint, 'hex') AS v FROM idem_requests",
    )
    .await;
    let (operation, fingerprint) = row[0].split_once(' ').unwrap();
    (operation.to_owned(), fingerprint.to_owned())
}

#[tokio::test]
async fn records_of_the_previous_layout_are_converted_and_read_as_before() {
    let (operation, fingerprint) = probe().await;
    let db = idem_testing::TestDatabase::create().await.unwrap();
    let mut conn = AsyncPgConnection::establish(db.url()).await.unwrap();
    // The database as a build with migrations 1..=14 left it.
    conn.batch_execute(
        "CREATE TABLE idem_schema_migrations (version integer PRIMARY KEY, name text NOT NULL, \
         checksum text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())",
    )
    .await
    .unwrap();
    for m in migrations().iter().filter(|m| m.version() <= 14) {
        conn.batch_execute(m.sql()).await.unwrap();
        diesel::sql_query(
            "INSERT INTO idem_schema_migrations (version, name, checksum) VALUES ($1, $2, $3)",
        )
        .bind::<Integer, _>(m.version())
        .bind::<Text, _>(m.name())
        .bind::<Text, _>(m.checksum())
        .execute(&mut conn)
        .await
        .unwrap();
    }
    let scope = idem::idempotency::scope_hash(&()).unwrap();
    let old = format!(
        "INSERT INTO idem_requests (scope, key, operation, fingerprint, mode, state, outcome, \
         response, expires_at, lease_until, owner) VALUES \
         ('{scope}', 'old-ok', '{operation}', decode('{fingerprint}', 'hex'), 'local', 'completed', 'ok', \
          '21', now() + interval '1 day', NULL, NULL), \
         ('{scope}', 'old-error', '{operation}', decode('{fingerprint}', 'hex'), 'local', 'completed', 'error', \
          '{{\"why\": \"no funds\"}}', now() + interval '1 day', NULL, NULL), \
         ('{scope}', 'old-claim', '{operation}', decode('{fingerprint}', 'hex'), 'external', 'in_progress', NULL, \
          NULL, now() + interval '1 day', now() - interval '1 minute', decode(repeat('ab', 16), 'hex')), \
         ('{scope}', 'old-unknown', '{operation}', decode('{fingerprint}', 'hex'), 'external', 'unknown', NULL, \
          NULL, now() + interval '1 day', NULL, decode(repeat('cd', 16), 'hex'))"
    );
    conn.batch_execute(&old)
        .await
        .expect("records of the previous layout");
    let before = texts(&mut conn, LABELS).await;

    let report = migrate(&mut conn).await.unwrap();
    let applied: Vec<i32> = report.applied.iter().map(|m| m.version()).collect();
    assert_eq!(<[i32]>::first(&applied), Some(&15), "{applied:?}");
    assert_eq!(texts(&mut conn, LABELS).await, before, "every label kept");
    assert_eq!(
        texts(
            &mut conn,
            "SELECT attname || ':' || atttypid::regtype::text AS v FROM pg_attribute \
             WHERE attrelid = 'idem_requests'::regclass AND attname IN ('mode', 'state', 'outcome') \
             ORDER BY attname"
        )
        .await,
        [
            "mode:idem_request_mode",
            "outcome:idem_request_outcome",
            "state:idem_request_state"
        ]
    );
    let checks = texts(
        &mut conn,
        "SELECT conname::text AS v FROM pg_constraint \
         WHERE conrelid = 'idem_requests'::regclass AND contype = 'c'",
    )
    .await;
    assert!(checks.is_empty(), "{checks:?}");

    let pool = pool(db.url());
    let ok = double(&pool, "old-ok", 5).await.expect("replayed");
    assert!(ok.replayed);
    assert_eq!(ok.value, 21, "the stored value, not a new run's 10");
    let declined = double(&pool, "old-error", 5).await;
    assert!(
        matches!(&declined, Err(AppError::Declined(d)) if d.why == "no funds"),
        "{declined:?}"
    );
    for key in ["old-claim", "old-unknown"] {
        let refused = double(&pool, key, 5).await;
        assert!(
            matches!(refused, Err(AppError::Idem(idem::Error::OutcomeUnknown))),
            "{key}: {refused:?}"
        );
    }
}

/// Every record's labels, one line each.
const LABELS: &str =
    "SELECT key || ' ' || mode || ' ' || state || ' ' || coalesce(outcome::text, '-') AS v \
                      FROM idem_requests ORDER BY key";
