#![deny(warnings)]
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

diesel::table! {
    tags (name) {
        name -> Text,
        label -> Nullable<Text>,
        version -> Int4,
    }
}

#[derive(Queryable, Selectable, Versioned)]
#[diesel(table_name = orders)]
#[versioned(tenant = tenant_id, key = id, state = status,
            create_once(key = request_id, fingerprint(id, amount)))]
struct Order {
    tenant_id: i64,
    id: i64,
    request_id: String,
    amount: i64,
    status: String,
    version: i64,
}

// No tenant, a composite key that may be NULL, the key alone naming the request.
#[derive(Queryable, Selectable, Versioned)]
#[diesel(table_name = tags)]
#[versioned(tenant = none, key = name, create_once(key = (name, label), fingerprint()))]
struct Tag {
    name: String,
    label: Option<String>,
    version: i32,
}

async fn create(
    conn: &mut AsyncPgConnection,
    order: &Order,
    tag: &Tag,
) -> Result<(Order, Tag), idem::CreateOnceError> {
    let order = order.create_once(conn).await?.into_row();
    let tag = tag.create_once(conn).await?.into_row();
    Ok((order, tag))
}

fn main() {
    let _ = create;
}
