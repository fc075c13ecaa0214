use diesel::prelude::*;
use idem::{Versioned, VersionedChanges};

include!("../documents.rs");

// A changeset must say which table it writes.
#[derive(VersionedChanges)]
#[versioned(model = Document)]
struct Edit {
    body: String,
}

fn main() {}
