use diesel::prelude::*;
use diesel_async::AsyncPgConnection;
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

// Every misplaced field is reported at once, and the call below adds no
// error of its own.
#[derive(Queryable, Selectable, Versioned)]
#[diesel(table_name = orders)]
#[versioned(tenant = tenant_id, key = id, state = status,
            create_once(key = (tenant_id, request_id), fingerprint(amount, version, status, request_id, amount)))]
struct Order {
    tenant_id: i64,
    id: i64,
    request_id: String,
    amount: i64,
    status: String,
    version: i64,
}

async fn create(conn: &mut AsyncPgConnection, order: &Order) {
    let _ = order.create_once(conn).await;
}

fn main() {}
