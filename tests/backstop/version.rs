//! The version check: an UPDATE must set the version to exactly old + 1.

use super::*;

#[tokio::test]
async fn update_without_bump_fails_with_the_documented_sqlstate() {
    let mut f = guarded().await;
    let err = raw_error(
        &f.raw,
        r#"UPDATE documents SET body = '{"n": 100}' WHERE tenant_id = 1 AND document_id = 1"#,
    )
    .await;
    assert_eq!(err.code(), &SqlState::from_code(VERSION_GUARD_SQLSTATE));
    assert_eq!(VERSION_GUARD_SQLSTATE, "IDV01");
    assert_eq!(
        err.message(),
        "idem_version_guard: UPDATE of public.documents changes version from 0 to 0; \
         every UPDATE must set it to exactly 1 (old version + 1)"
    );
    assert_eq!(err.detail(), Some("old version 0, new version 0"));
    assert_eq!(err.schema(), Some("public"));
    assert_eq!(err.table(), Some("documents"));
    assert_eq!(err.column(), Some("version"));
    assert!(
        err.hint().unwrap().contains("version = version + 1"),
        "{err:?}"
    );
    assert_eq!(rows(&mut f.conn).await, untouched());
}

#[tokio::test]
async fn bump_by_two_fails() {
    let mut f = guarded().await;
    let err = raw_error(
        &f.raw,
        "UPDATE documents SET version = version + 2 WHERE document_id = 2",
    )
    .await;
    assert_eq!(err.code(), &SqlState::from_code("IDV01"));
    assert!(
        err.message().contains("changes version from 0 to 2"),
        "{err:?}"
    );
    let err = raw_error(
        &f.raw,
        "UPDATE documents SET version = 0 WHERE document_id = 2",
    )
    .await;
    assert_eq!(err.code(), &SqlState::from_code("IDV01"));
    assert_eq!(rows(&mut f.conn).await, untouched());
}

#[tokio::test]
async fn bulk_update_that_forgets_the_version_changes_no_row() {
    let mut f = guarded().await;
    // Two of the three rows would be fine; the statement fails as a whole.
    let err = raw_error(
        &f.raw,
        "UPDATE documents SET body = '{}', \
         version = CASE WHEN document_id = 3 THEN version ELSE version + 1 END",
    )
    .await;
    assert_eq!(err.code(), &SqlState::from_code("IDV01"));
    assert_eq!(rows(&mut f.conn).await, untouched());

    // A bulk update that bumps every row passes: the guard checks the bump only.
    let n = tokio_postgres::Client::execute(
        &f.raw,
        "UPDATE documents SET body = '{}', version = version + 1",
        &[],
    )
    .await
    .unwrap();
    assert_eq!(n, 3);
    assert!(rows(&mut f.conn).await.iter().all(|(_, _, _, v)| *v == 1));
}

#[tokio::test]
async fn through_diesel_the_violation_is_recognisable() {
    let mut f = guarded().await;
    let err = diesel::update(documents::table.filter(documents::document_id.eq(1)))
        .set(documents::status.eq("published"))
        .execute(&mut f.conn)
        .await
        .unwrap_err();
    assert!(is_version_guard_violation(&err), "{err:?}");
    match &err {
        diesel::result::Error::DatabaseError(DatabaseErrorKind::Unknown, info) => {
            assert_eq!(info.table_name(), Some("documents"));
            assert_eq!(info.column_name(), Some("version"));
        }
        other => panic!("unexpected error {other:?}"),
    }
    // The trigger runs before the CHECK constraint: -1 is refused as no bump.
    let backwards = diesel::update(documents::table.filter(documents::document_id.eq(1)))
        .set(documents::version.eq(-1))
        .execute(&mut f.conn)
        .await
        .unwrap_err();
    assert!(is_version_guard_violation(&backwards), "{backwards:?}");
    // Other database errors are not mistaken for it.
    let check = diesel::insert_into(documents::table)
        .values((
            documents::tenant_id.eq(1),
            documents::document_id.eq(9),
            documents::body.eq(serde_json::json!({})),
            documents::status.eq("draft"),
            documents::version.eq(-1),
        ))
        .execute(&mut f.conn)
        .await
        .unwrap_err();
    assert!(!is_version_guard_violation(&check), "{check:?}");
}

