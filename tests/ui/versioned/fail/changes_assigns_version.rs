use diesel::prelude::*;
use idem::{Versioned, VersionedChanges};

include!("../documents.rs");

// idem bumps the version itself; a changeset must not assign it.
#[derive(VersionedChanges)]
#[versioned(model = Document)]
#[diesel(table_name = documents)]
struct Edit {
    body: String,
    version: i64,
}

fn main() {}
