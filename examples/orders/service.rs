//! The order service of seed 003: an order is created once per request id,
//! the key on the order row itself (the seed's `t_order` with
//! `uk_idempotent_key`); its status moves along a declared
//! state machine over a version column; a payment callback is idempotent
//! under the provider's transaction id (over HTTP) and deduplicated by the
//! inbox (over NATS); an operator's edit that loses to a concurrent write is
//! compensated through the delay queue instead of failing.

use diesel::prelude::*;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idem::idempotency::ReplayCache;
use idem::jobs::{enqueue_after, EnqueueError, Job};
use idem::versioned::Transitioned;
use idem::{
    idempotent, retryable, CreateOnceError, Creation, States, Versioned, VersionedChanges,
    VersionedError,
};
use scoped_futures::{ScopedBoxFuture, ScopedFutureExt};
use serde::{Deserialize, Serialize};

diesel::table! {
    ord_orders (tenant_id, id) {
        tenant_id -> Int8,
        id -> Int8,
        request_id -> Text,
        status -> Text,
        amount -> Int8,
        note -> Text,
        version -> Int8,
    }
}

/// The service's tables. `uk_idempotent_key` is seed 003's first layer: the
/// caller's request id is unique per tenant on the order row, so a repeated
/// create finds the order instead of making a second one. `ord_payments` and
/// `ord_edits` have no unique constraint on purpose: a double payment or a
/// lost race applied twice would show there as a second row, not as an
/// error.
pub const SCHEMA: &str = "
CREATE TABLE ord_orders (
    tenant_id bigint NOT NULL,
    id bigint NOT NULL,
    request_id text NOT NULL,
    status text NOT NULL,
    amount bigint NOT NULL CHECK (amount > 0),
    note text NOT NULL DEFAULT '',
    version bigint NOT NULL DEFAULT 0 CHECK (version >= 0),
    PRIMARY KEY (tenant_id, id),
    CONSTRAINT uk_idempotent_key UNIQUE (tenant_id, request_id));
CREATE TABLE ord_payments (
    id bigserial PRIMARY KEY,
    order_id bigint NOT NULL,
    txn text NOT NULL,
    via text NOT NULL);
CREATE TABLE ord_edits (
    id bigserial PRIMARY KEY,
    order_id bigint NOT NULL,
    note text NOT NULL,
    via text NOT NULL);
CREATE TABLE ord_arrivals (
    id bigserial PRIMARY KEY,
    txn text NOT NULL,
    via text NOT NULL);
";

/// One shop: the example has a single tenant.
pub const TENANT: i64 = 1;

/// The payment provider's key space: its transaction ids are unique to it,
/// and a replay answers only the provider.
pub const PROVIDER: &str = "provider:acme-pay";

/// The order's life, declared once: anything else is refused before SQL.
#[derive(Debug, Clone, Copy, PartialEq, Eq, States, Serialize, Deserialize)]
#[states(Pending => [Paid, Cancelled], Paid => Shipped)]
pub enum Status {
    Pending,
    Paid,
    Shipped,
    Cancelled,
}

/// An order. A repeated create must ask for the same id and amount (what the
/// request fixes); its status, note and version change after it.
#[derive(Debug, Clone, Queryable, Selectable, Versioned, Serialize, Deserialize)]
#[diesel(table_name = ord_orders)]
#[versioned(tenant = tenant_id, key = id, state = status,
            create_once(key = request_id, fingerprint(id, amount)))]
pub struct Order {
    pub tenant_id: i64,
    pub id: i64,
    pub request_id: String,
    pub status: Status,
    pub amount: i64,
    pub note: String,
    pub version: i64,
}

#[derive(VersionedChanges)]
#[versioned(model = Order)]
#[diesel(table_name = ord_orders)]
pub struct SetNote {
    pub note: String,
}

/// What a caller may be told no to, for good: stored under the key and
/// replayed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Declined {
    UnknownOrder,
    WrongAmount { expected: i64 },
    Cancelled,
}

