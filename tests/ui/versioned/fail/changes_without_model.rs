use diesel::prelude::*;
use idem::{Versioned, VersionedChanges};

include!("../documents.rs");

// A changeset must say which model it edits.
#[derive(VersionedChanges)]
#[diesel(table_name = documents)]
struct Edit {
    body: String,
}

fn main() {}
