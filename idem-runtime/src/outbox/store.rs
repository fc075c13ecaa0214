//! The relay's statements on `idem_outbox`, each one short and on its own
//! (autocommit): no transaction stays open while a broker is called.

use std::time::Duration;

use diesel::sql_types::{Array, BigInt, Double, Integer, Nullable, Text, Uuid as SqlUuid};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use uuid::Uuid;

use crate::sql::millis;

use super::event::EventId;
use super::publisher::OutboxMessage;

/// Claims the head of up to `$1` keys (a key's head is its lowest unsent
/// seq) for `$2` milliseconds.
///
/// Only heads are claimed, and a head is claimable only while it is pending,
/// due and not leased: so a key has at most one event in flight, and event
/// n+1 becomes a head only once n is marked sent, i.e. acked. A dead head
/// blocks its key and no other. `FOR UPDATE SKIP LOCKED` lets relays claim
/// side by side; when a row changed after this statement's snapshot (another
/// relay leased it, or marked it sent), PostgreSQL re-checks the conditions
/// on `o` against the newest row before locking it, so a head is never
/// claimed twice within a lease, and a row that became sent is skipped.
///
/// The walk goes through pending rows in `(created_at, seq)` order on their
/// partial index and stops after `$1` heads, so a round costs the batch, not
/// the backlog. "Nothing earlier of this key is unsent" is read from the
/// statement's snapshot, and can only be stale towards "still unsent" (sent
/// is final; a later seq of a key is only assigned after the earlier one
/// committed): a stale answer skips a head for one round, never claims a
/// second event of a key.
const CLAIM_SQL: &str = "
WITH due AS (
    SELECT o.id FROM idem_outbox o
    WHERE o.state = 'pending'
      AND o.next_attempt_at <= now()
      AND (o.lease_until IS NULL OR o.lease_until < clock_timestamp())
      AND NOT EXISTS (
          SELECT FROM idem_outbox p
          WHERE p.key = o.key AND p.seq < o.seq AND p.state <> 'sent'
      )
    ORDER BY o.created_at, o.seq
    LIMIT $1
    FOR UPDATE OF o SKIP LOCKED
)
UPDATE idem_outbox o
SET lease_until = clock_timestamp() + $2 * interval '1 millisecond'
FROM due WHERE o.id = due.id
RETURNING o.id, o.key, o.seq, o.subject, o.kind, o.version, o.payload::text AS payload, o.attempts";

#[derive(diesel::QueryableByName)]
struct Claimed {
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
    #[diesel(sql_type = BigInt)]
    version: i64,
    /// As text, read row by row: one row that cannot be read back must
    /// not fail the whole batch, and with it every key's next event.
    #[diesel(sql_type = Text)]
    payload: String,
    #[diesel(sql_type = Integer)]
    attempts: i32,
}

/// What a claim leased: the events to publish, and those whose stored body
/// cannot be read back (written before `emit` checked it, or by hand), each
/// with the reader's error and its payload `null`.
#[derive(Debug, Default)]
pub(crate) struct Claim {
    pub(crate) readable: Vec<OutboxMessage>,
    pub(crate) unreadable: Vec<(OutboxMessage, String)>,
}

/// Claim up to `batch` heads for `lease`.
pub(crate) async fn claim(
    conn: &mut AsyncPgConnection,
    batch: i64,
    lease: Duration,
) -> Result<Claim, diesel::result::Error> {
    let rows: Vec<Claimed> = diesel::sql_query(CLAIM_SQL)
        .bind::<BigInt, _>(batch)
        .bind::<BigInt, _>(millis(lease))
        .load(conn)
        .await?;
    let mut claim = Claim::default();
    for r in rows {
        let read = serde_json::from_str(&r.payload);
        let mut message = OutboxMessage {
            id: EventId(r.id),
            key: r.key,
            seq: r.seq,
            subject: r.subject,
            kind: r.kind,
            version: r.version,
            payload: serde_json::Value::Null,
            attempts: r.attempts,
        };
        match read {
            Ok(payload) => {
                message.payload = payload;
                claim.readable.push(message);
            }
            Err(e) => claim.unreadable.push((
                message,
                format!("the stored event cannot be read back as JSON: {e}"),
            )),
        }
    }
    Ok(claim)
}

/// Mark acked events sent. Whoever holds the lease now, the broker has them.
pub(crate) async fn mark_sent(
    conn: &mut AsyncPgConnection,
    ids: &[Uuid],
) -> Result<usize, diesel::result::Error> {
    diesel::sql_query(
        "UPDATE idem_outbox SET state = 'sent', sent_at = now(), lease_until = NULL
         WHERE id = ANY($1) AND state <> 'sent'",
    )
    .bind::<Array<SqlUuid>, _>(ids)
    .execute(conn)
    .await
}

