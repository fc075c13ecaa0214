//! Versioned writes against a real PostgreSQL: concurrent writers, tenants,
//! the three ways a write can match no row, and the model shapes the derive
//! supports (no tenant, composite key, `i32` version).

use std::sync::Arc;

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};
use diesel_async::pooled_connection::deadpool::Pool;
use diesel_async::pooled_connection::AsyncDieselConnectionManager;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idem::{Versioned, VersionedChanges, VersionedError};
use serde_json::json;
use tokio::sync::Barrier;

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

const WRITERS: usize = 50;
/// Connections of the concurrency test, well below the server's
/// `max_connections` even with the other tests of this binary running.
const POOL_SIZE: usize = 20;

#[tokio::test]
async fn fifty_concurrent_writers_of_one_version_one_wins() {
    let (db, mut conn) = setup().await;
    doc(1, 7, "draft").insert(&mut conn).await.unwrap();

    let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new(db.url());
    let pool = Pool::builder(manager).max_size(POOL_SIZE).build().unwrap();
    let barrier = Arc::new(Barrier::new(WRITERS));
    let mut tasks = Vec::new();
    for writer in 0..WRITERS {
        let pool = pool.clone();
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            let read = {
                let mut conn = pool.get().await.unwrap();
                Document::find(7).tenant(1).load(&mut conn).await.unwrap()
            };
            // Nobody writes before everybody has read version 0.
            barrier.wait().await;
            let mut conn = pool.get().await.unwrap();
            let outcome = Document::update(7)
                .tenant(1)
                .expect_version(read.version)
                .set(&Edit {
                    body: json!({ "writer": writer }),
                })
                .execute(&mut conn)
                .await;
            (writer, read.version, outcome)
        }));
    }

    let mut winners = Vec::new();
    let mut stale = 0;
    for task in tasks {
        let (writer, read_version, outcome) = task.await.unwrap();
        assert_eq!(read_version, 0);
        match outcome {
            Ok(row) => {
                assert_eq!(row.version, 1);
                winners.push(writer);
            }
            Err(err) => {
                assert_stale(&err, 0, 1);
                stale += 1;
            }
        }
    }
    assert_eq!(winners.len(), 1, "winners: {winners:?}");
    assert_eq!(stale, WRITERS - 1);

    let stored = all_documents(&mut conn).await;
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].version, 1);
    assert_eq!(stored[0].body, json!({ "writer": winners[0] }));
}

#[tokio::test]
async fn right_key_and_version_under_another_tenant_is_not_found() {
    let (_db, mut conn) = setup().await;
    let original = doc(1, 7, "draft").insert(&mut conn).await.unwrap();
    let edit = Edit {
        body: json!("hijacked"),
    };

    let err = Document::update(7)
        .tenant(2)
        .expect_version(0)
        .set(&edit)
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert_not_found(&err);
    let err = Document::delete(7)
        .tenant(2)
        .expect_version(0)
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert_not_found(&err);
    let err = Document::find(7)
        .tenant(2)
        .load(&mut conn)
        .await
        .unwrap_err();
    assert_not_found(&err);
    assert_eq!(all_documents(&mut conn).await, vec![original.clone()]);

    // The same key in tenant 2 is another row: writing it leaves tenant 1's alone,
    // and its conflicts are reported against its own version.
    doc(2, 7, "draft").insert(&mut conn).await.unwrap();
    let theirs = Document::update(7)
        .tenant(2)
        .expect_version(0)
        .set(&edit)
        .execute(&mut conn)
        .await
        .unwrap();
    assert_eq!((theirs.version, theirs.body), (1, json!("hijacked")));
    let err = Document::update(7)
        .tenant(2)
        .expect_version(0)
        .set(&edit)
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert_stale(&err, 0, 1);
    let mine = Document::find(7).tenant(1).load(&mut conn).await.unwrap();
    assert_eq!(mine, original);
    assert_eq!(mine.body, json!({"doc": 7, "tenant": 1}));
    assert_eq!(mine.version, 0);
}

