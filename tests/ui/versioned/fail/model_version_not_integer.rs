use diesel::prelude::*;
use idem::Versioned;

diesel::table! {
    documents (tenant_id, document_id) {
        tenant_id -> Int8,
        document_id -> Int8,
        body -> Text,
        status -> Text,
        version -> Text,
    }
}

// A version is an integer; a String cannot be compared and bumped.
#[derive(Queryable, Selectable, Versioned)]
#[diesel(table_name = documents)]
#[versioned(tenant = tenant_id, version = version, key = document_id)]
struct Document {
    tenant_id: i64,
    document_id: i64,
    body: String,
    status: String,
    version: String,
}

fn main() {}
