use diesel::prelude::*;
use idem::Versioned;

diesel::table! {
    orders (tenant_id, id) {
        tenant_id -> Int8,
        id -> Int8,
        request_id -> Text,
        amount -> Int8,
        status -> Text,
        version -> Int8,
    }
}

#[derive(Queryable, Selectable, Versioned)]
#[diesel(table_name = orders)]
#[versioned(tenant = tenant_id, key = id, create_once(key = request, fingerprint(amount, currency)))]
struct Order {
    tenant_id: i64,
    id: i64,
    request_id: String,
    amount: i64,
    status: String,
    version: i64,
}

fn main() {}
