use diesel::prelude::*;
use idem::{Versioned, VersionedChanges};

include!("../documents.rs");

#[derive(VersionedChanges)]
#[versioned(model = Document)]
#[diesel(table_name = documents)]
struct Edit {
    body: String,
}

// A plain diesel update of the whole table bypasses the version check.
fn bulk() {
    let edit = Edit {
        body: String::new(),
    };
    let _ = diesel::update(documents::table).set(&edit);
}

fn main() {}
