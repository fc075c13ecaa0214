//! What the relay hands to a broker, and what it needs back.

use std::future::Future;
use std::time::Duration;

use super::event::EventId;

/// One event as the relay publishes it: the row the business transaction
/// wrote, read back.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct OutboxMessage {
    /// The event id; a publisher passes it to the broker for deduplication.
    pub id: EventId,
    /// The ordering key.
    pub key: String,
    /// Position in the key, 1, 2, .. in commit order.
    pub seq: i64,
    /// The subject, before any prefix of the publisher.
    pub subject: String,
    /// [`Event::KIND`](super::Event::KIND).
    pub kind: String,
    /// [`Event::VERSION`](super::Event::VERSION).
    pub version: i64,
    /// The event as JSON.
    pub payload: serde_json::Value,
    /// Failed publish attempts before this one.
    pub attempts: i32,
}

/// The broker's answer to a publish that succeeded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Published {
    /// The broker already had a message with this id and dropped this copy.
    /// Counts as success: the event is in the stream once.
    pub duplicate: bool,
}

impl Published {
    /// A publish the broker stored (or dropped as a duplicate).
    pub fn new(duplicate: bool) -> Self {
        Published { duplicate }
    }
}

/// Why a publish failed: the relay retries it with backoff, and parks the
/// event as dead after [`max_attempts`](super::Relay::max_attempts).
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct PublishError {
    message: String,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl PublishError {
    /// A failure described by `message`.
    pub fn new(message: impl Into<String>) -> Self {
        PublishError {
            message: message.into(),
            source: None,
        }
    }

    /// A failure caused by `source`.
    pub fn from_source(source: impl std::error::Error + Send + Sync + 'static) -> Self {
        PublishError {
            message: source.to_string(),
            source: Some(Box::new(source)),
        }
    }
}

/// Why a publisher refused to start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PrepareError {
    /// The stream forgets message ids sooner than the relay may publish an
    /// event again, so a republished event would be stored twice.
    #[error("stream {stream} keeps message ids for {window:?} (duplicate_window), shorter than the relay's republish horizon of {horizon:?} (lease {lease:?} + retry backoff {retry:?}); raise the stream's duplicate_window or shorten the relay's lease and backoff")]
    DedupWindowTooShort {
        /// The stream's name.
        stream: String,
        /// Its duplicate window.
        window: Duration,
        /// [`horizon`](Self::DedupWindowTooShort::horizon) = lease + retry.
        horizon: Duration,
        /// The relay's lease.
        lease: Duration,
        /// The relay's total backoff over all attempts of one event.
        retry: Duration,
    },
    /// The broker could not be asked.
    #[error("the publisher could not check the broker: {0}")]
    Broker(#[source] PublishError),
}

/// How long after a first publish the relay may publish the same event again:
/// the lease (a relay that died mid-publish) plus the backoff of every retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Horizon {
    /// The relay's claim lease.
    pub lease: Duration,
    /// The backoff summed over all attempts of one event.
    pub retry: Duration,
}

impl Horizon {
    /// Lease plus retry.
    pub fn total(&self) -> Duration {
        self.lease + self.retry
    }
}

/// A broker the relay publishes to.
///
/// `publish` returns once the broker has the message durably (for
/// JetStream: the publish ack), and must pass [`OutboxMessage::id`] on so
/// the broker drops copies: the relay publishes at least once.
pub trait Publisher: Send + Sync + 'static {
    /// Publish one message and wait for the broker's ack.
    fn publish(
        &self,
        message: &OutboxMessage,
    ) -> impl Future<Output = Result<Published, PublishError>> + Send;

    /// Checked once when the relay starts: refuse to run when the broker
    /// would not recognise an event published again within `horizon`.
    /// Default: nothing to check.
    fn prepare(&self, horizon: Horizon) -> impl Future<Output = Result<(), PrepareError>> + Send {
        let _ = horizon;
        async { Ok(()) }
    }
}
