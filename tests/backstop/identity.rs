//! The identity check: an UPDATE may not change the tenant or a key column of
//! a guarded row, however correctly it bumps the version.

use super::*;

#[tokio::test]
async fn moving_a_row_to_another_tenant_is_refused_even_with_a_correct_bump() {
    let mut f = guarded().await;
    let err = raw_error(
        &f.raw,
        "UPDATE documents SET tenant_id = 2, version = version + 1 \
         WHERE tenant_id = 1 AND document_id = 1 AND version = 0",
    )
    .await;
    assert_eq!(
        err.code(),
        &SqlState::from_code(VERSION_GUARD_IDENTITY_SQLSTATE)
    );
    assert_eq!(VERSION_GUARD_IDENTITY_SQLSTATE, "IDV03");
    assert_eq!(
        err.message(),
        "idem_version_guard: UPDATE moves a row of public.documents by changing its identity \
         column tenant_id from 1 to 2; the key and tenant of a versioned row never change"
    );
    assert_eq!(err.detail(), Some("old 1, new 2"));
    assert_eq!(err.schema(), Some("public"));
    assert_eq!(err.table(), Some("documents"));
    assert_eq!(err.column(), Some("tenant_id"));
    assert!(
        err.hint().unwrap().contains("delete the old one"),
        "{err:?}"
    );
    assert_eq!(rows(&mut f.conn).await, untouched());
}

#[tokio::test]
async fn changing_a_key_column_is_refused_even_with_a_correct_bump() {
    let mut f = guarded().await;
    let err = raw_error(
        &f.raw,
        "UPDATE documents SET document_id = 9, version = version + 1 WHERE document_id = 1",
    )
    .await;
    assert_eq!(err.code(), &SqlState::from_code("IDV03"));
    assert_eq!(err.column(), Some("document_id"));
    assert!(
        err.message()
            .contains("identity column document_id from 1 to 9"),
        "{err:?}"
    );
    // A bulk renumbering fails as a whole, like any refused UPDATE.
    let err = raw_error(
        &f.raw,
        "UPDATE documents SET document_id = document_id + 10, version = version + 1",
    )
    .await;
    assert_eq!(err.code(), &SqlState::from_code("IDV03"));
    assert_eq!(rows(&mut f.conn).await, untouched());
}

#[tokio::test]
async fn the_identity_is_checked_before_the_version() {
    let mut f = guarded().await;
    // No bump either: the identity change is what gets reported, since no
    // version could make this UPDATE acceptable.
    let err = diesel::update(documents::table.filter(documents::document_id.eq(2)))
        .set(documents::tenant_id.eq(7))
        .execute(&mut f.conn)
        .await
        .unwrap_err();
    assert!(is_identity_guard_violation(&err), "{err:?}");
    assert!(!is_version_guard_violation(&err), "{err:?}");
    match &err {
        diesel::result::Error::DatabaseError(_, info) => {
            assert_eq!(info.table_name(), Some("documents"));
            assert_eq!(info.column_name(), Some("tenant_id"));
        }
        other => panic!("unexpected error {other:?}"),
    }
    // And the other way round: a missing bump alone is not an identity change.
    let err = diesel::update(documents::table.filter(documents::document_id.eq(2)))
        .set(documents::status.eq("x"))
        .execute(&mut f.conn)
        .await
        .unwrap_err();
    assert!(is_version_guard_violation(&err), "{err:?}");
    assert!(!is_identity_guard_violation(&err), "{err:?}");
    assert_eq!(rows(&mut f.conn).await, untouched());
}

#[tokio::test]
async fn assigning_the_same_identity_passes() {
    let mut f = guarded().await;
    // ORMs that write every column (and `ON CONFLICT DO UPDATE SET` lists
    // generated from all columns) assign the key its own value.
    f.raw
        .batch_execute(
            "UPDATE documents SET tenant_id = tenant_id, document_id = 3, version = version + 1 \
             WHERE document_id = 3",
        )
        .await
        .unwrap();
    let loaded = Document::find(3).tenant(1).load(&mut f.conn).await.unwrap();
    assert_eq!(loaded.version, 1);
}

