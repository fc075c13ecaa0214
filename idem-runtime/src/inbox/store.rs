//! The SQL of the inbox: every statement that reads or writes `idem_inbox`.
//! Nothing here opens or ends a transaction; the caller decides which
//! statements share one.

use std::time::{Duration, SystemTime};

use diesel::result::Error as DieselError;
use diesel::sql_types::{BigInt, Binary, Nullable, Text, Timestamp};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::sql::micros;

/// What a message's id is already recorded as, if anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Recorded {
    /// No record: this transaction just wrote the `done` row.
    Claimed,
    /// The effect committed before.
    Done,
    /// The message is parked.
    Dead,
}

#[derive(QueryableByName)]
struct StateRow {
    #[diesel(sql_type = Text)]
    state: String,
}

/// Write the `done` row of a message, or find the row already there.
///
/// The insert comes first, before the effect runs: a second delivery of
/// the same message running at the same time waits on the first one's
/// primary-key lock instead of running the effect alongside it, and then
/// finds its row (read committed) or fails with 40001 (stricter levels,
/// which the retry loop replays).
pub(crate) async fn claim(
    conn: &mut AsyncPgConnection,
    consumer: &str,
    msg_id: &str,
    delivered: u64,
) -> Result<Recorded, DieselError> {
    let inserted = diesel::sql_query(
        "INSERT INTO idem_inbox (consumer, msg_id, state, deliveries) VALUES ($1, $2, 'done', $3) \
         ON CONFLICT DO NOTHING",
    )
    .bind::<Text, _>(consumer)
    .bind::<Text, _>(msg_id)
    .bind::<BigInt, _>(deliveries(delivered))
    .execute(conn)
    .await?;
    if inserted == 1 {
        return Ok(Recorded::Claimed);
    }
    // A statement of its own: under read committed it sees the row that
    // the insert above waited for, which the insert's own snapshot did not.
    state_of(conn, consumer, msg_id)
        .await?
        // Purged between the two statements: the message was settled.
        .map_or(Ok(Recorded::Done), Ok)
}

async fn state_of(
    conn: &mut AsyncPgConnection,
    consumer: &str,
    msg_id: &str,
) -> Result<Option<Recorded>, DieselError> {
    let rows: Vec<StateRow> =
        diesel::sql_query("SELECT state FROM idem_inbox WHERE consumer = $1 AND msg_id = $2")
            .bind::<Text, _>(consumer)
            .bind::<Text, _>(msg_id)
            .load(conn)
            .await?;
    Ok(rows.into_iter().next().map(|row| match row.state.as_str() {
        "dead" => Recorded::Dead,
        _ => Recorded::Done,
    }))
}

/// Park a message as dead with its last error and body. Returns what the
/// message is recorded as afterwards: `Claimed` when this call parked it,
/// else the record some earlier delivery left (a commit whose answer was
/// lost may have recorded it `done` after all).
pub(crate) async fn park(
    conn: &mut AsyncPgConnection,
    consumer: &str,
    msg_id: &str,
    delivered: u64,
    last_error: &str,
    payload: &[u8],
) -> Result<Recorded, DieselError> {
    let inserted = diesel::sql_query(
        "INSERT INTO idem_inbox (consumer, msg_id, state, deliveries, last_error, payload) \
         VALUES ($1, $2, 'dead', $3, $4, $5) ON CONFLICT DO NOTHING",
    )
    .bind::<Text, _>(consumer)
    .bind::<Text, _>(msg_id)
    .bind::<BigInt, _>(deliveries(delivered))
    .bind::<Text, _>(last_error)
    .bind::<Binary, _>(payload)
    .execute(conn)
    .await?;
    if inserted == 1 {
        return Ok(Recorded::Claimed);
    }
    Ok(state_of(conn, consumer, msg_id)
        .await?
        .unwrap_or(Recorded::Done))
}

#[derive(QueryableByName)]
struct PayloadRow {
    #[diesel(sql_type = Nullable<Binary>)]
    payload: Option<Vec<u8>>,
}

