// An `integer` version column maps to `i32`; versions are still reported as `i64`.
use diesel::prelude::*;
use diesel_async::AsyncPgConnection;
use idem::{Versioned, VersionedChanges};

diesel::table! {
    notes (tenant_id, id) {
        tenant_id -> Int8,
        id -> Int8,
        text -> Text,
        revision -> Int4,
    }
}

#[derive(Queryable, Selectable, Versioned)]
#[diesel(table_name = notes)]
#[versioned(tenant = tenant_id, version = revision, key = id)]
struct Note {
    tenant_id: i64,
    id: i64,
    text: String,
    revision: i32,
}

#[derive(VersionedChanges)]
#[versioned(model = Note)]
#[diesel(table_name = notes)]
struct SetText {
    text: String,
}

#[allow(dead_code)]
async fn use_it(conn: &mut AsyncPgConnection) -> Result<(), idem::VersionedError> {
    let row = Note::find(1).tenant(1).load(conn).await?;
    let version: i64 = row.version();
    let change = SetText {
        text: String::new(),
    };
    Note::update(1)
        .tenant(1)
        .expect_version(version)
        .set(&change)
        .execute(conn)
        .await?;
    Ok(())
}

fn main() {}