#[tokio::test]
async fn versioned_writes_still_work() {
    let mut f = guarded().await;
    let edit = Edit {
        body: serde_json::json!({"edited": true}),
    };
    let written = Document::update(1)
        .tenant(1)
        .expect_version(0)
        .set(&edit)
        .execute(&mut f.conn)
        .await
        .unwrap();
    assert_eq!(written.version, 1);
    assert_eq!(written.body, serde_json::json!({"edited": true}));
    let written = Document::update(1)
        .tenant(1)
        .expect_version(1)
        .expect_state("draft".into())
        .set(&edit)
        .execute(&mut f.conn)
        .await
        .unwrap();
    assert_eq!(written.version, 2);
    // The guard does not change how conflicts are reported.
    let err = Document::update(1)
        .tenant(1)
        .expect_version(0)
        .set(&edit)
        .execute(&mut f.conn)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            VersionedError::Stale {
                expected: 0,
                actual: 2
            }
        ),
        "{err:?}"
    );
    // A guarded delete passes (and leaves a tombstone, see `tombstones`).
    Document::delete(1)
        .tenant(1)
        .expect_version(2)
        .execute(&mut f.conn)
        .await
        .unwrap();
    // A raw UPDATE that bumps by exactly one passes too.
    f.raw
        .batch_execute(
            "UPDATE documents SET status = 'x', version = version + 1 WHERE document_id = 2",
        )
        .await
        .unwrap();
    let loaded = Document::find(2).tenant(1).load(&mut f.conn).await.unwrap();
    assert_eq!((loaded.status.as_str(), loaded.version), ("x", 1));
}

#[tokio::test]
async fn installing_twice_is_fine_and_leaves_one_trigger() {
    let mut f = guarded().await;
    install_version_guard::<Document>(&mut f.conn)
        .await
        .unwrap();
    install_version_guard::<Document>(&mut f.conn)
        .await
        .unwrap();
    let n = diesel::sql_query(
        "SELECT count(*) AS n FROM pg_trigger \
         WHERE tgrelid = 'documents'::regclass AND tgname = 'idem_version_guard' AND NOT tgisinternal",
    )
    .get_result::<Count>(&mut f.conn)
    .await
    .unwrap()
    .n;
    assert_eq!(n, 1);
    let err = raw_error(&f.raw, "UPDATE documents SET body = '{}'").await;
    assert_eq!(err.code(), &SqlState::from_code("IDV01"));
}

