// `state = ..` makes `.expect_state(..)` a guarded transition on that column.
use diesel::prelude::*;
use diesel_async::AsyncPgConnection;
use idem::{Versioned, VersionedChanges};

diesel::table! {
    documents (tenant_id, document_id) {
        tenant_id -> Int8,
        document_id -> Int8,
        body -> Text,
        status -> Text,
        version -> Int8,
    }
}

#[derive(Queryable, Selectable, Versioned)]
#[diesel(table_name = documents)]
#[versioned(tenant = tenant_id, version = version, key = document_id, state = status)]
struct Document {
    tenant_id: i64,
    document_id: i64,
    body: String,
    status: String,
    version: i64,
}

// The state column itself is assignable: that is how a transition is written.
#[derive(VersionedChanges)]
#[versioned(model = Document)]
#[diesel(table_name = documents)]
struct Publish {
    status: String,
}

#[allow(dead_code)]
async fn publish(conn: &mut AsyncPgConnection) -> Result<Document, idem::VersionedError> {
    let row = Document::find(7).tenant(1).load(conn).await?;
    Document::update(7)
        .tenant(1)
        .expect_version(row.version)
        .expect_state("draft".to_owned())
        .set(&Publish {
            status: "published".to_owned(),
        })
        .execute(conn)
        .await
}

fn main() {}
