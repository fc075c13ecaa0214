//! Versions never repeat for one identity: a deleted row leaves a tombstone,
//! and a row inserted again with its identity starts above it, so a version
//! (an ETag) read from the old row never matches the new one.

use std::time::Duration;

use idem::http::etag::{etag_for_version, IfMatch};

use super::*;

fn edit(n: i64) -> Edit {
    Edit {
        body: serde_json::json!({ "edit": n }),
    }
}

fn document(tenant_id: i64, document_id: i64) -> Document {
    Document {
        tenant_id,
        document_id,
        body: serde_json::json!({"new": true}),
        status: "draft".into(),
        version: 0,
    }
}

/// The version of document `id` of tenant 1, read over `raw`.
async fn version_of(raw: &tokio_postgres::Client, id: i64) -> i64 {
    raw.query_one(
        "SELECT version FROM documents WHERE tenant_id = 1 AND document_id = $1",
        &[&id],
    )
    .await
    .unwrap()
    .get(0)
}

#[tokio::test]
async fn an_old_etag_never_matches_a_re_created_row() {
    let mut f = guarded().await;
    let mut version = 0;
    for n in 1..=3 {
        version = Document::update(1)
            .tenant(1)
            .expect_version(version)
            .set(&edit(n))
            .execute(&mut f.conn)
            .await
            .unwrap()
            .version;
    }
    assert_eq!(version, 3);
    let old_etag = etag_for_version(version);
    Document::delete(1)
        .tenant(1)
        .expect_version(3)
        .execute(&mut f.conn)
        .await
        .unwrap();

    // Inserted at version 0 as always; stored (and returned) one past the
    // deleted row's last version.
    let again = document(1, 1).insert(&mut f.conn).await.unwrap();
    assert_eq!(again.version, 4);

    // Every version the old row ever had matches nothing now: the UPDATE the
    // versioned builder issues, `WHERE .. AND version = <old>`, writes no row.
    for old in 0..=3 {
        let n = diesel::update(
            documents::table
                .filter(documents::tenant_id.eq(1))
                .filter(documents::document_id.eq(1))
                .filter(documents::version.eq(old)),
        )
        .set((
            documents::body.eq(serde_json::json!({"stale": old})),
            documents::version.eq(documents::version + 1),
        ))
        .execute(&mut f.conn)
        .await
        .unwrap();
        assert_eq!(n, 0, "version {old} of the deleted row matched the new one");
    }

    // The same through `If-Match`: the old ETag is stale, and stays stale as
    // the new row moves on, since its versions only go up from 4.
    let expected = IfMatch::parse(&old_etag)
        .unwrap()
        .expected_version()
        .unwrap()
        .unwrap();
    let err = Document::update(1)
        .tenant(1)
        .expect_version(expected)
        .set(&edit(9))
        .execute(&mut f.conn)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            VersionedError::Stale {
                expected: 3,
                actual: 4
            }
        ),
        "{err:?}"
    );
    let newest = Document::update(1)
        .tenant(1)
        .expect_version(4)
        .set(&edit(10))
        .execute(&mut f.conn)
        .await
        .unwrap();
    assert_eq!(newest.version, 5);
    assert_eq!(newest.body, serde_json::json!({"edit": 10}));
}

#[tokio::test]
async fn raw_sql_deletes_and_inserts_keep_counting() {
    let mut f = guarded().await;
    f.raw
        .batch_execute(
            "UPDATE documents SET version = version + 1 WHERE document_id = 1; \
             UPDATE documents SET version = version + 1 WHERE document_id = 1",
        )
        .await
        .unwrap();
    // Each incarnation starts one past the last version of the one before.
    for expected in [3, 4, 5] {
        f.raw
            .batch_execute(
                "DELETE FROM documents WHERE document_id = 1; \
                 INSERT INTO documents VALUES (1, 1, '{}', 'draft', 0)",
            )
            .await
            .unwrap();
        assert_eq!(version_of(&f.raw, 1).await, expected);
    }
    // A higher version given by the INSERT is kept (a restore, say).
    f.raw
        .batch_execute(
            "DELETE FROM documents WHERE document_id = 1; \
             INSERT INTO documents VALUES (1, 1, '{}', 'draft', 40)",
        )
        .await
        .unwrap();
    assert_eq!(version_of(&f.raw, 1).await, 40);

    // Tombstones are per identity: the same document number in another
    // tenant, and another document of the same tenant, start at 0.
    let other_tenant = document(2, 1).insert(&mut f.conn).await.unwrap();
    assert_eq!(other_tenant.version, 0);
    let other_document = document(1, 4).insert(&mut f.conn).await.unwrap();
    assert_eq!(other_document.version, 0);

    // Upserts still work: the INSERT half finds the live row, the UPDATE half
    // is checked like any UPDATE.
    f.raw
        .batch_execute(
            "INSERT INTO documents VALUES (1, 1, '{\"up\": 1}', 'draft', 0) \
             ON CONFLICT (tenant_id, document_id) DO UPDATE \
             SET body = EXCLUDED.body, version = documents.version + 1; \
             INSERT INTO documents VALUES (1, 2, '{}', 'draft', 0) ON CONFLICT DO NOTHING",
        )
        .await
        .unwrap();
    assert_eq!(version_of(&f.raw, 1).await, 41);
    assert_eq!(version_of(&f.raw, 2).await, 0);
}

