//! The consumer-side inbox: each message's effect and the record that it was
//! applied commit in one transaction, so a message delivered again (a crash
//! between commit and ack, an ack lost on the way, a redelivery after
//! `ack_wait`) is recognised and skipped instead of applied twice.
//!
//! # How a delivery is handled
//!
//! [`Inbox::handle`] runs one delivery under the retry loop
//! ([`crate::retry`]): each attempt first inserts the message's row in
//! `idem_inbox` under the inbox's consumer name, then runs the effect on the
//! same connection, and commits both or neither. A row already there means
//! the message was settled before: the attempt writes nothing and the
//! delivery is a [`Outcome::Duplicate`] (or [`Outcome::Dead`]). A
//! serialization failure or deadlock in the effect is replayed like any
//! retried transaction.
//!
//! An effect that fails is rolled back with its row, so the message is not
//! recorded and comes back: [`Outcome::Retry`] says after how long (the
//! backoff of [`InboxConfig`], doubling with each delivery). The delivery
//! that reaches [`InboxConfig::max_deliveries`] and fails again parks the
//! message instead: it is recorded `dead` with its last error and its body
//! ([`Outcome::Parked`]), and stops being redelivered. Parked messages are
//! listed by [`Inbox::dead_letters`] and run again by [`Inbox::requeue`].
//!
//! An effect that ends the transaction itself and has some of its writes
//! committed without the record (`Error::TransactionEnded { committed:
//! true }`) is parked at once, whatever the delivery: a redelivery would
//! apply those writes again.
//!
//! `Inbox::run` (feature `nats`) is the pull loop over a JetStream
//! consumer: it handles each message and only then acknowledges it (ack, or
//! term for a parked one, or nak with the backoff delay for a retry). An ack
//! that is lost costs nothing but a redelivery that the record skips.
//!
//! # Keeping records
//!
//! A record must outlive every chance of its message being delivered again:
//! keep records longer than the consumer can redeliver (`ack_wait` times
//! `max_deliver`, plus the naks' delays) and, when producers republish, the
//! stream's retention. [`Inbox::purge`] deletes older `done` records in
//! short batches; dead letters are never purged by age.
//!
//! # The table
//!
//! `idem_inbox` (migration 7, applied by [`crate::migrate()`]), a table of its
//! own rather than rows of `idem_requests`: an inbox record has no request
//! fingerprint, no response to replay and no lease, but a dead state with
//! an error and a body, and a lifetime set by the broker rather than by a
//! client's retry window.
//!
//! | column | meaning |
//! |---|---|
//! | `consumer`, `msg_id` | the primary key: the consumer's name and the message id (`Nats-Msg-Id`, else the stream sequence; see `message_id` for the ids recorded by their digest) |
//! | `state` | `done` (the effect committed with this row) or `dead` (parked) |
//! | `deliveries` | the delivery count when it was settled |
//! | `last_error`, `payload` | a dead letter's last error and body |
//! | `created_at`, `updated_at` | when it was first settled, and last changed |

mod handle;
#[cfg(feature = "nats")]
mod nats_consumer;
mod store;

use std::time::Duration;

use crate::pool::Pool;
use crate::retry::RetryPolicy;

#[cfg(feature = "nats")]
pub use nats_consumer::{message_id, RunError, RunReport};
pub use store::DeadLetter;

/// The longest consumer name or message id the inbox records, in bytes.
pub const MAX_ID_BYTES: usize = 255;

/// A consumer's inbox: where the messages it has settled are recorded.
///
/// ```no_run
/// use idem_runtime::inbox::{Inbox, InboxConfig};
///
/// # fn demo(pool: idem_runtime::pool::Pool) -> Result<(), idem_runtime::inbox::InboxError> {
/// let inbox = Inbox::new(pool, "billing-orders", InboxConfig::new().max_deliveries(8))?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Inbox {
    pool: Pool,
    consumer: String,
    config: InboxConfig,
}

impl std::fmt::Debug for Inbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inbox")
            .field("consumer", &self.consumer)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Inbox {
    /// The inbox of the consumer named `consumer` (use the durable consumer's
    /// name: it is the key space of the message ids recorded). Fails when
    /// the name is empty, longer than [`MAX_ID_BYTES`], or holds a NUL.
    pub fn new(
        pool: Pool,
        consumer: impl Into<String>,
        config: InboxConfig,
    ) -> Result<Inbox, InboxError> {
        let consumer = consumer.into();
        check_id("consumer name", &consumer)?;
        Ok(Inbox {
            pool,
            consumer,
            config,
        })
    }

    /// The consumer name records are kept under.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// The settings.
    pub fn config(&self) -> &InboxConfig {
        &self.config
    }
}

