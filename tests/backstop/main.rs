//! The database backstop: once `install_version_guard` has run, SQL that
//! forgets the version bump or moves a row to another identity fails loudly,
//! a deleted and re-inserted row never repeats a version, and versioned
//! writes still work.

use diesel::prelude::*;
use diesel::result::DatabaseErrorKind;
use diesel::sql_types::BigInt;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idem::versioned::backstop::{
    install_version_guard, install_version_guard_on, is_identity_guard_violation,
    is_version_guard_violation, purge_version_tombstones, VERSION_GUARD_IDENTITY_SQLSTATE,
    VERSION_GUARD_MISCONFIGURED_SQLSTATE, VERSION_GUARD_SQLSTATE,
};
use idem::{Versioned, VersionedChanges, VersionedError};
use tokio_postgres::error::{DbError, SqlState};

mod identity;
mod tombstones;
mod version;

diesel::table! {
    documents (tenant_id, document_id) {
        tenant_id -> Int8,
        document_id -> Int8,
        body -> Jsonb,
        status -> Text,
        version -> Int8,
    }
}

#[derive(Debug, Clone, Queryable, Selectable, Versioned)]
#[diesel(table_name = documents)]
#[versioned(tenant = tenant_id, version = version, key = document_id, state = status)]
struct Document {
    tenant_id: i64,
    document_id: i64,
    body: serde_json::Value,
    status: String,
    version: i64,
}

#[derive(VersionedChanges)]
#[versioned(model = Document)]
#[diesel(table_name = documents)]
struct Edit {
    body: serde_json::Value,
}

const DOCUMENTS_DDL: &str = "CREATE TABLE documents (
    tenant_id bigint NOT NULL,
    document_id bigint NOT NULL,
    body jsonb NOT NULL,
    status text NOT NULL,
    version bigint NOT NULL DEFAULT 0 CHECK (version >= 0),
    PRIMARY KEY (tenant_id, document_id))";

struct Fixture {
    // Dropped last: the connections below must close before the database goes.
    db: idem_testing::TestDatabase,
    conn: AsyncPgConnection,
    raw: tokio_postgres::Client,
}

/// A migrated database with `documents` (documents 1..=3 of tenant 1, at
/// version 0) and the guard installed on it.
async fn guarded() -> Fixture {
    let db = idem_testing::TestDatabase::create().await.unwrap();
    let mut conn = AsyncPgConnection::establish(db.url()).await.unwrap();
    idem::migrate::migrate(&mut conn).await.unwrap();
    conn.batch_execute(DOCUMENTS_DDL).await.unwrap();
    for id in 1..=3 {
        Document {
            tenant_id: 1,
            document_id: id,
            body: serde_json::json!({"n": id}),
            status: "draft".into(),
            version: 0,
        }
        .insert(&mut conn)
        .await
        .unwrap();
    }
    install_version_guard::<Document>(&mut conn).await.unwrap();
    let raw = raw_client(db.url()).await;
    Fixture { db, conn, raw }
}

async fn raw_client(url: &str) -> tokio_postgres::Client {
    idem_testing::connect(url).await.unwrap()
}

/// The server's error for a statement that must fail.
async fn raw_error(raw: &tokio_postgres::Client, sql: &str) -> DbError {
    let err = raw
        .batch_execute(sql)
        .await
        .expect_err("the guard must refuse this statement");
    err.as_db_error()
        .unwrap_or_else(|| panic!("not a server error: {err}"))
        .clone()
}

/// Every row of `documents`: tenant, document, body, version.
type Row = (i64, i64, serde_json::Value, i64);

async fn rows(conn: &mut AsyncPgConnection) -> Vec<Row> {
    documents::table
        .select((
            documents::tenant_id,
            documents::document_id,
            documents::body,
            documents::version,
        ))
        .order((documents::tenant_id, documents::document_id))
        .load(conn)
        .await
        .unwrap()
}

/// The rows `guarded()` starts with.
fn untouched() -> Vec<Row> {
    (1..=3)
        .map(|id| (1, id, serde_json::json!({"n": id}), 0))
        .collect()
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}
