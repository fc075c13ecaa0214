//! The order service: its table, its events, and the writers that drive
//! every order through created → paid → shipped, one transaction per step,
//! each emitting its event with `idem::outbox::emit`.

use std::time::Duration;

use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idem::outbox::{emit, EmitError, Event};
use idem::{idempotent, retryable, Pool};
use serde::{Deserialize, Serialize};

/// The producer's table, the consumer's applied log and its per-order
/// progress. `chaos_applied` has no unique constraint on purpose: an event
/// applied twice would leave two rows, and the report counts them.
pub const SCHEMA: &str = "
    CREATE TABLE chaos_orders (
        id     bigint PRIMARY KEY,
        status text   NOT NULL,
        amount bigint NOT NULL
    );
    CREATE TABLE chaos_applied (
        order_id   bigint      NOT NULL,
        step       bigint      NOT NULL,
        in_order   boolean     NOT NULL,
        applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
    );
    CREATE INDEX ON chaos_applied (order_id, step);
    CREATE TABLE chaos_progress (
        order_id  bigint PRIMARY KEY,
        last_step bigint NOT NULL
    );
";

/// The steps of an order, in the order they happen; an event's `step` is
/// its 1-based position here.
pub const STEPS: [&str; 3] = ["created", "paid", "shipped"];

/// The key space of `create_order` in `idem_requests`.
const SCOPE: &str = "outbox-chaos";

/// What every step emits. The key is the order, so the relays publish an
/// order's events in commit order; `step` lets the consumer check that.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderChanged {
    pub order: i64,
    pub step: i64,
    pub status: String,
}

impl Event for OrderChanged {
    const KIND: &'static str = "order.changed";
    const VERSION: u32 = 1;
    fn key(&self) -> String {
        order_key(self.order)
    }
    fn subject(&self) -> String {
        format!("order.{}", self.status)
    }
}

/// The outbox key (and the stream's `Idem-Event-Key`) of an order.
pub fn order_key(order: i64) -> String {
    format!("order-{order}")
}

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error(transparent)]
    Db(#[from] diesel::result::Error),
    #[error(transparent)]
    Idem(#[from] idem::Error),
    #[error(transparent)]
    Emit(#[from] EmitError),
    #[error("order {0} is not in the state this step needs")]
    WrongState(i64),
}

idem::final_errors!(AppError);

pub struct CreateOrder {
    pub order: i64,
    pub amount: i64,
    /// The client's idempotency key.
    pub request: String,
}

/// Step 1, behind an idempotency key: a client that sends the request twice
/// (here: some orders are sent twice at once) gets one order and one event;
/// the copy replays the first answer and emits nothing.
#[idempotent(key = cmd.request, scope = SCOPE, fingerprint(cmd.order, cmd.amount))]
#[retryable(max = 8, deadline_ms = 20000)]
async fn create_order(conn: &mut AsyncPgConnection, cmd: &CreateOrder) -> Result<i64, AppError> {
    diesel::sql_query("INSERT INTO chaos_orders (id, status, amount) VALUES ($1, 'created', $2)")
        .bind::<BigInt, _>(cmd.order)
        .bind::<BigInt, _>(cmd.amount)
        .execute(conn)
        .await?;
    emit(conn, &changed(cmd.order, 1)).await?;
    Ok(cmd.order)
}

/// Steps 2 and 3: move the order from the previous status to the next and
/// announce it, in one transaction (replayed on serialization failures).
#[retryable(max = 8, deadline_ms = 20000)]
async fn advance(conn: &mut AsyncPgConnection, order: i64, step: i64) -> Result<(), AppError> {
    let (from, to) = (STEPS[step as usize - 2], STEPS[step as usize - 1]);
    let moved =
        diesel::sql_query("UPDATE chaos_orders SET status = $3 WHERE id = $1 AND status = $2")
            .bind::<BigInt, _>(order)
            .bind::<Text, _>(from)
            .bind::<Text, _>(to)
            .execute(conn)
            .await?;
    if moved != 1 {
        return Err(AppError::WrongState(order));
    }
    emit(conn, &changed(order, step)).await?;
    Ok(())
}

fn changed(order: i64, step: i64) -> OrderChanged {
    OrderChanged {
        order,
        step,
        status: STEPS[step as usize - 1].to_owned(),
    }
}

/// Run one order through all its steps. Every `twice`-th order's creation
/// is sent twice at once, as a client retrying over a flaky network would.
async fn run_order(pool: &Pool, order: i64, twice: i64) -> Result<(), AppError> {
    let cmd = CreateOrder {
        order,
        amount: 100 + order % 900,
        request: format!("create-{order}"),
    };
    if order % twice == 0 {
        let (a, b) = tokio::join!(create_order(pool, &cmd), create_order(pool, &cmd));
        let (a, b) = (a?, b?);
        assert_eq!(a.value, b.value);
        assert!(a.replayed != b.replayed, "one call ran, the other replayed");
    } else {
        create_order(pool, &cmd).await?;
    }
    for step in 2..=STEPS.len() as i64 {
        advance(pool, order, step).await?;
    }
    Ok(())
}

/// `writers` tasks share the orders `0..orders`, each order run start to
/// end by one writer, paced so the whole takes about `span`: the relays'
/// deaths then land while events are still being written.
pub async fn produce(
    pool: Pool,
    orders: i64,
    writers: i64,
    span: Duration,
) -> Result<(), AppError> {
    let per_writer = (orders + writers - 1) / writers;
    let tick = span / u32::try_from(per_writer.max(1)).unwrap_or(u32::MAX);
    let tasks: Vec<_> = (0..writers)
        .map(|w| {
            let pool = pool.clone();
            tokio::spawn(async move {
                let mut pace = tokio::time::interval(tick);
                pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                for order in (w..orders).step_by(writers as usize) {
                    pace.tick().await;
                    run_order(&pool, order, 10).await?;
                }
                Ok::<_, AppError>(())
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("a writer panicked")?;
    }
    Ok(())
}
