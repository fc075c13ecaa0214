// A transition is a versioned write: it needs the version it was decided on.
use diesel::prelude::*;
use diesel_async::AsyncPgConnection;
use idem::Versioned;

#[derive(Debug, Clone, Copy, PartialEq, idem::States)]
#[states(Pending => Paid)]
enum OrderStatus {
    Pending,
    Paid,
}

include!("../orders.rs");

async fn pay(conn: &mut AsyncPgConnection) {
    let _ = Order::update(7)
        .tenant(1)
        .transition(OrderStatus::Pending, OrderStatus::Paid)
        .execute(conn)
        .await;
}

fn main() {}