#[tokio::test]
async fn narrow_version_columns_and_composite_text_keys_work_too() {
    let db = idem_testing::TestDatabase::create().await.unwrap();
    let mut conn = AsyncPgConnection::establish(db.url()).await.unwrap();
    idem::migrate(&mut conn).await.unwrap();
    conn.batch_execute(
        "CREATE TABLE settings (scope text NOT NULL, name text NOT NULL, value text, \
                                revision smallint NOT NULL DEFAULT 0, PRIMARY KEY (scope, name)); \
         INSERT INTO settings VALUES ('app', 'theme', 'dark', 0), ('app', 'lang', 'en', 0)",
    )
    .await
    .unwrap();
    install_version_guard_on(&mut conn, "settings", "revision", &["scope", "name"])
        .await
        .unwrap();
    let raw = raw_client(db.url()).await;
    raw.batch_execute(
        "UPDATE settings SET value = 'light', revision = revision + 1 WHERE name = 'theme'; \
         DELETE FROM settings WHERE name = 'theme'; \
         INSERT INTO settings (scope, name, value) VALUES ('app', 'theme', 'blue')",
    )
    .await
    .unwrap();
    let revision: i16 = raw
        .query_one("SELECT revision FROM settings WHERE name = 'theme'", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(revision, 2);
    let err = raw_error(
        &raw,
        "UPDATE settings SET scope = 'user', revision = revision + 1",
    )
    .await;
    assert_eq!(err.code(), &SqlState::from_code("IDV03"));
    assert_eq!(err.column(), Some("scope"));
}

/// Waits until a session of this test's database waits on a lock.
async fn until_someone_waits_on_a_lock(conn: &mut AsyncPgConnection) {
    for _ in 0..500 {
        let waiting = diesel::sql_query(
            "SELECT count(*) AS n FROM pg_stat_activity \
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .get_result::<Count>(conn)
        .await
        .unwrap()
        .n;
        if waiting > 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the INSERT never waited for the DELETE");
}

#[tokio::test]
async fn an_insert_racing_an_uncommitted_delete_waits_and_counts_on() {
    let mut f = guarded().await;
    f.raw
        .batch_execute(
            "UPDATE documents SET version = version + 1 WHERE document_id = 1; \
             BEGIN; DELETE FROM documents WHERE document_id = 1",
        )
        .await
        .unwrap();
    // READ COMMITTED, like idem's default. Started while the DELETE is
    // uncommitted: the row it replaces is still there.
    let inserter = raw_client(f.db.url()).await;
    let insert = tokio::spawn(async move {
        inserter
            .query_one(
                "INSERT INTO documents VALUES (1, 1, '{}', 'draft', 0) RETURNING version",
                &[],
            )
            .await
            .map(|row| row.get::<_, i64>(0))
    });
    until_someone_waits_on_a_lock(&mut f.conn).await;
    f.raw.batch_execute("COMMIT").await.unwrap();
    let version = insert.await.unwrap().unwrap();
    assert_eq!(
        version, 2,
        "the INSERT must see the tombstone of the DELETE it waited for"
    );
}

#[tokio::test]
async fn under_repeatable_read_an_insert_after_a_concurrent_delete_is_retryable() {
    let f = guarded().await;
    let inserter = raw_client(f.db.url()).await;
    inserter
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM documents")
        .await
        .unwrap();
    // Committed after the inserter's snapshot: its tombstone is invisible to
    // that snapshot, so the INSERT cannot know the version to start from.
    f.raw
        .batch_execute(
            "UPDATE documents SET version = version + 1 WHERE document_id = 1; \
             DELETE FROM documents WHERE document_id = 1",
        )
        .await
        .unwrap();
    let err = inserter
        .batch_execute("INSERT INTO documents VALUES (1, 1, '{}', 'draft', 0)")
        .await
        .unwrap_err();
    assert_eq!(
        err.as_db_error().map(|e| e.code()),
        Some(&SqlState::T_R_SERIALIZATION_FAILURE),
        "{err:?}"
    );
    // The retry, in a new transaction, sees the tombstone.
    inserter.batch_execute("ROLLBACK").await.unwrap();
    inserter
        .batch_execute(
            "BEGIN ISOLATION LEVEL REPEATABLE READ; \
             INSERT INTO documents VALUES (1, 1, '{}', 'draft', 0); COMMIT",
        )
        .await
        .unwrap();
    assert_eq!(version_of(&f.raw, 1).await, 2);
}

async fn tombstone_count(conn: &mut AsyncPgConnection) -> i64 {
    diesel::sql_query("SELECT count(*) AS n FROM idem_version_tombstones")
        .get_result::<Count>(conn)
        .await
        .unwrap()
        .n
}

#[tokio::test]
async fn purging_removes_old_tombstones_only() {
    let mut f = guarded().await;
    f.raw
        .batch_execute(
            "UPDATE documents SET version = version + 1 WHERE document_id IN (1, 2); \
             DELETE FROM documents WHERE document_id IN (1, 2)",
        )
        .await
        .unwrap();
    assert_eq!(tombstone_count(&mut f.conn).await, 2);
    // Nothing is an hour old, and nothing is older than the longest duration.
    let purged = purge_version_tombstones(&mut f.conn, Duration::from_secs(3600))
        .await
        .unwrap();
    assert_eq!(purged, 0);
    let purged = purge_version_tombstones(&mut f.conn, Duration::MAX)
        .await
        .unwrap();
    assert_eq!(purged, 0);
    assert_eq!(tombstone_count(&mut f.conn).await, 2);

    // `deleted_at` is the DELETE's transaction start; a later transaction's
    // now() is past it.
    tokio::time::sleep(Duration::from_millis(5)).await;
    let purged = purge_version_tombstones(&mut f.conn, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(purged, 2);
    assert_eq!(tombstone_count(&mut f.conn).await, 0);
    // The documented price: a purged identity starts over.
    let again = document(1, 1).insert(&mut f.conn).await.unwrap();
    assert_eq!(again.version, 0);
}
