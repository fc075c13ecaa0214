//! Outbox events (`idem_outbox`): backlog, dead events, requeue, discard.

use std::time::Duration;

use diesel::sql_types::{BigInt, Double, Integer, Nullable, Text, Uuid as SqlUuid};
use diesel_async::RunQueryDsl;
use serde::Serialize;
use uuid::Uuid;

use super::{secs, ser_opt_secs, ser_secs, OperateError, Page};
use crate::outbox::{self, EventId};
use crate::pool::Pool;

/// [`outbox::OutboxStats`], serializable.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[non_exhaustive]
pub struct OutboxStatsView {
    /// Events not yet sent (not dead).
    pub pending: i64,
    /// Events parked as dead, each blocking its key.
    pub dead: i64,
    /// How long the oldest pending event has waited (in JSON, seconds or null).
    #[serde(serialize_with = "ser_opt_secs")]
    pub oldest_pending: Option<Duration>,
}

impl OutboxStatsView {
    /// The `metrics` gauges a [`Relay`](crate::outbox::Relay) sets from
    /// these counts, with their values ([`outbox::OutboxStats::gauges`]):
    /// what a dashboard of them shows after the relay's next refresh.
    pub fn gauges(&self) -> [(&'static str, f64); 3] {
        outbox::OutboxStats {
            pending: self.pending,
            dead: self.dead,
            oldest_pending: self.oldest_pending,
        }
        .gauges()
    }
}

/// The outbox's backlog ([`outbox::stats`]).
///
/// # Errors
///
/// No connection, or what PostgreSQL said.
pub async fn outbox_stats(pool: &Pool) -> Result<OutboxStatsView, OperateError> {
    let mut conn = pool.get().await?;
    let s = outbox::stats(&mut conn).await?;
    Ok(OutboxStatsView {
        pending: s.pending,
        dead: s.dead,
        oldest_pending: s.oldest_pending,
    })
}

#[derive(diesel::QueryableByName)]
struct Row {
    #[diesel(sql_type = SqlUuid)]
    id: Uuid,
    #[diesel(sql_type = Text)]
    key: String,
    #[diesel(sql_type = BigInt)]
    seq: i64,
    #[diesel(sql_type = Text)]
    subject: String,
    #[diesel(sql_type = Text)]
    kind: String,
    #[diesel(sql_type = Integer)]
    attempts: i32,
    #[diesel(sql_type = Nullable<Text>)]
    last_error: Option<String>,
    #[diesel(sql_type = Double)]
    age: f64,
}

/// A dead event, as [`dead_events`] lists it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct DeadEvent {
    /// Its id (the broker's message id), for [`requeue_event`] and [`discard_event`].
    pub id: String,
    /// Its key (aggregate); the key's later events wait behind it.
    pub key: String,
    /// Its place in the key's order.
    pub seq: i64,
    /// The subject it is published to.
    pub subject: String,
    /// The event's kind.
    pub kind: String,
    /// Publishes tried before it was parked.
    pub attempts: i32,
    /// What the last publish said.
    pub last_error: Option<String>,
    /// Since it was emitted (in JSON, seconds).
    #[serde(serialize_with = "ser_secs")]
    pub age: Duration,
}

/// Dead events, oldest first, one page of them; of one `key` when given.
///
/// # Errors
///
/// No connection, or what PostgreSQL said.
pub async fn dead_events(
    pool: &Pool,
    key: Option<&str>,
    page: Page,
) -> Result<Vec<DeadEvent>, OperateError> {
    let mut conn = pool.get().await?;
    let rows: Vec<Row> = diesel::sql_query(
        "SELECT id, key, seq, subject, kind, attempts, last_error,
                extract(epoch FROM now() - created_at)::float8 AS age
         FROM idem_outbox WHERE state = 'dead' AND ($1::text IS NULL OR key = $1)
         ORDER BY created_at, seq LIMIT $2 OFFSET $3",
    )
    .bind::<Nullable<Text>, _>(key)
    .bind::<BigInt, _>(page.limit.max(0))
    .bind::<BigInt, _>(page.offset.max(0))
    .load(&mut conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| DeadEvent {
            id: r.id.hyphenated().to_string(),
            key: r.key,
            seq: r.seq,
            subject: r.subject,
            kind: r.kind,
            attempts: r.attempts,
            last_error: r.last_error,
            age: secs(r.age),
        })
        .collect())
}

/// Parse an event id as the CLI and [`DeadEvent::id`] spell it.
fn event_id(id: &str) -> Result<EventId, OperateError> {
    Uuid::parse_str(id)
        .map(EventId::from)
        .map_err(|e| OperateError::Invalid(format!("{id:?} is not an event id (a UUID): {e}")))
}

/// Put one dead event back in line ([`outbox::requeue`]); returns whether
/// it was dead.
///
/// # Errors
///
/// An id that is no UUID, no connection, or what PostgreSQL said.
pub async fn requeue_event(pool: &Pool, id: &str) -> Result<bool, OperateError> {
    let id = event_id(id)?;
    let mut conn = pool.get().await?;
    Ok(outbox::requeue(&mut conn, id).await?)
}

/// Put at most `limit` dead events (of `key`, when given) back in line,
/// oldest first, one [`outbox::requeue`] each; returns the ids requeued.
///
/// # Errors
///
/// No connection, or what PostgreSQL said; the events requeued before stay so.
pub async fn requeue_dead_events(
    pool: &Pool,
    key: Option<&str>,
    limit: i64,
) -> Result<Vec<String>, OperateError> {
    let dead = dead_events(pool, key, Page { limit, offset: 0 }).await?;
    let mut conn = pool.get().await?;
    let mut woken = Vec::new();
    for event in dead {
        if outbox::requeue(&mut conn, event_id(&event.id)?).await? {
            woken.push(event.id);
        }
    }
    Ok(woken)
}

/// Delete one dead event: it is never published, and its key's later
/// events go ahead. Returns whether a dead event had this id (pending and
/// sent events are never discarded).
///
/// # Errors
///
/// An id that is no UUID, no connection, or what PostgreSQL said.
pub async fn discard_event(pool: &Pool, id: &str) -> Result<bool, OperateError> {
    let id = event_id(id)?.as_uuid();
    let mut conn = pool.get().await?;
    let n = diesel::sql_query("DELETE FROM idem_outbox WHERE id = $1 AND state = 'dead'")
        .bind::<SqlUuid, _>(id)
        .execute(&mut conn)
        .await?;
    if n > 0 {
        // The key's next event is its head now: wake the relays.
        diesel::sql_query("SELECT pg_notify('idem_outbox', '')")
            .execute(&mut conn)
            .await?;
    }
    Ok(n > 0)
}
