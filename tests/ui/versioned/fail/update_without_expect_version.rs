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

// Without the version the update would overwrite every change made since the read.
async fn write(conn: &mut AsyncPgConnection, edit: &Edit) {
    let _ = Document::update(7).tenant(1).set(edit).execute(conn).await;
}

fn main() {}
