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

// A read without the tenant could return another tenant's row.
async fn read(conn: &mut AsyncPgConnection) {
    let _ = Document::find(7).load(conn).await;
}

fn main() {}