/// The settings of an [`Inbox`]. Build one with [`InboxConfig::new`] and
/// the `const` setters.
///
/// ```
/// use std::time::Duration;
/// use idem_runtime::inbox::InboxConfig;
///
/// const ORDERS: InboxConfig = InboxConfig::new()
///     .max_deliveries(8)
///     .backoff(Duration::from_millis(500), Duration::from_secs(30));
/// assert_eq!(ORDERS.max_deliveries, 8);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InboxConfig {
    /// The delivery (counted by the broker, the first is 1) whose failure
    /// parks the message as dead. Default 5; at least 1.
    pub max_deliveries: u64,
    /// The delay before the second delivery after a failure; it doubles with
    /// each further delivery. Default 1 s.
    pub base_backoff: Duration,
    /// The longest delay between deliveries. Default 60 s.
    pub max_backoff: Duration,
    /// The retry loop each delivery's transaction runs under. Default
    /// [`RetryPolicy::new`].
    pub policy: RetryPolicy,
}

impl InboxConfig {
    /// The defaults: parked at the 5th failed delivery, backoff 1 s doubling
    /// to 60 s, the default retry policy.
    pub const fn new() -> InboxConfig {
        InboxConfig {
            max_deliveries: 5,
            base_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(60),
            policy: RetryPolicy::new(),
        }
    }

    /// Set [`max_deliveries`](Self::max_deliveries); 0 is raised to 1.
    pub const fn max_deliveries(mut self, n: u64) -> Self {
        self.max_deliveries = if n == 0 { 1 } else { n };
        self
    }

    /// Set [`base_backoff`](Self::base_backoff) and [`max_backoff`](Self::max_backoff).
    pub const fn backoff(mut self, base: Duration, cap: Duration) -> Self {
        self.base_backoff = base;
        self.max_backoff = cap;
        self
    }

    /// Set [`policy`](Self::policy).
    pub const fn policy(mut self, policy: RetryPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// The delay before the delivery after `delivered` failed: the base,
    /// doubled per delivery past the first, capped.
    pub fn backoff_after(&self, delivered: u64) -> Duration {
        let doublings = u32::try_from(delivered.saturating_sub(1).min(31)).unwrap_or(31);
        self.base_backoff
            .saturating_mul(1 << doublings)
            .min(self.max_backoff)
    }
}

impl Default for InboxConfig {
    fn default() -> Self {
        InboxConfig::new()
    }
}

/// What became of one delivery.
#[derive(Debug)]
#[must_use = "the outcome says whether to ack, term or nak the message"]
pub enum Outcome<T, E> {
    /// The effect ran and committed together with the message's record.
    /// Ack the message.
    Done(T),
    /// The message was recorded before: the effect did not run. Ack it.
    Duplicate,
    /// The message is parked as dead: the effect did not run. Ack it.
    Dead,
    /// The effect failed and nothing was recorded: let the message come back
    /// (nak it with this delay).
    Retry {
        /// The effect's error.
        error: E,
        /// The delay before the next delivery.
        after: Duration,
    },
    /// The effect failed on the last delivery allowed, committed part of
    /// its writes by hand without the record, or swapped its connection
    /// (`ConnectionReplaced`): the message is now recorded as dead with
    /// this error. Term it so it is not redelivered.
    Parked {
        /// The effect's error.
        error: E,
    },
}

impl<T, E> Outcome<T, E> {
    /// Whether the message is settled (acknowledge it) rather than to be
    /// delivered again.
    pub fn is_settled(&self) -> bool {
        !matches!(self, Outcome::Retry { .. })
    }
}

/// Why the inbox could not settle a delivery, or an operation on its records
/// failed. A delivery that ends in one is not recorded; let it come back.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InboxError {
    /// The consumer name or message id is empty, too long, or holds a NUL.
    #[error("invalid {what}: {reason}")]
    InvalidId {
        /// Which one.
        what: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A statement on `idem_inbox` failed.
    #[error("inbox database error: {0}")]
    Database(#[from] diesel::result::Error),
    /// No connection could be had, or idem's own transaction handling failed.
    #[error(transparent)]
    Idem(#[from] crate::Error),
}

fn check_id(what: &'static str, id: &str) -> Result<(), InboxError> {
    let reason = if id.is_empty() {
        "it is empty"
    } else if id.len() > MAX_ID_BYTES {
        "it is longer than 255 bytes"
    } else if id.contains('\0') {
        "it contains a NUL character, which PostgreSQL's text cannot hold"
    } else {
        return Ok(());
    };
    Err(InboxError::InvalidId { what, reason })
}
