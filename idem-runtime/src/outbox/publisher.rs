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

/// Why a publish failed.
///
/// Two kinds, which the relay treats differently:
///
/// * **A refusal**, or an error of this event ([`new`](Self::new),
///   [`from_source`](Self::from_source)): the relay retries it with
///   backoff and parks the event as dead after
///   [`max_attempts`](super::Relay::max_attempts) — provided the broker
///   answers [`Publisher::check`] at that moment; otherwise the failure is
///   taken as the broker's, like the kind below.
/// * **The broker is unavailable** ([`unavailable`](Self::unavailable),
///   [`unavailable_from`](Self::unavailable_from)): unreachable, not
///   answering, without a leader, or unable to take any message now. It
///   counts toward no event's attempts: the relay puts the event back as it
///   was and waits for the broker. A publish that may have gone out anyway
///   (buffered by a client, its ack lost) is published again later with the
///   same id, which the broker deduplicates.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct PublishError {
    message: String,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
    unavailable: bool,
}

impl PublishError {
    /// A refusal, or an error of this event, described by `message`.
    pub fn new(message: impl Into<String>) -> Self {
        PublishError {
            message: message.into(),
            source: None,
            unavailable: false,
        }
    }

    /// A refusal, or an error of this event, caused by `source`.
    pub fn from_source(source: impl std::error::Error + Send + Sync + 'static) -> Self {
        PublishError {
            message: source.to_string(),
            source: Some(Box::new(source)),
            unavailable: false,
        }
    }

    /// The broker is unavailable, as `message` says: counted against no
    /// event.
    pub fn unavailable(message: impl Into<String>) -> Self {
        PublishError {
            unavailable: true,
            ..PublishError::new(message)
        }
    }

    /// The broker is unavailable, as `source` says: counted against no
    /// event.
    pub fn unavailable_from(source: impl std::error::Error + Send + Sync + 'static) -> Self {
        PublishError {
            unavailable: true,
            ..PublishError::from_source(source)
        }
    }

    /// Whether the publisher said the broker is unavailable (rather than
    /// refusing this event).
    pub fn is_unavailable(&self) -> bool {
        self.unavailable
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
    /// The relay's lease ends before a publish may: another relay would
    /// claim the event while this one still waits for its ack, and publish
    /// it again (in order, but twice for the broker to drop).
    #[error("the relay's lease of {lease:?} does not exceed the publisher's timeout of {publish_timeout:?}: another relay would claim an event still being published; lengthen the lease or shorten the publisher's timeout")]
    LeaseTooShort {
        /// The relay's lease.
        lease: Duration,
        /// How long the publisher waits for one ack.
        publish_timeout: Duration,
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
    /// Lease plus retry (at most `Duration::MAX`).
    pub fn total(&self) -> Duration {
        self.lease.saturating_add(self.retry)
    }

    /// Refuse a broker that remembers message ids for `window` only, when
    /// that is shorter than this horizon: an event published again within
    /// the horizon would be stored twice. `stream` names the broker's
    /// stream in the error. The NATS publisher's [`prepare`](Publisher::prepare)
    /// and `idem doctor`'s stream check both ask this.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idem_runtime::outbox::{Horizon, PrepareError};
    ///
    /// let horizon = Horizon { lease: Duration::from_secs(15), retry: Duration::from_secs(20) };
    /// assert!(horizon.check_window("ORDERS", Duration::from_secs(120)).is_ok());
    /// let short = horizon.check_window("ORDERS", Duration::from_secs(10));
    /// assert!(matches!(short, Err(PrepareError::DedupWindowTooShort { .. })));
    /// ```
    ///
    /// # Errors
    ///
    /// [`PrepareError::DedupWindowTooShort`] when `window` is shorter than
    /// [`total`](Self::total).
    pub fn check_window(&self, stream: &str, window: Duration) -> Result<(), PrepareError> {
        if window < self.total() {
            return Err(PrepareError::DedupWindowTooShort {
                stream: stream.to_owned(),
                window,
                horizon: self.total(),
                lease: self.lease,
                retry: self.retry,
            });
        }
        Ok(())
    }
}

/// A broker the relay publishes to.
///
/// `publish` returns once the broker has the message durably (for
/// JetStream: the publish ack), and must pass [`OutboxMessage::id`] on so
/// the broker drops copies: the relay publishes at least once.
///
/// A publisher tells an unavailable broker from a refusal of the event
/// (see [`PublishError`]): what it marks
/// [`unavailable`](PublishError::unavailable) never makes an event dead,
/// and what it does not mark counts only while [`check`](Self::check)
/// passes.
pub trait Publisher: Send + Sync + 'static {
    /// Publish one message and wait for the broker's ack.
    fn publish(
        &self,
        message: &OutboxMessage,
    ) -> impl Future<Output = Result<Published, PublishError>> + Send;

    /// Whether the broker can take messages now. The relay asks after a
    /// round in which a publish failed with an error not marked unavailable
    /// (an `Err` makes those failures the broker's, counted against no
    /// event), and, while the broker is unavailable, between its waits (an
    /// `Ok` ends the wait). Keep it cheap and bounded in time. Default:
    /// `Ok` (every unmarked failure counts).
    fn check(&self) -> impl Future<Output = Result<(), PublishError>> + Send {
        async { Ok(()) }
    }

    /// Checked once when the relay starts: refuse to run when the broker
    /// would not recognise an event published again within `horizon`.
    /// Default: nothing to check.
    fn prepare(&self, horizon: Horizon) -> impl Future<Output = Result<(), PrepareError>> + Send {
        let _ = horizon;
        async { Ok(()) }
    }
}