#[tokio::test]
async fn stale_not_found_and_state_mismatch_are_told_apart() {
    let (_db, mut conn) = setup().await;
    doc(1, 1, "draft").insert(&mut conn).await.unwrap();
    doc(1, 2, "draft").insert(&mut conn).await.unwrap();
    let publish = SetStatus {
        status: "published".into(),
    };
    let archive = SetStatus {
        status: "archived".into(),
    };

    // draft -> published, guarded.
    let published = Document::update(1)
        .tenant(1)
        .expect_version(0)
        .expect_state("draft".into())
        .set(&publish)
        .execute(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        (published.status.as_str(), published.version),
        ("published", 1)
    );

    // The same transition again, from the current version: the state refuses it.
    let err = Document::update(1)
        .tenant(1)
        .expect_version(1)
        .expect_state("draft".into())
        .set(&publish)
        .execute(&mut conn)
        .await
        .unwrap_err();
    match &err {
        VersionedError::StateMismatch { expected, actual } => {
            assert_eq!(expected, "\"draft\"");
            assert_eq!(actual, "\"published\"");
        }
        other => panic!("expected StateMismatch, got {other:?}"),
    }
    assert_eq!(err.http_status(), 409);

    // The same transition again, replayed with the version it was first sent with: stale.
    let err = Document::update(1)
        .tenant(1)
        .expect_version(0)
        .expect_state("draft".into())
        .set(&publish)
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert_stale(&err, 0, 1);

    // Out of order: published -> archived on a row that is still a draft.
    let err = Document::update(2)
        .tenant(1)
        .expect_version(0)
        .expect_state("published".into())
        .set(&archive)
        .execute(&mut conn)
        .await
        .unwrap_err();
    match &err {
        VersionedError::StateMismatch { expected, actual } => {
            assert_eq!(expected, "\"published\"");
            assert_eq!(actual, "\"draft\"");
        }
        other => panic!("expected StateMismatch, got {other:?}"),
    }

    // No such row, with or without a state precondition.
    let err = Document::update(99)
        .tenant(1)
        .expect_version(0)
        .expect_state("draft".into())
        .set(&publish)
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert_not_found(&err);

    // None of the refused writes changed anything.
    let stored = all_documents(&mut conn).await;
    assert_eq!(
        stored
            .iter()
            .map(|d| (d.document_id, d.status.as_str(), d.version))
            .collect::<Vec<_>>(),
        vec![(1, "published", 1), (2, "draft", 0)]
    );
}

#[tokio::test]
async fn delete_with_a_stale_version_is_stale_and_the_row_stays() {
    let (_db, mut conn) = setup().await;
    doc(1, 1, "draft").insert(&mut conn).await.unwrap();
    let edited = Document::update(1)
        .tenant(1)
        .expect_version(0)
        .set(&Edit { body: json!(2) })
        .execute(&mut conn)
        .await
        .unwrap();

    let err = Document::delete(1)
        .tenant(1)
        .expect_version(0)
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert_stale(&err, 0, 1);
    assert_eq!(all_documents(&mut conn).await, vec![edited]);

    Document::delete(1)
        .tenant(1)
        .expect_version(1)
        .execute(&mut conn)
        .await
        .unwrap();
    assert!(all_documents(&mut conn).await.is_empty());
    let err = Document::delete(1)
        .tenant(1)
        .expect_version(1)
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert_not_found(&err);
}

#[tokio::test]
async fn insert_starts_at_version_zero_whatever_the_field_holds() {
    let (_db, mut conn) = setup().await;
    for (id, claimed) in [(1, 42), (2, -5), (3, i64::MAX)] {
        let mut row = doc(1, id, "draft");
        row.version = claimed;
        let stored = row.insert(&mut conn).await.unwrap();
        assert_eq!(stored, Document { version: 0, ..row });
    }
    let versions: Vec<i64> = documents::table
        .select(documents::version)
        .load(&mut conn)
        .await
        .unwrap();
    assert_eq!(versions, vec![0, 0, 0]);
}

