//! idem's embedded migrations against a real PostgreSQL: applied once, safe to
//! repeat and to race, and never silently re-applied when tampered with.

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Integer, Text};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idem::migrate::{migrate, migrations, MigrateError};

#[path = "migrate/previous_layout.rs"]
mod previous_layout;

#[derive(QueryableByName, Debug, PartialEq)]
struct Row {
    #[diesel(sql_type = Integer)]
    version: i32,
    #[diesel(sql_type = Text)]
    name: String,
    #[diesel(sql_type = Text)]
    checksum: String,
}

async fn recorded(conn: &mut AsyncPgConnection) -> Vec<Row> {
    diesel::sql_query("SELECT version, name, checksum FROM idem_schema_migrations ORDER BY version")
        .load(conn)
        .await
        .unwrap()
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

async fn guard_function_count(conn: &mut AsyncPgConnection) -> i64 {
    diesel::sql_query("SELECT count(*) AS n FROM pg_proc WHERE proname = 'idem_version_guard'")
        .get_result::<Count>(conn)
        .await
        .unwrap()
        .n
}

fn embedded_rows() -> Vec<Row> {
    migrations()
        .iter()
        .map(|m| Row {
            version: m.version(),
            name: m.name().to_owned(),
            checksum: m.checksum(),
        })
        .collect()
}

#[tokio::test]
async fn second_run_applies_nothing() {
    let db = idem_testing::TestDatabase::create().await.unwrap();
    let mut conn = AsyncPgConnection::establish(db.url()).await.unwrap();

    let first = migrate(&mut conn).await.unwrap();
    assert_eq!(first.applied, migrations());
    assert!(first.already_applied.is_empty());
    assert!(first.unknown.is_empty());
    assert_eq!(recorded(&mut conn).await, embedded_rows());
    assert_eq!(guard_function_count(&mut conn).await, 1);

    let second = migrate(&mut conn).await.unwrap();
    assert!(second.applied.is_empty(), "{second:?}");
    assert_eq!(second.already_applied, migrations());
    assert_eq!(recorded(&mut conn).await, embedded_rows());
}

#[tokio::test]
async fn every_object_is_commented() {
    let db = idem_testing::TestDatabase::create().await.unwrap();
    let mut conn = AsyncPgConnection::establish(db.url()).await.unwrap();
    migrate(&mut conn).await.unwrap();

    let uncommented: i64 = diesel::sql_query(
        "SELECT count(*) AS n FROM pg_attribute a \
         WHERE a.attrelid IN ('idem_schema_migrations'::regclass, 'idem_version_tombstones'::regclass) \
           AND a.attnum > 0 AND NOT a.attisdropped \
           AND col_description(a.attrelid, a.attnum) IS NULL",
    )
    .get_result::<Count>(&mut conn)
    .await
    .unwrap()
    .n;
    assert_eq!(uncommented, 0);
    let commented: i64 = diesel::sql_query(
        "SELECT count(*) AS n WHERE obj_description('idem_schema_migrations'::regclass, 'pg_class') IS NOT NULL \
           AND obj_description('idem_version_guard()'::regprocedure, 'pg_proc') LIKE '%IDV01%IDV03%' \
           AND obj_description('idem_version_tombstones'::regclass, 'pg_class') IS NOT NULL \
           AND obj_description('idem_purge_version_tombstones(interval)'::regprocedure, 'pg_proc') IS NOT NULL",
    )
    .get_result::<Count>(&mut conn)
    .await
    .unwrap()
    .n;
    assert_eq!(commented, 1);
}

#[tokio::test]
async fn concurrent_runs_all_succeed_and_apply_each_migration_once() {
    // Several rounds on fresh databases: the race is in the first run.
    for _ in 0..3 {
        let db = idem_testing::TestDatabase::create().await.unwrap();
        let mut tasks = Vec::new();
        for _ in 0..4 {
            let url = db.url().to_owned();
            tasks.push(tokio::spawn(async move {
                let mut conn = AsyncPgConnection::establish(&url).await.unwrap();
                migrate(&mut conn).await
            }));
        }
        let mut applied = Vec::new();
        for task in tasks {
            let report = task.await.unwrap().unwrap();
            assert_eq!(
                report.applied.len() + report.already_applied.len(),
                migrations().len(),
                "{report:?}"
            );
            applied.extend(report.applied);
        }
        applied.sort_by_key(|m| m.version());
        assert_eq!(applied, migrations(), "each migration applied exactly once");

        let mut conn = AsyncPgConnection::establish(db.url()).await.unwrap();
        assert_eq!(recorded(&mut conn).await, embedded_rows());
        assert_eq!(guard_function_count(&mut conn).await, 1);
    }
}

#[tokio::test]
async fn tampered_checksum_is_a_typed_error_and_nothing_is_reapplied() {
    let db = idem_testing::TestDatabase::create().await.unwrap();
    let mut conn = AsyncPgConnection::establish(db.url()).await.unwrap();
    migrate(&mut conn).await.unwrap();

    // If migration 1 were re-applied, the function would come back.
    conn.batch_execute(
        "UPDATE idem_schema_migrations SET checksum = 'tampered' WHERE version = 1; \
         DROP FUNCTION idem_version_guard();",
    )
    .await
    .unwrap();

    let err = migrate(&mut conn).await.unwrap_err();
    match &err {
        MigrateError::ChecksumMismatch {
            version,
            name,
            recorded,
            embedded,
        } => {
            assert_eq!(*version, 1);
            assert_eq!(*name, "version_guard");
            assert_eq!(recorded, "tampered");
            assert_eq!(*embedded, migrations()[0].checksum());
        }
        other => panic!("expected ChecksumMismatch, got {other:?}"),
    }
    assert!(err.to_string().contains("not applied again"), "{err}");
    assert_eq!(guard_function_count(&mut conn).await, 0);
    let rows = recorded(&mut conn).await;
    assert_eq!(rows.len(), migrations().len(), "nothing recorded anew");
    assert_eq!(rows[0].checksum, "tampered");
}

#[tokio::test]
async fn versions_from_a_newer_build_are_reported_not_touched() {
    let db = idem_testing::TestDatabase::create().await.unwrap();
    let mut conn = AsyncPgConnection::establish(db.url()).await.unwrap();
    migrate(&mut conn).await.unwrap();
    conn.batch_execute(
        "INSERT INTO idem_schema_migrations (version, name, checksum) VALUES (9999, 'future', 'abc')",
    )
    .await
    .unwrap();

    let report = migrate(&mut conn).await.unwrap();
    assert_eq!(report.unknown, vec![9999]);
    assert!(report.applied.is_empty());
    assert_eq!(recorded(&mut conn).await.len(), migrations().len() + 1);
}

#[tokio::test]
async fn inside_a_transaction_is_refused() {
    let db = idem_testing::TestDatabase::create().await.unwrap();
    let mut conn = AsyncPgConnection::establish(db.url()).await.unwrap();
    let err = conn
        .transaction::<(), MigrateError, _>(async |conn| {
            migrate(conn).await?;
            Ok(())
        })
        .await
        .unwrap_err();
    assert!(matches!(err, MigrateError::Database(_)), "{err:?}");
    // Nothing was created: the outer transaction rolled back.
    let tables: i64 = diesel::sql_query(
        "SELECT count(*) AS n FROM pg_class WHERE relname = 'idem_schema_migrations'",
    )
    .get_result::<Count>(&mut conn)
    .await
    .unwrap()
    .n;
    assert_eq!(tables, 0);
}
