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

// A read without the tenant could return another tenant's row.
async fn read(conn: &mut AsyncPgConnection) {
    let _ = Document::find(7).load(conn).await;
}

fn main() {}