#[tokio::test]
async fn untenanted_model() {
    let (_db, mut conn) = setup().await;
    let stored = Setting {
        name: "mode".into(),
        value: "a".into(),
        version: 9,
    }
    .insert(&mut conn)
    .await
    .unwrap();
    assert_eq!(stored.version, 0);

    let read = Setting::find("mode".to_owned())
        .load(&mut conn)
        .await
        .unwrap();
    let written = Setting::update("mode".to_owned())
        .expect_version(read.version)
        .set(&SetValue { value: "b".into() })
        .execute(&mut conn)
        .await
        .unwrap();
    assert_eq!((written.value.as_str(), written.version), ("b", 1));

    let err = Setting::update("mode".to_owned())
        .expect_version(0)
        .set(&SetValue { value: "c".into() })
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert_stale(&err, 0, 1);
    let err = Setting::update("other".to_owned())
        .expect_version(0)
        .set(&SetValue { value: "c".into() })
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert_not_found(&err);
    let err = Setting::delete("mode".to_owned())
        .expect_version(0)
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert_stale(&err, 0, 1);
    assert_eq!(
        Setting::find("mode".to_owned())
            .load(&mut conn)
            .await
            .unwrap(),
        written
    );
    Setting::delete("mode".to_owned())
        .expect_version(1)
        .execute(&mut conn)
        .await
        .unwrap();
    let err = Setting::find("mode".to_owned())
        .load(&mut conn)
        .await
        .unwrap_err();
    assert_not_found(&err);
}

#[tokio::test]
async fn composite_key_model_writes_exactly_one_row() {
    let (_db, mut conn) = setup().await;
    let line = |tenant_id, order_id, line_no| OrderLine {
        tenant_id,
        order_id,
        line_no,
        qty: 1,
        version: 0,
    };
    // Rows that share every part of the key but one with the row written.
    for l in [line(1, 1, 1), line(1, 1, 2), line(1, 2, 1), line(2, 1, 1)] {
        l.insert(&mut conn).await.unwrap();
    }

    let written = OrderLine::update((1, 1))
        .tenant(1)
        .expect_version(0)
        .set(&SetQty { qty: 5 })
        .execute(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        written,
        OrderLine {
            qty: 5,
            version: 1,
            ..line(1, 1, 1)
        }
    );

    let err = OrderLine::update((1, 1))
        .tenant(1)
        .expect_version(0)
        .set(&SetQty { qty: 6 })
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert_stale(&err, 0, 1);
    let err = OrderLine::update((1, 3))
        .tenant(1)
        .expect_version(0)
        .set(&SetQty { qty: 6 })
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert_not_found(&err);
    let err = OrderLine::delete((1, 2))
        .tenant(1)
        .expect_version(1)
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert_stale(&err, 1, 0);

    let rows: Vec<(i64, i64, i32, i32, i64)> = order_lines::table
        .select((
            order_lines::tenant_id,
            order_lines::order_id,
            order_lines::line_no,
            order_lines::qty,
            order_lines::version,
        ))
        .order((
            order_lines::tenant_id,
            order_lines::order_id,
            order_lines::line_no,
        ))
        .load(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        rows,
        vec![
            (1, 1, 1, 5, 1),
            (1, 1, 2, 1, 0),
            (1, 2, 1, 1, 0),
            (2, 1, 1, 1, 0)
        ]
    );
}