/// Turn a dead letter into a `done` record and hand back its body, in the
/// caller's transaction: committed only together with the effect that the
/// requeue runs. `None` when no dead letter has this id.
pub(crate) async fn revive(
    conn: &mut AsyncPgConnection,
    consumer: &str,
    msg_id: &str,
) -> Result<Option<Vec<u8>>, DieselError> {
    // Locked first, so a second requeue of the same letter waits here and
    // then finds it no longer dead.
    let rows: Vec<PayloadRow> = diesel::sql_query(
        "SELECT payload FROM idem_inbox WHERE consumer = $1 AND msg_id = $2 AND state = 'dead' FOR UPDATE",
    )
    .bind::<Text, _>(consumer)
    .bind::<Text, _>(msg_id)
    .load(conn)
    .await?;
    if rows.is_empty() {
        return Ok(None);
    }
    diesel::sql_query(
        "UPDATE idem_inbox SET state = 'done', last_error = NULL, payload = NULL, \
         deliveries = deliveries + 1, updated_at = now() WHERE consumer = $1 AND msg_id = $2",
    )
    .bind::<Text, _>(consumer)
    .bind::<Text, _>(msg_id)
    .execute(conn)
    .await?;
    Ok(rows.into_iter().next().and_then(|row| row.payload))
}

/// A parked message, as [`Inbox::dead_letters`](super::Inbox::dead_letters) lists it.
#[derive(Debug, Clone, PartialEq, Eq, QueryableByName)]
pub struct DeadLetter {
    /// The message id it was recorded under.
    #[diesel(sql_type = Text)]
    pub msg_id: String,
    /// The delivery count when it was parked.
    #[diesel(sql_type = BigInt)]
    pub deliveries: i64,
    /// The effect's last error, as its `Display` wrote it.
    #[diesel(sql_type = Text)]
    pub last_error: String,
    /// The message body, which a requeue runs the effect on.
    #[diesel(sql_type = Binary)]
    pub payload: Vec<u8>,
    /// When it was parked.
    #[diesel(sql_type = Timestamp)]
    pub parked_at: SystemTime,
}

/// A consumer's dead letters, oldest first.
pub(crate) async fn dead_letters(
    conn: &mut AsyncPgConnection,
    consumer: &str,
    limit: i64,
) -> Result<Vec<DeadLetter>, DieselError> {
    diesel::sql_query(
        "SELECT msg_id, deliveries, last_error, payload, updated_at AT TIME ZONE 'UTC' AS parked_at FROM idem_inbox \
         WHERE consumer = $1 AND state = 'dead' ORDER BY updated_at, msg_id LIMIT $2",
    )
    .bind::<Text, _>(consumer)
    .bind::<BigInt, _>(limit)
    .load(conn)
    .await
}

/// Delete up to `batch` of a consumer's `done` records settled more than
/// `older_than` ago; returns how many went. One short statement per batch,
/// so a large purge never holds many row locks, nor one long transaction.
pub(crate) async fn purge_batch(
    conn: &mut AsyncPgConnection,
    consumer: &str,
    older_than: Duration,
    batch: i64,
) -> Result<usize, DieselError> {
    diesel::sql_query(
        "DELETE FROM idem_inbox WHERE ctid IN (SELECT ctid FROM idem_inbox \
         WHERE consumer = $1 AND state = 'done' AND updated_at < now() - make_interval(secs => $2::double precision / 1e6) \
         LIMIT $3 FOR UPDATE SKIP LOCKED)",
    )
    .bind::<Text, _>(consumer)
    .bind::<BigInt, _>(micros(older_than))
    .bind::<BigInt, _>(batch)
    .execute(conn)
    .await
}

/// JetStream counts deliveries from 1; a count past `i64` cannot happen.
fn deliveries(delivered: u64) -> i64 {
    i64::try_from(delivered.max(1)).unwrap_or(i64::MAX)
}
