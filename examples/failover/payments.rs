//! The payment service and the consumer of its events: the tables, the
//! event, the `#[idempotent]` payment and the inbox's effect.

use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idem::outbox::{emit, EmitError, Event};
use idem::{idempotent, retryable};
use scoped_futures::{ScopedBoxFuture, ScopedFutureExt};
use serde::{Deserialize, Serialize};

/// The service's payments and the consumer's applied effects. Neither has
/// a unique constraint on the key or the payment: a payment made twice for
/// one key, or an event applied twice, leaves a second row to count.
/// `payment_id` is drawn by the server in the payment's transaction, so a
/// payment that a failover erased and a retry made again has a new id.
pub const SCHEMA: &str = "
    CREATE TABLE failover_payments (
        payment_id uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
        key        text        NOT NULL,
        amount     bigint      NOT NULL,
        created_at timestamptz NOT NULL DEFAULT clock_timestamp()
    );
    CREATE INDEX ON failover_payments (key);
    CREATE TABLE failover_effects (
        payment_id uuid        NOT NULL,
        key        text        NOT NULL,
        applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
    );
    CREATE INDEX ON failover_effects (payment_id);
";

/// The key space of the payments in `idem_requests`.
const SCOPE: &str = "failover";

/// The durable consumer's name, which is also the inbox's key space.
pub const CONSUMER: &str = "failover-ledger";

/// What a payment emits, in its transaction.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PaymentMade {
    pub key: String,
    pub payment_id: String,
    pub amount: i64,
}

impl Event for PaymentMade {
    const KIND: &'static str = "payment.made";
    const VERSION: u32 = 1;
    fn key(&self) -> String {
        self.key.clone()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error(transparent)]
    Db(#[from] diesel::result::Error),
    #[error(transparent)]
    Idem(#[from] idem::Error),
    #[error(transparent)]
    Emit(#[from] EmitError),
    #[error("not a PaymentMade: {0}")]
    Body(String),
}

idem::final_errors!(AppError);

/// A client's payment request.
pub struct PaymentCmd {
    /// The idempotency key.
    pub key: String,
    pub amount: i64,
}

impl PaymentCmd {
    /// The request for payment number `n`: key and amount follow from `n`,
    /// so every send of it carries the same fingerprint.
    pub fn new(n: usize) -> PaymentCmd {
        PaymentCmd {
            key: key_of(n),
            amount: 100 + (n % 900) as i64,
        }
    }
}

pub fn key_of(n: usize) -> String {
    format!("pay-{n}")
}

#[derive(diesel::QueryableByName)]
struct Made {
    #[diesel(sql_type = Text)]
    payment_id: String,
}

/// One payment row and its event, in one transaction behind the key; the
/// answer is the payment's id, which a replay returns too. Statements are
/// bounded by the deadline and a `COMMIT` by `commit_timeout_ms`: during a
/// failover a call fails (503-like) and the client sends the key again.
#[idempotent(key = cmd.key, scope = SCOPE, fingerprint(cmd.amount))]
#[retryable(max = 6, deadline_ms = 4000, commit_timeout_ms = 3000)]
pub async fn pay(conn: &mut AsyncPgConnection, cmd: &PaymentCmd) -> Result<String, AppError> {
    let made: Made = diesel::sql_query(
        "INSERT INTO failover_payments (key, amount) VALUES ($1, $2) RETURNING payment_id::text",
    )
    .bind::<Text, _>(&cmd.key)
    .bind::<BigInt, _>(cmd.amount)
    .get_result(conn)
    .await?;
    emit(
        conn,
        &PaymentMade {
            key: cmd.key.clone(),
            payment_id: made.payment_id.clone(),
            amount: cmd.amount,
        },
    )
    .await?;
    Ok(made.payment_id)
}

/// The consumer's effect, in the inbox's transaction: one row per applied
/// event.
pub fn apply<'c>(
    conn: &'c mut AsyncPgConnection,
    payload: &'c [u8],
) -> ScopedBoxFuture<'static, 'c, Result<(), AppError>> {
    async move {
        let event: PaymentMade =
            serde_json::from_slice(payload).map_err(|e| AppError::Body(e.to_string()))?;
        diesel::sql_query("INSERT INTO failover_effects (payment_id, key) VALUES ($1::uuid, $2)")
            .bind::<Text, _>(&event.payment_id)
            .bind::<Text, _>(&event.key)
            .execute(conn)
            .await?;
        Ok(())
    }
    .scope_boxed()
}
