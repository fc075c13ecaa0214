//! Two writers read the same document, both change it, and exactly one wins:
//! the other is told its change was computed from a stale version instead of
//! silently overwriting the winner's.
//!
//! `cargo run --example quickstart` (PostgreSQL: `DATABASE_URL`, else
//! 127.0.0.1:5432, else a throwaway cluster from the installed server binaries).

#[path = "common/mod.rs"]
mod common;

use std::sync::Arc;

use diesel::prelude::*;
use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};
use idem::{Versioned, VersionedChanges, VersionedError};
use serde_json::json;
use tokio::sync::Barrier;

diesel::table! {
    quickstart_documents (tenant_id, document_id) {
        tenant_id -> Int8,
        document_id -> Int8,
        body -> Jsonb,
        version -> Int8,
    }
}

// The version starts at 0 and only ever grows by one per write; the CHECK keeps
// hand-written SQL from putting it anywhere else.
const SCHEMA: &str = "
    DROP TABLE IF EXISTS quickstart_documents;
    CREATE TABLE quickstart_documents (
        tenant_id   bigint NOT NULL,
        document_id bigint NOT NULL,
        body        jsonb  NOT NULL,
        version     bigint NOT NULL DEFAULT 0 CHECK (version >= 0),
        PRIMARY KEY (tenant_id, document_id)
    );
";

// Every write names the tenant, so a right key and version in another tenant
// matches nothing instead of someone else's row.
#[derive(Debug, Queryable, Selectable, Versioned)]
#[diesel(table_name = quickstart_documents)]
#[versioned(tenant = tenant_id, key = document_id, version = version)]
struct Document {
    tenant_id: i64,
    document_id: i64,
    body: serde_json::Value,
    version: i64,
}

// Not a diesel changeset: it can only be applied through `Document::update`,
// which always checks and bumps the version.
#[derive(VersionedChanges)]
#[versioned(model = Document)]
#[diesel(table_name = quickstart_documents)]
struct Edit {
    body: serde_json::Value,
}

const TENANT: i64 = 1;
const DOC: i64 = 1;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = common::database_url().await;
    let mut conn = AsyncPgConnection::establish(&url).await?;
    conn.batch_execute(SCHEMA).await?;

    let draft = Document {
        tenant_id: TENANT,
        document_id: DOC,
        body: json!({ "title": "draft" }),
        version: 0,
    };
    draft.insert(&mut conn).await?;

    // One read supplies the version both writers compute from: the lost-update
    // race that a plain UPDATE ... WHERE id = $1 would get wrong.
    let read = Document::find(DOC).tenant(TENANT).load(&mut conn).await?;
    let barrier = Arc::new(Barrier::new(2));
    let a = tokio::spawn(edit(url.clone(), "a", read.version, Arc::clone(&barrier)));
    let b = tokio::spawn(edit(url.clone(), "b", read.version, barrier));
    let (a, b) = (a.await?, b.await?);

    let (winner, lost) = match (a, b) {
        (Ok(_), Err(e)) => ("a", e),
        (Err(e), Ok(_)) => ("b", e),
        (a, b) => panic!("exactly one writer must win: a={a:?} b={b:?}"),
    };
    let VersionedError::Stale { expected, actual } = lost else {
        panic!("the loser must be told it was stale, got {lost:?}");
    };
    let stored = Document::find(DOC).tenant(TENANT).load(&mut conn).await?;
    println!(
        "winner={winner} loser=Stale{{expected={expected},actual={actual}}} final_version={}",
        stored.version
    );
    Ok(())
}

/// One writer, on its own connection, as a separate request would be.
async fn edit(
    url: String,
    name: &'static str,
    read_version: i64,
    start: Arc<Barrier>,
) -> Result<Document, VersionedError> {
    let mut conn = AsyncPgConnection::establish(&url)
        .await
        .expect("connect writer");
    let change = Edit {
        body: json!({ "title": format!("edited by {name}") }),
    };
    // Connect first, then release both writes together, so they really race.
    start.wait().await;
    Document::update(DOC)
        .tenant(TENANT)
        .expect_version(read_version)
        .set(&change)
        .execute(&mut conn)
        .await
}
