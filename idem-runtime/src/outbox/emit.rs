//! Writing an event into the outbox, in the caller's transaction.

use diesel::sql_types::{BigInt, Jsonb, Text, Uuid as SqlUuid};
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use super::event::{self, Event, EventId, InvalidEvent};
use crate::error::Unstorable;
use crate::retry::{RetryCause, Transient};

/// Why [`emit`] wrote nothing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EmitError {
    /// Called outside an attempt of a `#[retryable]` or `#[idempotent]`
    /// function (or [`retry`](crate::retry::retry)): there is no business
    /// transaction for the event to commit with.
    #[error("outbox::emit called outside an attempt of a retry loop: an event is written only in the business transaction it announces")]
    OutsideAttempt,
    /// Called inside an attempt, but with a connection in no transaction:
    /// not the one the attempt lent the body (a connection the body opened
    /// itself, say). The event would commit at once, whatever became of the
    /// business transaction. Emit on the attempt's connection.
    #[error("outbox::emit was given a connection in no transaction, not the attempt's: the event would commit on its own, whatever became of the business transaction; emit on the connection the attempt lent")]
    NoTransaction,
    /// The event's key or subject breaks the rules of [`Event`].
    #[error(transparent)]
    Invalid(#[from] InvalidEvent),
    /// The event did not serialize to JSON.
    #[error("event {kind} did not serialize to JSON: {source}")]
    Serialize {
        /// [`Event::KIND`].
        kind: &'static str,
        /// What serde said.
        #[source]
        source: serde_json::Error,
    },
    /// The event's JSON could not be stored and read back by the relay: a
    /// string or key with U+0000 (`jsonb` refuses it), or arrays and objects
    /// nested deeper than [`MAX_STORED_DEPTH`](crate::idempotency::MAX_STORED_DEPTH).
    #[error("event {kind} cannot be stored: {source}")]
    Unstorable {
        /// [`Event::KIND`].
        kind: &'static str,
        /// What is wrong with its JSON.
        #[source]
        source: Unstorable,
    },
    /// The insert failed. A serialization failure or a deadlock here is
    /// replayed by the retry loop like any other statement of the attempt.
    #[error("writing the outbox row failed: {0}")]
    Database(#[from] diesel::result::Error),
}

impl Transient for EmitError {
    fn transient(&self) -> Option<RetryCause> {
        match self {
            EmitError::Database(e) => e.transient(),
            _ => None,
        }
    }
}

/// Takes the key's next sequence number. The upsert holds the key's row lock
/// until the transaction ends, so a second emitter of the key waits for the
/// first to commit or roll back, and then reads what it left (under READ
/// COMMITTED the update re-reads the newest row; under REPEATABLE READ or
/// SERIALIZABLE it fails with a serialization failure, which the retry loop
/// replays). Sequence numbers therefore follow commit order, without gaps.
const INSERT_SQL: &str = "
WITH next AS (
    INSERT INTO idem_outbox_keys AS k (key, last_seq) VALUES ($2, 1)
    ON CONFLICT (key) DO UPDATE SET last_seq = k.last_seq + 1
    RETURNING last_seq
)
INSERT INTO idem_outbox (id, key, seq, subject, kind, version, payload)
SELECT $1, $2, next.last_seq, $3, $4, $5, $6 FROM next
RETURNING seq";

#[derive(diesel::QueryableByName)]
struct Seq {
    #[diesel(sql_type = BigInt)]
    seq: i64,
}

/// Write `event` to the outbox in the transaction of the current attempt,
/// and return its id. The relay publishes it once that transaction commits;
/// if it rolls back, the event is gone with it.
///
/// Refused with [`EmitError::OutsideAttempt`], writing nothing, when the
/// calling task does not run an attempt of a retry loop. This is a run-time
/// check: `conn` is a plain connection, so the compiler cannot tell an
/// attempt's connection from any other. Refused with
/// [`EmitError::NoTransaction`] when `conn` is in no transaction (a
/// connection the body opened itself).
///
/// Inside an `#[idempotent]` call the id is derived from the call's scope,
/// key and the event's ordinal in the attempt (a replayed attempt counts
/// from 0 again), so a request that runs again emits the same ids and the
/// broker drops the copies; elsewhere it is a fresh UUIDv7.
///
/// ```no_run
/// use diesel_async::AsyncPgConnection;
/// use idem_runtime::outbox::{emit, EmitError, Event};
///
/// #[derive(serde::Serialize)]
/// struct OrderPlaced { order: i64 }
/// impl Event for OrderPlaced {
///     const KIND: &'static str = "order.placed";
///     const VERSION: u32 = 1;
///     fn key(&self) -> String { format!("order-{}", self.order) }
/// }
///
/// // Called from the body of a #[retryable] or #[idempotent] function.
/// async fn place(conn: &mut AsyncPgConnection, order: i64) -> Result<(), EmitError> {
///     // .. the business writes, on the same `conn` ..
///     emit(conn, &OrderPlaced { order }).await?;
///     Ok(())
/// }
/// ```
///
/// # Errors
///
/// [`EmitError`]; a database error aborts the attempt's transaction, as any
/// failed statement does.
pub async fn emit<E: Event>(conn: &mut AsyncPgConnection, event: &E) -> Result<EventId, EmitError> {
    // Everything is checked before the ordinal is taken, so a refused event
    // does not shift the ids of the ones after it.
    if !crate::attempt::inside_attempt() {
        return Err(EmitError::OutsideAttempt);
    }
    if !crate::attempt::in_transaction(conn) {
        return Err(EmitError::NoTransaction);
    }
    let key = event.key();
    event::validate_key(&key)?;
    let subject = event.subject();
    event::validate_subject(&subject)?;
    let payload = serde_json::to_value(event).map_err(|source| EmitError::Serialize {
        kind: E::KIND,
        source,
    })?;
    crate::idempotency::storable_tree(&payload).map_err(|source| EmitError::Unstorable {
        kind: E::KIND,
        source,
    })?;

    let (ordinal, call) = crate::attempt::next_emit().ok_or(EmitError::OutsideAttempt)?;
    let id = match call {
        Some(call) => event::deterministic_id(&call, ordinal),
        None => event::time_ordered_id(),
    };
    let row: Seq = diesel::sql_query(INSERT_SQL)
        .bind::<SqlUuid, _>(id.0)
        .bind::<Text, _>(&key)
        .bind::<Text, _>(&subject)
        .bind::<Text, _>(E::KIND)
        .bind::<BigInt, _>(i64::from(E::VERSION))
        .bind::<Jsonb, _>(&payload)
        .get_result(conn)
        .await?;
    tracing::debug!(event_id = %id, key = %key, seq = row.seq, kind = E::KIND, "event written to the outbox");
    Ok(id)
}
