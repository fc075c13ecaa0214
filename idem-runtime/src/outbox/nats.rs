//! The NATS JetStream publisher (feature `nats`).

use async_nats::header::{HeaderMap, NATS_MESSAGE_ID};
use async_nats::jetstream::Context;

use super::publisher::{Horizon, OutboxMessage, PrepareError, PublishError, Published, Publisher};

/// Publishes outbox events to a JetStream stream, waiting for each publish
/// ack.
///
/// * The event id is the `Nats-Msg-Id`: the stream stores an event once
///   within its duplicate window, and a duplicate ack counts as success.
/// * Headers `Idem-Event-Kind`, `Idem-Event-Version`, `Idem-Event-Key` and
///   `Idem-Event-Seq` carry the rest of the row; the body is the JSON event.
/// * The subject is the event's, after an optional prefix
///   (`prefix.subject`); the stream must capture it.
/// * At start-up ([`Publisher::prepare`]) it refuses a stream whose
///   `duplicate_window` is shorter than the relay's
///   [`horizon`](super::Relay::horizon).
///
/// ```no_run
/// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
/// use idem_runtime::outbox::NatsPublisher;
///
/// let client = async_nats::connect("127.0.0.1:4222").await?;
/// let publisher = NatsPublisher::new(async_nats::jetstream::new(client), "ORDERS")
///     .subject_prefix("orders");
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct NatsPublisher {
    context: Context,
    stream: String,
    prefix: Option<String>,
}

impl NatsPublisher {
    /// A publisher to the stream named `stream` (checked at start-up).
    pub fn new(context: Context, stream: impl Into<String>) -> Self {
        NatsPublisher {
            context,
            stream: stream.into(),
            prefix: None,
        }
    }

    /// Publish on `prefix.<event subject>`. Default: no prefix.
    pub fn subject_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = Some(prefix.into());
        self
    }

    /// The subject `message` is published on.
    pub fn subject_of(&self, message: &OutboxMessage) -> String {
        match &self.prefix {
            Some(prefix) => format!("{prefix}.{}", message.subject),
            None => message.subject.clone(),
        }
    }
}

impl Publisher for NatsPublisher {
    async fn publish(&self, message: &OutboxMessage) -> Result<Published, PublishError> {
        let mut headers = HeaderMap::new();
        headers.insert(NATS_MESSAGE_ID, message.id.to_string().as_str());
        headers.insert("Idem-Event-Kind", message.kind.as_str());
        headers.insert("Idem-Event-Version", message.version.to_string().as_str());
        headers.insert("Idem-Event-Key", message.key.as_str());
        headers.insert("Idem-Event-Seq", message.seq.to_string().as_str());
        let body = serde_json::to_vec(&message.payload).map_err(PublishError::from_source)?;
        let ack = self
            .context
            .publish_with_headers(self.subject_of(message), headers, body.into())
            .await
            .map_err(PublishError::from_source)?
            .await
            .map_err(PublishError::from_source)?;
        if ack.stream != self.stream {
            // Another stream captured the subject: acked, but not where the
            // duplicate window was checked.
            tracing::warn!(expected = %self.stream, stream = %ack.stream, "outbox event stored in another stream than the one checked at start-up");
        }
        Ok(Published::new(ack.duplicate))
    }

    async fn prepare(&self, horizon: Horizon) -> Result<(), PrepareError> {
        let mut stream = self
            .context
            .get_stream(&self.stream)
            .await
            .map_err(|e| PrepareError::Broker(PublishError::from_source(e)))?;
        let info = stream
            .info()
            .await
            .map_err(|e| PrepareError::Broker(PublishError::from_source(e)))?;
        let window = info.config.duplicate_window;
        if window < horizon.total() {
            return Err(PrepareError::DedupWindowTooShort {
                stream: self.stream.clone(),
                window,
                horizon: horizon.total(),
                lease: horizon.lease,
                retry: horizon.retry,
            });
        }
        Ok(())
    }
}
