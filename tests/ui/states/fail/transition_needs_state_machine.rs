// `.transition(..)` needs a state type that declares its transitions; a
// `String` state has `.expect_state(..)`.
use diesel::prelude::*;
use diesel_async::AsyncPgConnection;
use idem::Versioned;

diesel::table! {
    documents (tenant_id, id) {
        tenant_id -> Int8,
        id -> Int8,
        status -> Text,
        version -> Int8,
    }
}

#[derive(Queryable, Selectable, Versioned)]
#[diesel(table_name = documents)]
#[versioned(tenant = tenant_id, key = id, state = status)]
struct Document {
    tenant_id: i64,
    id: i64,
    status: String,
    version: i64,
}

async fn publish(conn: &mut AsyncPgConnection) {
    let _ = Document::update(7)
        .tenant(1)
        .expect_version(0)
        .transition("draft".to_owned(), "published".to_owned())
        .execute(conn)
        .await;
}

fn main() {}
