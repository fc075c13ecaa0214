use diesel::prelude::*;
use idem::Versioned;

diesel::table! {
    events (tenant_id, id) {
        tenant_id -> Int8,
        id -> Int8,
        request_id -> Text,
        body -> Json,
        status -> Text,
        version -> Int8,
    }
}

// `json` has no `=` in PostgreSQL: every repeat would fail at run time.
#[derive(Queryable, Selectable, Versioned)]
#[diesel(table_name = events)]
#[versioned(tenant = tenant_id, key = id, create_once(key = request_id, fingerprint(id, body)))]
struct Event {
    tenant_id: i64,
    id: i64,
    request_id: String,
    body: serde_json::Value,
    status: String,
    version: i64,
}

// The state changes with every transition: a repeat after one would create
// a second row.
#[derive(Queryable, Selectable, Versioned)]
#[diesel(table_name = events)]
#[versioned(tenant = tenant_id, key = id, state = status, create_once(key = status, fingerprint(id)))]
struct ByState {
    tenant_id: i64,
    id: i64,
    request_id: String,
    body: serde_json::Value,
    status: String,
    version: i64,
}

fn main() {}