#[tokio::test]
async fn an_untenanted_models_key_is_its_identity() {
    let db = idem_testing::TestDatabase::create().await.unwrap();
    let mut conn = AsyncPgConnection::establish(db.url()).await.unwrap();
    idem::migrate(&mut conn).await.unwrap();
    conn.batch_execute(
        "CREATE SCHEMA ledger; \
         CREATE TABLE ledger.notes (id bigint PRIMARY KEY, body text NOT NULL, version bigint NOT NULL DEFAULT 0); \
         INSERT INTO ledger.notes VALUES (1, 'a', 0)",
    )
    .await
    .unwrap();
    use super::version::schema_qualified::Note;
    assert_eq!(Note::IDENTITY_COLUMNS, ["id"]);
    assert_eq!(Document::IDENTITY_COLUMNS, ["tenant_id", "document_id"]);
    install_version_guard::<Note>(&mut conn).await.unwrap();
    let err = conn
        .batch_execute("UPDATE ledger.notes SET id = 2, version = version + 1")
        .await
        .unwrap_err();
    assert!(is_identity_guard_violation(&err), "{err:?}");
    let note = Note::find(1).load(&mut conn).await.unwrap();
    assert_eq!(note.version, 0);
}

#[tokio::test]
async fn a_trigger_installed_by_an_older_idem_keeps_its_old_behaviour() {
    // The migration replaces the function; a trigger created by an older idem
    // (version column only, BEFORE UPDATE) still checks the bump, and only
    // that, until `install_version_guard` runs again.
    let mut f = guarded().await;
    f.conn
        .batch_execute(
            "CREATE OR REPLACE TRIGGER idem_version_guard BEFORE UPDATE ON documents \
             FOR EACH ROW EXECUTE FUNCTION idem_version_guard('version')",
        )
        .await
        .unwrap();
    let err = raw_error(&f.raw, "UPDATE documents SET body = '{}'").await;
    assert_eq!(err.code(), &SqlState::from_code(VERSION_GUARD_SQLSTATE));
    f.raw
        .batch_execute(
            "UPDATE documents SET tenant_id = 2, version = version + 1 WHERE document_id = 1",
        )
        .await
        .unwrap();

    // Installing again upgrades it in place.
    install_version_guard::<Document>(&mut f.conn)
        .await
        .unwrap();
    let err = raw_error(
        &f.raw,
        "UPDATE documents SET tenant_id = 1, version = version + 1 WHERE document_id = 1",
    )
    .await;
    assert_eq!(err.code(), &SqlState::from_code("IDV03"));
}

#[tokio::test]
async fn a_misnamed_identity_column_fails_loudly() {
    let db = idem_testing::TestDatabase::create().await.unwrap();
    let mut conn = AsyncPgConnection::establish(db.url()).await.unwrap();
    idem::migrate::migrate(&mut conn).await.unwrap();
    conn.batch_execute(DOCUMENTS_DDL).await.unwrap();
    conn.batch_execute("INSERT INTO documents VALUES (1, 1, '{}', 'draft', 0)")
        .await
        .unwrap();
    install_version_guard_on(
        &mut conn,
        "documents",
        "version",
        &["tenant", "document_id"],
    )
    .await
    .unwrap();
    let raw = raw_client(db.url()).await;
    for sql in [
        "UPDATE documents SET version = version + 1",
        "INSERT INTO documents VALUES (1, 2, '{}', 'draft', 0)",
        "DELETE FROM documents",
    ] {
        let err = raw_error(&raw, sql).await;
        assert_eq!(
            err.code(),
            &SqlState::from_code(VERSION_GUARD_MISCONFIGURED_SQLSTATE),
            "{sql}"
        );
        assert!(
            err.message().contains(r#"no column tenant"#),
            "{sql}: {err:?}"
        );
    }
}