#[tokio::test]
async fn any_table_and_column_name_is_quoted_safely() {
    let db = idem_testing::TestDatabase::create().await.unwrap();
    let mut conn = AsyncPgConnection::establish(db.url()).await.unwrap();
    idem::migrate::migrate(&mut conn).await.unwrap();
    let table = r#"We"ird Ta'ble; DROP TABLE x"#;
    let column = r#"v'e"r\s"#;
    conn.batch_execute(
        r#"CREATE TABLE x (id int);
           CREATE TABLE "We""ird Ta'ble; DROP TABLE x" ("i""d'" int PRIMARY KEY, note text, "v'e""r\s" bigint NOT NULL DEFAULT 0);
           INSERT INTO "We""ird Ta'ble; DROP TABLE x" ("i""d'", note) VALUES (1, 'a');"#,
    )
    .await
    .unwrap();
    install_version_guard_on(&mut conn, table, column, &[r#"i"d'"#])
        .await
        .unwrap();

    let raw = raw_client(db.url()).await;
    let err = raw_error(
        &raw,
        r#"UPDATE "We""ird Ta'ble; DROP TABLE x" SET note = 'b'"#,
    )
    .await;
    assert_eq!(err.code(), &SqlState::from_code("IDV01"));
    assert_eq!(err.table(), Some(table));
    assert_eq!(err.column(), Some(column));
    raw.batch_execute(
        r#"UPDATE "We""ird Ta'ble; DROP TABLE x" SET note = 'b', "v'e""r\s" = "v'e""r\s" + 1"#,
    )
    .await
    .unwrap();
    // The identity column's name reaches the trigger intact as well: it is
    // refused by name, and the INSERT's lookups (a dynamic query on the table
    // and the tombstone) find the deleted row.
    let err = raw_error(
        &raw,
        r#"UPDATE "We""ird Ta'ble; DROP TABLE x" SET "i""d'" = 2, "v'e""r\s" = "v'e""r\s" + 1"#,
    )
    .await;
    assert_eq!(err.code(), &SqlState::from_code("IDV03"));
    assert_eq!(err.column(), Some(r#"i"d'"#));
    raw.batch_execute(
        r#"DELETE FROM "We""ird Ta'ble; DROP TABLE x";
           INSERT INTO "We""ird Ta'ble; DROP TABLE x" ("i""d'", note) VALUES (1, 'c');"#,
    )
    .await
    .unwrap();
    let version: i64 = raw
        .query_one(
            r#"SELECT "v'e""r\s" FROM "We""ird Ta'ble; DROP TABLE x""#,
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(version, 2, "one past the deleted row's version 1");
    let x_still_there: i64 =
        diesel::sql_query("SELECT count(*) AS n FROM pg_class WHERE relname = 'x'")
            .get_result::<Count>(&mut conn)
            .await
            .unwrap()
            .n;
    assert_eq!(x_still_there, 1);
}

#[tokio::test]
async fn a_guard_on_a_missing_column_fails_loudly_too() {
    let db = idem_testing::TestDatabase::create().await.unwrap();
    let mut conn = AsyncPgConnection::establish(db.url()).await.unwrap();
    idem::migrate::migrate(&mut conn).await.unwrap();
    conn.batch_execute(DOCUMENTS_DDL).await.unwrap();
    conn.batch_execute("INSERT INTO documents VALUES (1, 1, '{}', 'draft', 0)")
        .await
        .unwrap();
    // "Version" is not "version": names are used exactly as given.
    install_version_guard_on(
        &mut conn,
        "documents",
        "Version",
        &["tenant_id", "document_id"],
    )
    .await
    .unwrap();
    let raw = raw_client(db.url()).await;
    let err = raw_error(&raw, "UPDATE documents SET version = version + 1").await;
    assert_eq!(
        err.code(),
        &SqlState::from_code(VERSION_GUARD_MISCONFIGURED_SQLSTATE)
    );
    assert!(err.message().contains(r#"no column "Version""#), "{err:?}");
}

#[tokio::test]
async fn installing_before_migrating_is_an_error_not_a_silent_no_op() {
    let db = idem_testing::TestDatabase::create().await.unwrap();
    let mut conn = AsyncPgConnection::establish(db.url()).await.unwrap();
    conn.batch_execute(DOCUMENTS_DDL).await.unwrap();
    let err = install_version_guard::<Document>(&mut conn)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("idem_version_guard"), "{err}");
    let n = diesel::sql_query(
        "SELECT count(*) AS n FROM pg_trigger WHERE tgname = 'idem_version_guard'",
    )
    .get_result::<Count>(&mut conn)
    .await
    .unwrap()
    .n;
    assert_eq!(n, 0);
}

pub(super) mod schema_qualified {
    use super::*;

    diesel::table! {
        ledger.notes (id) {
            id -> Int8,
            body -> Text,
            version -> Int8,
        }
    }

    #[derive(Debug, Queryable, Selectable, Versioned)]
    #[diesel(table_name = notes)]
    #[versioned(tenant = none, key = id)]
    pub(crate) struct Note {
        pub(crate) id: i64,
        pub(crate) body: String,
        pub(crate) version: i64,
    }

    /// Regression: the trigger went on a table named after the Rust module
    /// path (`stringify!` of `table_name`), not the table diesel writes to.
    #[tokio::test]
    async fn the_guard_lands_on_the_schema_qualified_table_diesel_writes() {
        let db = idem_testing::TestDatabase::create().await.unwrap();
        let mut conn = AsyncPgConnection::establish(db.url()).await.unwrap();
        idem::migrate(&mut conn).await.unwrap();
        conn.batch_execute(
            "CREATE SCHEMA ledger; CREATE TABLE ledger.notes (id bigint PRIMARY KEY, body text NOT NULL, version bigint NOT NULL DEFAULT 0); \
             INSERT INTO ledger.notes VALUES (1, 'a', 0)",
        )
        .await
        .unwrap();
        assert_eq!(Note::table_sql(), r#""ledger"."notes""#);
        install_version_guard::<Note>(&mut conn).await.unwrap();
        let err = conn
            .batch_execute("UPDATE ledger.notes SET body = 'b'")
            .await
            .unwrap_err();
        assert!(is_version_guard_violation(&err), "{err:?}");
        let note = Note::find(1).load(&mut conn).await.unwrap();
        assert_eq!((note.body.as_str(), note.version), ("a", 0));
    }
}
