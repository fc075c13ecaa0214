//! Inbox records (`idem_inbox`): counts per consumer, dead letters, purge.

use std::time::{Duration, SystemTime};

use diesel::sql_types::{BigInt, Text};
use diesel_async::RunQueryDsl;
use serde::Serialize;

use super::{OperateError, Page};
use crate::inbox::{Inbox, InboxConfig};
use crate::pool::Pool;

/// One consumer's records.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, diesel::QueryableByName)]
#[non_exhaustive]
pub struct ConsumerStats {
    /// The consumer's name.
    #[diesel(sql_type = Text)]
    pub consumer: String,
    /// Messages applied (kept so a redelivery is skipped, until purged).
    #[diesel(sql_type = BigInt)]
    pub done: i64,
    /// Messages parked as dead letters.
    #[diesel(sql_type = BigInt)]
    pub dead: i64,
}

/// Every consumer's counts, by name.
///
/// # Errors
///
/// No connection, or what PostgreSQL said.
pub async fn inbox_stats(pool: &Pool) -> Result<Vec<ConsumerStats>, OperateError> {
    let mut conn = pool.get().await?;
    Ok(diesel::sql_query(
        "SELECT consumer, count(*) FILTER (WHERE state = 'done') AS done,
                count(*) FILTER (WHERE state = 'dead') AS dead
         FROM idem_inbox GROUP BY consumer ORDER BY consumer",
    )
    .load(&mut conn)
    .await?)
}

/// A dead letter ([`DeadLetter`](crate::inbox::DeadLetter)) without its body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct InboxDead {
    /// The message id.
    pub msg_id: String,
    /// Deliveries when it was parked.
    pub deliveries: i64,
    /// The effect's last error.
    pub last_error: String,
    /// The body's size in bytes (the body itself is the producer's).
    pub payload_bytes: usize,
    /// When it was parked, seconds since the Unix epoch.
    pub parked_at: u64,
}

/// One page of `consumer`'s dead letters, oldest first
/// ([`Inbox::dead_letters`]). A requeue runs the consumer's effect, so it
/// belongs to the consumer's code ([`Inbox::requeue`]), not here.
///
/// # Errors
///
/// An invalid consumer name, no connection, or what PostgreSQL said.
pub async fn inbox_dead(
    pool: &Pool,
    consumer: &str,
    page: Page,
) -> Result<Vec<InboxDead>, OperateError> {
    let inbox = Inbox::new(pool.clone(), consumer, InboxConfig::new())?;
    let letters = inbox.dead_letters(page.through()).await?;
    Ok(page
        .cut(letters)
        .into_iter()
        .map(|l| InboxDead {
            msg_id: l.msg_id,
            deliveries: l.deliveries,
            last_error: l.last_error,
            payload_bytes: l.payload.len(),
            parked_at: l
                .parked_at
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        })
        .collect())
}

/// Delete `consumer`'s done records settled more than `older_than` ago
/// ([`Inbox::purge`]); dead letters are kept. Returns how many went. Keep
/// `older_than` longer than any message can still be redelivered.
///
/// # Errors
///
/// An invalid consumer name, no connection, or what PostgreSQL said.
pub async fn inbox_purge(
    pool: &Pool,
    consumer: &str,
    older_than: Duration,
    batch: i64,
) -> Result<u64, OperateError> {
    let inbox = Inbox::new(pool.clone(), consumer, InboxConfig::new())?;
    Ok(inbox.purge(older_than, batch).await?)
}
