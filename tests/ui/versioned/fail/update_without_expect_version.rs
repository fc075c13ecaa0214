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

#[derive(Queryable, Selectable, Versioned)]
#[diesel(table_name = documents)]
#[versioned(tenant = tenant_id, version = version, key = document_id)]
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

// Without the version the update would overwrite every change made since the read.
async fn write(conn: &mut AsyncPgConnection, edit: &Edit) {
    let _ = Document::update(7).tenant(1).set(edit).execute(conn).await;
}

fn main() {}
