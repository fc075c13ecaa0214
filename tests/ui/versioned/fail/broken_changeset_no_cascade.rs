use diesel::prelude::*;
use diesel_async::AsyncPgConnection;
use idem::{Versioned, VersionedChanges};

include!("../documents.rs");

// A changeset with a misspelt key is one error: the update that uses it adds
// none of its own.
#[derive(VersionedChanges)]
#[versioned(modle = Document)]
#[versioned(model = Document)]
#[diesel(table_name = documents)]
struct Edit {
    body: String,
}

async fn edit(conn: &mut AsyncPgConnection) -> Result<Document, idem::VersionedError> {
    Document::update(7)
        .tenant(1)
        .expect_version(3)
        .set(&Edit {
            body: String::new(),
        })
        .execute(conn)
        .await
}

fn main() {}
