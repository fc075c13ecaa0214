// The expansions of both derives compile without a single warning, whatever
// lints the user denies; the enum is a model's state, a bind and a filter.
#![deny(warnings)]
#![deny(missing_docs, unused_qualifications, unused_results, unreachable_pub)]
#![deny(rust_2018_idioms, future_incompatible, nonstandard_style, unsafe_code)]
//! A crate that denies warnings and uses a state machine.

use diesel::prelude::*;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idem::versioned::{StateMachine, Transitioned};
use idem::{States, Versioned};

/// An order's life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, States)]
#[states(Pending => [Paid, Cancelled], Paid => [Shipped])]
pub enum OrderStatus {
    /// Awaiting payment.
    Pending,
    /// Paid.
    Paid,
    /// On its way.
    Shipped,
    /// Given up.
    Cancelled,
}

diesel::table! {
    /// Orders.
    orders (tenant_id, id) {
        /// Tenant.
        tenant_id -> Int8,
        /// Key.
        id -> Int8,
        /// State.
        status -> Text,
        /// Version.
        version -> Int8,
    }
}

/// An order.
#[derive(Debug, Clone, PartialEq, Queryable, Selectable, Versioned)]
#[diesel(table_name = orders)]
#[versioned(tenant = tenant_id, key = id, state = status)]
pub struct Order {
    /// Tenant.
    pub tenant_id: i64,
    /// Key.
    pub id: i64,
    /// State.
    pub status: OrderStatus,
    /// Version.
    pub version: i64,
}

/// Pays an order, a duplicate callback included.
pub async fn pay(conn: &mut AsyncPgConnection, version: i64) -> Result<bool, idem::VersionedError> {
    let outcome: Transitioned<Order> = Order::update(7)
        .tenant(1)
        .expect_version(version)
        .transition(OrderStatus::Pending, OrderStatus::Paid)
        .execute(conn)
        .await?;
    Ok(outcome.is_duplicate())
}

/// Every paid order, filtered by the enum itself.
pub async fn paid(conn: &mut AsyncPgConnection) -> QueryResult<Vec<Order>> {
    orders::table
        .filter(orders::status.eq(OrderStatus::Paid))
        .filter(orders::status.ne(&OrderStatus::Cancelled))
        .select(Order::as_select())
        .load(conn)
        .await
}

fn main() {
    assert!(OrderStatus::allowed(&OrderStatus::Paid, &OrderStatus::Shipped));
}
