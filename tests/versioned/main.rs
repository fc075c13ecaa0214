//! Versioned writes against a real PostgreSQL: concurrent writers, tenants,
//! the three ways a write can match no row, and the model shapes the derive
//! supports (no tenant, composite key, `i32` version).

use std::sync::Arc;

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};
use diesel_async::pooled_connection::deadpool::Pool;
use diesel_async::pooled_connection::AsyncDieselConnectionManager;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idem::http::HttpStatus;
use idem::{Versioned, VersionedChanges, VersionedError};
use serde_json::json;
use tokio::sync::Barrier;

#[path = "../support/pool.rs"]
mod test_pool;

mod attack_s54;
mod attack_s54_roles;
mod create_once;
mod duplicates;
mod identity;
mod prepared;
mod search_path;
mod shapes;
mod transitions;
mod writes;

diesel::table! {
    documents (tenant_id, document_id) {
        tenant_id -> Int8,
        document_id -> Int8,
        body -> Jsonb,
        status -> Text,
        version -> Int8,
    }
}

diesel::table! {
    settings (name) {
        name -> Text,
        value -> Text,
        version -> Int8,
    }
}

diesel::table! {
    order_lines (tenant_id, order_id, line_no) {
        tenant_id -> Int8,
        order_id -> Int8,
        line_no -> Int4,
        qty -> Int4,
        version -> Int8,
    }
}

diesel::table! {
    counters (tenant_id, id) {
        tenant_id -> Int4,
        id -> Int4,
        hits -> Int4,
        version -> Int4,
    }
}

const SCHEMA: &str = "
CREATE TABLE documents (
    tenant_id bigint NOT NULL,
    document_id bigint NOT NULL,
    body jsonb NOT NULL,
    status text NOT NULL,
    version bigint NOT NULL DEFAULT 0 CHECK (version >= 0),
    PRIMARY KEY (tenant_id, document_id));
CREATE TABLE settings (
    name text PRIMARY KEY,
    value text NOT NULL,
    version bigint NOT NULL DEFAULT 0 CHECK (version >= 0));
CREATE TABLE order_lines (
    tenant_id bigint NOT NULL,
    order_id bigint NOT NULL,
    line_no int NOT NULL,
    qty int NOT NULL,
    version bigint NOT NULL DEFAULT 0 CHECK (version >= 0),
    PRIMARY KEY (tenant_id, order_id, line_no));
CREATE TABLE counters (
    tenant_id int NOT NULL,
    id int NOT NULL,
    hits int NOT NULL,
    version int NOT NULL DEFAULT 0 CHECK (version >= 0),
    PRIMARY KEY (tenant_id, id));
";

#[derive(Debug, Clone, PartialEq, Queryable, Selectable, Versioned)]
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

#[derive(VersionedChanges)]
#[versioned(model = Document)]
#[diesel(table_name = documents)]
struct SetStatus {
    status: String,
}

#[derive(Debug, Clone, PartialEq, Queryable, Selectable, Versioned)]
#[diesel(table_name = settings)]
#[versioned(tenant = none, key = name)]
struct Setting {
    name: String,
    value: String,
    version: i64,
}

#[derive(VersionedChanges)]
#[versioned(model = Setting)]
#[diesel(table_name = settings)]
struct SetValue {
    value: String,
}

#[derive(Debug, Clone, PartialEq, Queryable, Selectable, Versioned)]
#[diesel(table_name = order_lines)]
#[versioned(tenant = tenant_id, key = (order_id, line_no))]
struct OrderLine {
    tenant_id: i64,
    order_id: i64,
    line_no: i32,
    qty: i32,
    version: i64,
}

#[derive(VersionedChanges)]
#[versioned(model = OrderLine)]
#[diesel(table_name = order_lines)]
struct SetQty {
    qty: i32,
}

#[derive(Debug, Clone, PartialEq, Queryable, Selectable, Versioned)]
#[diesel(table_name = counters)]
#[versioned(tenant = tenant_id, key = id)]
struct Counter {
    tenant_id: i32,
    id: i32,
    hits: i32,
    version: i32,
}

#[derive(VersionedChanges)]
#[versioned(model = Counter)]
#[diesel(table_name = counters)]
struct SetHits {
    hits: i32,
}

async fn setup() -> (idem_testing::TestDatabase, AsyncPgConnection) {
    let db = idem_testing::TestDatabase::create().await.unwrap();
    let mut conn = AsyncPgConnection::establish(db.url()).await.unwrap();
    conn.batch_execute(SCHEMA).await.unwrap();
    (db, conn)
}

fn doc(tenant_id: i64, document_id: i64, status: &str) -> Document {
    Document {
        tenant_id,
        document_id,
        body: json!({"doc": document_id, "tenant": tenant_id}),
        status: status.into(),
        version: 0,
    }
}

/// Every row of `documents`, straight from the table.
async fn all_documents(conn: &mut AsyncPgConnection) -> Vec<Document> {
    documents::table
        .select(Document::as_select())
        .order((documents::tenant_id, documents::document_id))
        .load(conn)
        .await
        .unwrap()
}

fn assert_stale(err: &VersionedError, expected: i64, actual: i64) {
    match err {
        VersionedError::Stale {
            expected: e,
            actual: a,
        } => assert_eq!((*e, *a), (expected, actual), "{err:?}"),
        other => {
            panic!("expected Stale {{ expected: {expected}, actual: {actual} }}, got {other:?}")
        }
    }
    assert_eq!(err.http_status(), 412);
}

fn assert_not_found(err: &VersionedError) {
    assert!(matches!(err, VersionedError::NotFound), "{err:?}");
    assert_eq!(err.http_status(), 404);
}