#[tokio::test]
async fn i32_version_column() {
    let (_db, mut conn) = setup().await;
    Counter {
        tenant_id: 1,
        id: 1,
        hits: 0,
        version: 3,
    }
    .insert(&mut conn)
    .await
    .unwrap();
    let written = Counter::update(1)
        .tenant(1)
        .expect_version(0)
        .set(&SetHits { hits: 1 })
        .execute(&mut conn)
        .await
        .unwrap();
    assert_eq!((written.hits, written.version), (1, 1));
    assert_eq!(written.version(), 1_i64);

    let err = Counter::update(1)
        .tenant(1)
        .expect_version(0)
        .set(&SetHits { hits: 2 })
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert_stale(&err, 0, 1);

    // Versions no i32 column can hold: stale, not a panic and not a database error.
    for too_big in [i64::from(i32::MAX) + 2, 1 << 40, i64::MAX, i64::MIN, -1] {
        let err = Counter::update(1)
            .tenant(1)
            .expect_version(too_big)
            .set(&SetHits { hits: 2 })
            .execute(&mut conn)
            .await
            .unwrap_err();
        assert_stale(&err, too_big, 1);
        let err = Counter::delete(1)
            .tenant(1)
            .expect_version(too_big)
            .execute(&mut conn)
            .await
            .unwrap_err();
        assert_stale(&err, too_big, 1);
    }
    // ... and NotFound when there is no row to be stale against.
    let err = Counter::update(2)
        .tenant(1)
        .expect_version(1 << 40)
        .set(&SetHits { hits: 2 })
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert_not_found(&err);

    let stored = Counter::find(1).tenant(1).load(&mut conn).await.unwrap();
    assert_eq!(stored, written);
}

#[derive(QueryableByName, Debug)]
struct Prepared {
    #[diesel(sql_type = Text)]
    statement: String,
    /// How often the server ran it (PostgreSQL 14+ counts plans per execution).
    #[diesel(sql_type = BigInt)]
    runs: i64,
}

/// The UPDATEs prepared on this connection, with how often each ran.
async fn prepared_updates(conn: &mut AsyncPgConnection) -> Vec<(String, i64)> {
    diesel::sql_query(
        "SELECT statement, generic_plans + custom_plans AS runs FROM pg_prepared_statements \
         WHERE statement LIKE 'UPDATE %' ORDER BY statement",
    )
    .load::<Prepared>(conn)
    .await
    .unwrap()
    .into_iter()
    .map(|p| (p.statement, p.runs))
    .collect()
}

#[tokio::test]
async fn the_update_is_prepared_once_per_connection() {
    let (_db, mut conn) = setup().await;
    doc(1, 1, "draft").insert(&mut conn).await.unwrap();
    doc(1, 2, "draft").insert(&mut conn).await.unwrap();
    for (id, version) in [(1, 0), (1, 1), (2, 0)] {
        Document::update(id)
            .tenant(1)
            .expect_version(version)
            .set(&Edit {
                body: json!(version),
            })
            .execute(&mut conn)
            .await
            .unwrap();
    }
    // A conflict goes through the same statement.
    Document::update(1)
        .tenant(1)
        .expect_version(0)
        .set(&Edit { body: json!(0) })
        .execute(&mut conn)
        .await
        .unwrap_err();

    let updates = prepared_updates(&mut conn).await;
    assert_eq!(
        updates,
        vec![(
            "UPDATE \"documents\" SET \"body\" = $1, \"version\" = \"version\" + 1 \
             WHERE (((\"documents\".\"tenant_id\" = $2) AND (\"documents\".\"document_id\" = $3)) \
             AND (\"documents\".\"version\" = $4)) \
             RETURNING \"documents\".\"tenant_id\", \"documents\".\"document_id\", \"documents\".\"body\", \
             \"documents\".\"status\", \"documents\".\"version\""
                .to_owned(),
            4
        )]
    );

    // A guarded transition has one more predicate, so one more statement; reused as well.
    for id in [1, 2] {
        let version = Document::find(id)
            .tenant(1)
            .load(&mut conn)
            .await
            .unwrap()
            .version;
        Document::update(id)
            .tenant(1)
            .expect_version(version)
            .expect_state("draft".into())
            .set(&SetStatus {
                status: "published".into(),
            })
            .execute(&mut conn)
            .await
            .unwrap();
    }
    let updates = prepared_updates(&mut conn).await;
    assert_eq!(updates.len(), 2, "{updates:#?}");
    assert_eq!(updates[0].1, 4, "{updates:#?}");
    assert!(
        updates[1].0.contains("AND (\"documents\".\"status\" = $5)"),
        "{updates:#?}"
    );
    assert_eq!(updates[1].1, 2, "{updates:#?}");
}
