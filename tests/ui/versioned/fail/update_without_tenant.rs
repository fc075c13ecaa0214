use diesel::prelude::*;
use diesel_async::AsyncPgConnection;
use idem::{Versioned, VersionedChanges};

include!("../documents.rs");

#[derive(VersionedChanges)]
#[versioned(model = Document)]
#[diesel(table_name = documents)]
struct Edit {
    body: String,
}

// Without the tenant the version check could pass on another tenant's row.
async fn write(conn: &mut AsyncPgConnection, edit: &Edit) {
    let _ = Document::update(7)
        .expect_version(0)
        .set(edit)
        .execute(conn)
        .await;
}

fn main() {}
