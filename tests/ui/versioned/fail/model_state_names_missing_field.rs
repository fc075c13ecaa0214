use diesel::prelude::*;
use idem::Versioned;

diesel::table! {
    documents (tenant_id, document_id) {
        tenant_id -> Int8,
        document_id -> Int8,
        body -> Text,
        status -> Text,
        version -> Int8,
    }
}

// The state must be a field of the model.
#[derive(Queryable, Selectable, Versioned)]
#[diesel(table_name = documents)]
#[versioned(tenant = tenant_id, version = version, key = document_id, state = state)]
struct Document {
    tenant_id: i64,
    document_id: i64,
    body: String,
    status: String,
    version: i64,
}

fn main() {}