#[derive(Debug, thiserror::Error)]
pub enum OrderError {
    #[error(transparent)]
    Idem(#[from] idem::Error),
    #[error(transparent)]
    Db(#[from] diesel::result::Error),
    #[error(transparent)]
    Versioned(#[from] VersionedError),
    #[error(transparent)]
    Enqueue(#[from] EnqueueError),
    #[error(transparent)]
    Once(#[from] CreateOnceError),
    #[error("declined: {0:?}")]
    Declined(Declined),
}
idem::final_errors!(OrderError::Declined(Declined));

/// A payment callback: the provider's transaction id is its idempotency key.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Callback {
    pub txn: String,
    pub order: i64,
    pub amount: i64,
}

/// What the provider is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Paid {
    /// This callback moved the order to paid.
    Paid,
    /// The order was already paid (another delivery, by the other path):
    /// answered as success so the provider stops retrying (seed 003 §4.3).
    AlreadyPaid,
}

/// The payment's effect, shared by both paths: `pending → paid` at the
/// version just read, and one payment row when it applied.
pub async fn apply_payment(
    conn: &mut AsyncPgConnection,
    cb: &Callback,
    via: &str,
) -> Result<Paid, OrderError> {
    let order = match Order::find(cb.order).tenant(TENANT).load(conn).await {
        Ok(order) => order,
        Err(VersionedError::NotFound) => return Err(OrderError::Declined(Declined::UnknownOrder)),
        Err(e) => return Err(e.into()),
    };
    if order.amount != cb.amount {
        return Err(OrderError::Declined(Declined::WrongAmount {
            expected: order.amount,
        }));
    }
    match order.status {
        Status::Pending => {}
        Status::Paid | Status::Shipped => return Ok(Paid::AlreadyPaid),
        Status::Cancelled => return Err(OrderError::Declined(Declined::Cancelled)),
    }
    let outcome = Order::update(cb.order)
        .tenant(TENANT)
        .expect_version(order.version)
        .transition(Status::Pending, Status::Paid)
        .execute(conn)
        .await?;
    match outcome {
        Transitioned::Applied(_) => {
            diesel::sql_query("INSERT INTO ord_payments (order_id, txn, via) VALUES ($1, $2, $3)")
                .bind::<diesel::sql_types::BigInt, _>(cb.order)
                .bind::<diesel::sql_types::Text, _>(&cb.txn)
                .bind::<diesel::sql_types::Text, _>(via)
                .execute(conn)
                .await?;
            Ok(Paid::Paid)
        }
        // The row is already paid at the version after ours: the other
        // path's delivery of the same payment got there first.
        Transitioned::Duplicate(_) => Ok(Paid::AlreadyPaid),
    }
}

/// The HTTP callback: once per provider transaction id, replayed from Redis
/// when the cache has it, from `idem_requests` otherwise.
#[idempotent(key = cb.txn, scope = PROVIDER, fingerprint(cb.order, cb.amount), cache = cache)]
#[retryable(max = 6, deadline_ms = 3000)]
pub async fn payment_callback(
    conn: &mut AsyncPgConnection,
    cache: Option<&ReplayCache>,
    cb: &Callback,
) -> Result<Paid, OrderError> {
    apply_payment(conn, cb, "http").await
}

/// The NATS path's effect, run by the inbox in the transaction that records
/// the message.
pub fn payment_message<'c>(
    conn: &'c mut AsyncPgConnection,
    payload: &'c [u8],
) -> ScopedBoxFuture<'static, 'c, Result<Paid, OrderError>> {
    async move {
        let cb: Callback = serde_json::from_slice(payload)
            .map_err(|_| OrderError::Declined(Declined::UnknownOrder))?;
        apply_payment(conn, &cb, "nats").await
    }
    .scope_boxed()
}

/// A new order, once per request id.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NewOrder {
    pub request_id: String,
    pub id: i64,
    pub amount: i64,
}

/// Creates the order once per request id, with no record beside it: the
/// key is on the order row (`uk_idempotent_key`). A repeat with the same id
/// and amount gets the order as it is now ([`Creation::Existing`]); the id
/// reused with another id or amount is [`CreateOnceError::Mismatch`], and
/// nothing is written.
#[retryable(max = 4, deadline_ms = 3000)]
pub async fn create_order(
    conn: &mut AsyncPgConnection,
    req: &NewOrder,
) -> Result<Creation<Order>, OrderError> {
    Ok(Order {
        tenant_id: TENANT,
        id: req.id,
        request_id: req.request_id.clone(),
        status: Status::Pending,
        amount: req.amount,
        note: String::new(),
        version: 0,
    }
    .create_once(conn)
    .await?)
}

/// An operator's edit of the note, computed from the version they saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Edited {
    /// Written at the version the operator saw.
    Applied,
    /// That version was gone: the edit is queued and made later on the
    /// latest version (seed 003 §5.2, strategy 3).
    Compensating,
    /// That version was gone, and the caller asked to be told (strategy 1).
    Lost,
}

