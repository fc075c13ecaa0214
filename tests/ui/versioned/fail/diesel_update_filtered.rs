use diesel::prelude::*;
use idem::{Versioned, VersionedChanges};

diesel::table! {
    documents (tenant_id, document_id) {
        tenant_id -> Int8,
        document_id -> Int8,
        body -> Text,
        version -> Int8,
    }
}

#[derive(Queryable, Selectable, Versioned)]
#[diesel(table_name = documents)]
#[versioned(tenant = tenant_id, version = version, key = document_id)]
struct Document {
    tenant_id: i64,
    document_id: i64,
    body: String,
    version: i64,
}

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
