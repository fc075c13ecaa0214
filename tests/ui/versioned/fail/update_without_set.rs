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

// An update that sets nothing would only bump the version.
async fn write(conn: &mut AsyncPgConnection) {
    let _ = Document::update(7)
        .tenant(1)
        .expect_version(0)
        .execute(conn)
        .await;
}

fn main() {}
