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

// A delete decided on an old read must not remove a row changed since.
async fn remove(conn: &mut AsyncPgConnection) {
    let _ = Document::delete(7).tenant(1).execute(conn).await;
}

fn main() {}
