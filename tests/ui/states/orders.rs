// The `orders` table, shared by the #[derive(States)] cases that need a model:
// `include!("../orders.rs");` after declaring `OrderStatus` (the including
// case imports `diesel::prelude::*` and `idem::Versioned`).

diesel::table! {
    orders (tenant_id, id) {
        tenant_id -> Int8,
        id -> Int8,
        status -> Text,
        version -> Int8,
    }
}

#[derive(Debug, Clone, PartialEq, Queryable, Selectable, Versioned)]
#[diesel(table_name = orders)]
#[versioned(tenant = tenant_id, key = id, state = status)]
struct Order {
    tenant_id: i64,
    id: i64,
    status: OrderStatus,
    version: i64,
}
