// `key = (a, b)`: the key is a tuple in field order.
use diesel::prelude::*;
use diesel_async::AsyncPgConnection;
use idem::{Versioned, VersionedChanges};

diesel::table! {
    lines (tenant_id, order_id, line_no) {
        tenant_id -> Int8,
        order_id -> Int8,
        line_no -> Int4,
        quantity -> Int4,
        version -> Int8,
    }
}

#[derive(Queryable, Selectable, Versioned)]
#[diesel(table_name = lines)]
#[versioned(tenant = tenant_id, version = version, key = (order_id, line_no))]
struct Line {
    tenant_id: i64,
    order_id: i64,
    line_no: i32,
    quantity: i32,
    version: i64,
}

#[derive(VersionedChanges)]
#[versioned(model = Line)]
#[diesel(table_name = lines)]
struct SetQuantity {
    quantity: i32,
}

#[allow(dead_code)]
async fn use_it(conn: &mut AsyncPgConnection) -> Result<(), idem::VersionedError> {
    let row = Line::find((10, 1)).tenant(1).load(conn).await?;
    let row = Line::update((row.order_id, row.line_no))
        .tenant(row.tenant_id)
        .expect_version(row.version)
        .set(&SetQuantity { quantity: 3 })
        .execute(conn)
        .await?;
    Line::delete((10, 1))
        .tenant(1)
        .expect_version(row.version)
        .execute(conn)
        .await?;
    Ok(())
}

fn main() {}
