use diesel::prelude::*;
use idem::{Versioned, VersionedChanges};

include!("../documents.rs");

// Moving a row to another tenant is not an edit.
#[derive(VersionedChanges)]
#[versioned(model = Document)]
#[diesel(table_name = documents)]
struct Edit {
    body: String,
    tenant_id: i64,
}

fn main() {}