/// Re-apply an operator's note on the order's latest version.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReapplyNote {
    pub order: i64,
    pub note: String,
}

impl Job for ReapplyNote {
    const KIND: &'static str = "orders.reapply_note";
    fn key(&self) -> String {
        format!("order-{}", self.order)
    }
}

/// Writes `note` if the order is still at `seen`; otherwise, with
/// `compensate`, enqueues the edit (in this transaction) to be made after
/// the ladder's first step.
#[retryable(max = 4, deadline_ms = 3000)]
pub async fn operator_edit(
    conn: &mut AsyncPgConnection,
    order: i64,
    seen: i64,
    note: &str,
    compensate: Option<std::time::Duration>,
) -> Result<Edited, OrderError> {
    let written = Order::update(order)
        .tenant(TENANT)
        .expect_version(seen)
        .set(&SetNote {
            note: note.to_owned(),
        })
        .execute(conn)
        .await;
    match (written, compensate) {
        (Ok(_), _) => {
            record_edit(conn, order, note, "operator").await?;
            Ok(Edited::Applied)
        }
        (Err(VersionedError::Stale { .. }), Some(delay)) => {
            let job = ReapplyNote {
                order,
                note: note.to_owned(),
            };
            enqueue_after(conn, &job, delay).await?;
            Ok(Edited::Compensating)
        }
        (Err(VersionedError::Stale { .. }), None) => Ok(Edited::Lost),
        (Err(e), _) => Err(e.into()),
    }
}

/// The compensation job's handler: read the latest version and write the
/// note on it; a write that loses again fails the run, and the ladder makes
/// the next one.
pub fn reapply_note<'c>(
    conn: &'c mut AsyncPgConnection,
    job: &'c ReapplyNote,
) -> ScopedBoxFuture<'static, 'c, Result<(), OrderError>> {
    async move {
        let order = Order::find(job.order).tenant(TENANT).load(conn).await?;
        Order::update(job.order)
            .tenant(TENANT)
            .expect_version(order.version)
            .set(&SetNote {
                note: job.note.clone(),
            })
            .execute(conn)
            .await?;
        record_edit(conn, job.order, &job.note, "compensation").await
    }
    .scope_boxed()
}

async fn record_edit(
    conn: &mut AsyncPgConnection,
    order: i64,
    note: &str,
    via: &str,
) -> Result<(), OrderError> {
    diesel::sql_query("INSERT INTO ord_edits (order_id, note, via) VALUES ($1, $2, $3)")
        .bind::<diesel::sql_types::BigInt, _>(order)
        .bind::<diesel::sql_types::Text, _>(note)
        .bind::<diesel::sql_types::Text, _>(via)
        .execute(conn)
        .await?;
    Ok(())
}

/// A delivery reached the service: logged in a statement of its own, before
/// any deduplication, so the callbacks are counted by the database.
pub async fn log_arrival(
    conn: &mut AsyncPgConnection,
    txn: &str,
    via: &str,
) -> Result<(), diesel::result::Error> {
    diesel::sql_query("INSERT INTO ord_arrivals (txn, via) VALUES ($1, $2)")
        .bind::<diesel::sql_types::Text, _>(txn)
        .bind::<diesel::sql_types::Text, _>(via)
        .execute(conn)
        .await
        .map(drop)
}
