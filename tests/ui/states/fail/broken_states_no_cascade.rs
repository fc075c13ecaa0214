// One misspelt state in the table is one error: the model that uses the enum
// as its state, and the transitions below, add none of their own.
use diesel::prelude::*;
use diesel_async::AsyncPgConnection;
use idem::Versioned;

#[derive(Debug, Clone, Copy, PartialEq, idem::States)]
#[states(Pending => Payd)]
enum OrderStatus {
    Pending,
    Paid,
}

include!("../orders.rs");

async fn pay(conn: &mut AsyncPgConnection) -> Result<Order, idem::VersionedError> {
    let order = Order::find(7).tenant(1).load(conn).await?;
    let paid = Order::update(7)
        .tenant(1)
        .expect_version(order.version)
        .transition(OrderStatus::Pending, OrderStatus::Paid)
        .execute(conn)
        .await?;
    Ok(paid.into_row())
}

fn main() {}
