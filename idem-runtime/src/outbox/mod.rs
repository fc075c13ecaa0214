//! The transactional outbox: events written in the business transaction,
//! published to a broker afterwards, at least once and in order per key.
//!
//! * **Emit** with [`emit()`] inside an attempt of a `#[retryable]` or
//!   `#[idempotent]` function: the event is a row of `idem_outbox` in the
//!   attempt's transaction, so it exists exactly when the business write it
//!   announces committed. Outside an attempt, [`emit()`] refuses at run time
//!   ([`EmitError::OutsideAttempt`]); the connection type cannot say it.
//! * **Order.** Each event gets the next sequence number of its key (the
//!   aggregate) from `idem_outbox_keys`, whose row lock is held until the
//!   emitting transaction ends: seqs follow commit order without gaps. A
//!   relay claims only the head of each key (its lowest unsent seq), so
//!   event n+1 of a key is published only after n was acked, whatever the
//!   number of relays.
//! * **Relay.** [`Relay`] claims heads with `FOR UPDATE SKIP LOCKED` and a
//!   lease in one short statement, publishes them with no transaction open,
//!   and marks them sent; it wakes on `NOTIFY idem_outbox` (a trigger on
//!   insert) and polls as a fallback. A publish the broker refuses, or
//!   that fails for its event, is retried with backoff, then parked as dead,
//!   blocking only its key until [`requeue`]. A broker that is unavailable
//!   (unreachable, not answering, without a leader) is no event's fault: it
//!   counts toward no attempt; the relay waits for it with backoff and
//!   resumes by itself. Sent rows are deleted after a retention.
//! * **Duplicates.** A relay may publish an event again (it died before
//!   marking it, an ack was lost): the event id goes to the broker as the
//!   message id (`Nats-Msg-Id`), and the broker drops the copy within its
//!   duplicate window, which the NATS publisher (feature `nats`) checks
//!   at start-up.
//!   Consumers should still deduplicate on the id past that window.

mod emit;
pub(crate) mod event;
#[cfg(feature = "nats")]
mod nats;
mod publisher;
mod relay;
mod store;
mod timing;

use std::time::Duration;

use diesel_async::AsyncPgConnection;

pub use emit::{emit, EmitError};
pub use event::{Event, EventId, InvalidEvent};
#[cfg(feature = "nats")]
pub(crate) use nats::duplicate_window;
#[cfg(feature = "nats")]
pub use nats::NatsPublisher;
pub use publisher::{Horizon, OutboxMessage, PrepareError, PublishError, Published, Publisher};
pub use relay::{Relay, RelayError, RelayTiming, Round};

/// Put a dead event back in line: pending again, with its attempts reset.
/// Returns whether an event was dead and is pending now.
///
/// ```no_run
/// # async fn f(conn: &mut diesel_async::AsyncPgConnection, id: idem_runtime::outbox::EventId)
/// # -> Result<(), diesel::result::Error> {
/// idem_runtime::outbox::requeue(conn, id).await?;
/// # Ok(()) }
/// ```
///
/// # Errors
///
/// What PostgreSQL said.
pub async fn requeue(
    conn: &mut AsyncPgConnection,
    id: EventId,
) -> Result<bool, diesel::result::Error> {
    store::requeue(conn, Some(id.0), None).await.map(|n| n > 0)
}

/// Put every dead event of `key` back in line; returns how many.
///
/// ```no_run
/// # async fn f(conn: &mut diesel_async::AsyncPgConnection) -> Result<(), diesel::result::Error> {
/// let woken = idem_runtime::outbox::requeue_key(conn, "order-7").await?;
/// # Ok(()) }
/// ```
///
/// # Errors
///
/// What PostgreSQL said.
pub async fn requeue_key(
    conn: &mut AsyncPgConnection,
    key: &str,
) -> Result<usize, diesel::result::Error> {
    store::requeue(conn, None, Some(key)).await
}

/// Delete events sent more than `retention` ago, `batch` per statement
/// (each its own short transaction), until none is left; returns how many.
/// [`Relay`] runs it on its own; call it from a job when no relay cleans.
///
/// ```no_run
/// # async fn f(conn: &mut diesel_async::AsyncPgConnection) -> Result<(), diesel::result::Error> {
/// use std::time::Duration;
/// let deleted = idem_runtime::outbox::delete_sent(conn, Duration::from_secs(3600), 1000).await?;
/// # Ok(()) }
/// ```
///
/// # Errors
///
/// What PostgreSQL said; the batches deleted before stay deleted.
pub async fn delete_sent(
    conn: &mut AsyncPgConnection,
    retention: Duration,
    batch: u32,
) -> Result<usize, diesel::result::Error> {
    let batch = i64::from(batch.max(1));
    let mut total = 0;
    loop {
        let n = store::delete_sent(conn, retention, batch).await?;
        total += n;
        if (n as i64) < batch {
            return Ok(total);
        }
    }
}

/// The outbox's backlog, for gauges and health checks.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct OutboxStats {
    /// Events not yet sent (not dead).
    pub pending: i64,
    /// Events parked as dead, each blocking its key.
    pub dead: i64,
    /// How long the oldest pending event has waited since its transaction
    /// began; `None` when nothing is pending.
    pub oldest_pending: Option<Duration>,
}

impl OutboxStats {
    /// The gauges `record_gauges` (feature `metrics`) sets, by name, with
    /// the values it sets them to: `idem_outbox_pending`,
    /// `idem_outbox_dead` and `idem_outbox_oldest_pending_seconds` (0 when
    /// nothing is pending). Needs no feature: the admin page shows them.
    ///
    /// ```
    /// # fn f(stats: idem_runtime::outbox::OutboxStats) {
    /// for (name, value) in stats.gauges() {
    ///     println!("{name} {value}");
    /// }
    /// # }
    /// ```
    pub fn gauges(&self) -> [(&'static str, f64); 3] {
        [
            ("idem_outbox_pending", self.pending as f64),
            ("idem_outbox_dead", self.dead as f64),
            (
                "idem_outbox_oldest_pending_seconds",
                self.oldest_pending.map_or(0.0, |age| age.as_secs_f64()),
            ),
        ]
    }

    /// Set the gauges `idem_outbox_pending`, `idem_outbox_dead` and
    /// `idem_outbox_oldest_pending_seconds` (feature `metrics`) to
    /// [`gauges`](Self::gauges). [`Relay`] does this at each cleanup.
    #[cfg(feature = "metrics")]
    pub fn record_gauges(&self) {
        for (name, value) in self.gauges() {
            metrics::gauge!(name).set(value);
        }
    }
}

/// Read the backlog. With the `metrics` feature, [`Relay`] also sets the
/// gauges `idem_outbox_pending`, `idem_outbox_dead` and
/// `idem_outbox_oldest_pending_seconds` from it at each cleanup
/// (`OutboxStats::record_gauges`).
///
/// ```no_run
/// # async fn f(conn: &mut diesel_async::AsyncPgConnection) -> Result<(), diesel::result::Error> {
/// let stats = idem_runtime::outbox::stats(conn).await?;
/// assert_eq!(stats.dead, 0, "a key is blocked");
/// # Ok(()) }
/// ```
///
/// # Errors
///
/// What PostgreSQL said.
pub async fn stats(conn: &mut AsyncPgConnection) -> Result<OutboxStats, diesel::result::Error> {
    let row = store::stats(conn).await?;
    Ok(OutboxStats {
        pending: row.pending,
        dead: row.dead,
        oldest_pending: row
            .oldest_pending_secs
            .map(|secs| Duration::from_secs_f64(secs.max(0.0))),
    })
}
