use diesel::prelude::*;
use idem::{Versioned, VersionedChanges};

include!("../documents.rs");

// The key says which row is written; a changeset must not change it.
#[derive(VersionedChanges)]
#[versioned(model = Document)]
#[diesel(table_name = documents)]
struct Edit {
    document_id: i64,
    body: String,
}

fn main() {}
