// The `documents` table and its `Document` model, shared by the #[derive(Versioned)]
// cases: `include!("../documents.rs");` (relative to the including case, which
// imports `diesel::prelude::*` and `idem::Versioned`). A case whose point is the
// model or the table itself keeps its own.

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
