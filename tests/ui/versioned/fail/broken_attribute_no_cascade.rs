use diesel::prelude::*;
use diesel_async::AsyncPgConnection;
use idem::{Versioned, VersionedChanges};

diesel::table! {
    documents (tenant_id, document_id) {
        tenant_id -> Int8,
        document_id -> Int8,
        body -> Text,
        version -> Int8,
    }
}

// One misspelt field in #[versioned(..)] is one error: the changeset, the read,
// the update and the delete below, which use the model as if it were right,
// add none of their own.
#[derive(Queryable, Selectable, Versioned)]
#[diesel(table_name = documents)]
#[versioned(tenant = tenant_id, version = version, key = documnet_id)]
struct Document {
    tenant_id: i64,
    document_id: i64,
    body: String,
    version: i64,
}

#[derive(VersionedChanges)]
#[versioned(model = Document)]
#[diesel(table_name = documents)]
struct Edit {
    body: String,
}

async fn edit(conn: &mut AsyncPgConnection) -> Result<(), idem::VersionedError> {
    let row = Document::find(7).tenant(1).load(conn).await?;
    let row = Document::update(row.document_id)
        .tenant(row.tenant_id)
        .expect_version(row.version)
        .set(&Edit { body: row.body })
        .execute(conn)
        .await?;
    Document::delete(7)
        .tenant(1)
        .expect_version(row.version)
        .execute(conn)
        .await
}

fn main() {}
