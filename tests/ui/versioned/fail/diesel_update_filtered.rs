use diesel::prelude::*;
use idem::{Versioned, VersionedChanges};

include!("../documents.rs");

#[derive(VersionedChanges)]
#[versioned(model = Document)]
#[diesel(table_name = documents)]
struct Edit {
    body: String,
}

// A plain diesel update of one row, with the changeset by value, bypasses it too.
fn one_row() {
    let edit = Edit {
        body: String::new(),
    };
    let _ = diesel::update(documents::table.filter(documents::document_id.eq(1))).set(edit);
}

fn main() {}
