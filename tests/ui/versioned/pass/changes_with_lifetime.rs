// A changeset may borrow its values.
use diesel::prelude::*;
use diesel_async::AsyncPgConnection;
use idem::{Versioned, VersionedChanges};

include!("../documents.rs");

#[derive(VersionedChanges)]
#[versioned(model = Document)]
#[diesel(table_name = documents)]
struct Edit<'a> {
    body: &'a str,
}

#[allow(dead_code)]
async fn use_it(
    conn: &mut AsyncPgConnection,
    body: &str,
) -> Result<Document, idem::VersionedError> {
    let edit = Edit { body };
    Document::update(7)
        .tenant(1)
        .expect_version(0)
        .set(&edit)
        .execute(conn)
        .await
}

fn main() {}