/// Record a failed publish: back off, or park the event as dead once it
/// failed `max_attempts` times.
pub(crate) async fn mark_failed(
    conn: &mut AsyncPgConnection,
    id: Uuid,
    error: &str,
    max_attempts: u32,
    backoff: Duration,
) -> Result<usize, diesel::result::Error> {
    diesel::sql_query(
        "UPDATE idem_outbox SET
             attempts = attempts + 1,
             last_error = $2,
             lease_until = NULL,
             next_attempt_at = now() + $4 * interval '1 millisecond',
             state = CASE WHEN attempts + 1 >= $3 THEN 'dead' ELSE 'pending' END
         WHERE id = $1 AND state = 'pending'",
    )
    .bind::<SqlUuid, _>(id)
    .bind::<Text, _>(error)
    .bind::<Integer, _>(i32::try_from(max_attempts).unwrap_or(i32::MAX))
    .bind::<BigInt, _>(millis(backoff))
    .execute(conn)
    .await
}

/// Give back events whose publish failed because the broker was
/// unavailable: the lease ends and the error is kept for operators, but the
/// attempt is not counted and no backoff is set, so whichever relay finds
/// the broker back first publishes them at once.
pub(crate) async fn release(
    conn: &mut AsyncPgConnection,
    ids: &[Uuid],
    errors: &[String],
) -> Result<usize, diesel::result::Error> {
    diesel::sql_query(
        "UPDATE idem_outbox o SET lease_until = NULL, last_error = u.error
         FROM unnest($1::uuid[], $2::text[]) AS u(id, error)
         WHERE o.id = u.id AND o.state = 'pending'",
    )
    .bind::<Array<SqlUuid>, _>(ids)
    .bind::<Array<Text>, _>(errors)
    .execute(conn)
    .await
}

/// Put dead events back to pending with a fresh attempt count: one event
/// (`id`), or every dead event of `key`.
pub(crate) async fn requeue(
    conn: &mut AsyncPgConnection,
    id: Option<Uuid>,
    key: Option<&str>,
) -> Result<usize, diesel::result::Error> {
    let woken = diesel::sql_query(
        "UPDATE idem_outbox SET state = 'pending', attempts = 0, next_attempt_at = now()
         WHERE state = 'dead' AND ($1::uuid IS NULL OR id = $1) AND ($2::text IS NULL OR key = $2)",
    )
    .bind::<Nullable<SqlUuid>, _>(id)
    .bind::<Nullable<Text>, _>(key)
    .execute(conn)
    .await?;
    if woken > 0 {
        // Wake listening relays now rather than at their next poll.
        diesel::sql_query("SELECT pg_notify('idem_outbox', '')")
            .execute(conn)
            .await?;
    }
    Ok(woken)
}

/// Delete up to `batch` events sent more than `retention` ago.
pub(crate) async fn delete_sent(
    conn: &mut AsyncPgConnection,
    retention: Duration,
    batch: i64,
) -> Result<usize, diesel::result::Error> {
    diesel::sql_query(
        "DELETE FROM idem_outbox WHERE id IN (
             SELECT id FROM idem_outbox
             WHERE state = 'sent' AND sent_at < now() - $1 * interval '1 millisecond'
             ORDER BY sent_at LIMIT $2
         )",
    )
    .bind::<BigInt, _>(millis(retention))
    .bind::<BigInt, _>(batch)
    .execute(conn)
    .await
}

#[derive(diesel::QueryableByName)]
pub(crate) struct StatsRow {
    #[diesel(sql_type = BigInt)]
    pub(crate) pending: i64,
    #[diesel(sql_type = BigInt)]
    pub(crate) dead: i64,
    #[diesel(sql_type = Nullable<Double>)]
    pub(crate) oldest_pending_secs: Option<f64>,
}

/// Counts of pending and dead events, and the age of the oldest pending.
pub(crate) async fn stats(conn: &mut AsyncPgConnection) -> Result<StatsRow, diesel::result::Error> {
    diesel::sql_query(
        "SELECT count(*) FILTER (WHERE state = 'pending') AS pending,
                count(*) FILTER (WHERE state = 'dead') AS dead,
                extract(epoch FROM now() - min(created_at) FILTER (WHERE state = 'pending'))::float8
                    AS oldest_pending_secs
         FROM idem_outbox WHERE state <> 'sent'",
    )
    .get_result(conn)
    .await
}
