//! The NATS JetStream publisher (feature `nats`).

use async_nats::connection::State;
use async_nats::header::{HeaderMap, NATS_EXPECTED_STREAM, NATS_MESSAGE_ID};
use async_nats::jetstream::context::traits::TimeoutProvider;
use async_nats::jetstream::context::{
    GetStreamError, PublishError as JsPublishError, PublishErrorKind,
};
use async_nats::jetstream::publish::PublishAck;
use async_nats::jetstream::Context;
use async_nats::Client;

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
/// * At start-up ([`Publisher::prepare`]) it refuses a relay lease that
///   does not exceed the context's timeout (its wait for one ack), and a
///   stream whose `duplicate_window` is shorter than the relay's
///   [`horizon`](super::Relay::horizon). Every publish names that stream
///   (`Nats-Expected-Stream`): an event whose subject another stream
///   captures (a prefix can route there) is refused by the server, not
///   stored, and counts against the event (dead after the relay's
///   attempts), since that stream's window was never checked.
/// * It tells an unavailable server from a refusal without reading error
///   text. [Unavailable](PublishError::unavailable): the client is not
///   connected (nothing is sent then), the client could not take the
///   publish, no ack came within the JetStream timeout (the message may
///   have gone out: it is published again later under the same id), the
///   request was dropped with its connection, or the stream answered with
///   status 503 (no leader, not enough resources, a store that failed).
///   Counted against the event: any other answer of the stream (a message
///   too large for it, say) and "no responders", unless the check that
///   follows finds the broker unavailable. A message larger than the
///   server's `max_payload` is refused before it is sent, since the server
///   would close the connection instead of answering.
/// * Its [check](Publisher::check) passes when the client is connected
///   and the stream answers its info with a leader.
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
    client: Client,
    stream: String,
    prefix: Option<String>,
}

impl NatsPublisher {
    /// A publisher to the stream named `stream` (checked at start-up).
    pub fn new(context: Context, stream: impl Into<String>) -> Self {
        NatsPublisher {
            client: context.client(),
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

/// What an ack says of the message. A duplicate ack with sequence 0 says
/// it was *not* stored: nats-server answers so when the first copy of a
/// message id is still being proposed in a clustered stream, or its proposal
/// was lost in a leader change (nats-server before 2.11; nats-io/nats-server
/// pull requests 5818 and 5827). Taking it for a publish would mark an event
/// sent that the stream may never hold; the broker is treated as not ready,
/// so the event is published again, under the same message id, once it is.
fn stored(ack: &PublishAck) -> Result<Published, PublishError> {
    if ack.duplicate && ack.sequence == 0 {
        return Err(PublishError::unavailable(format!(
            "stream {} answered `duplicate` with sequence 0: the message was not stored (yet)",
            ack.stream
        )));
    }
    Ok(Published::new(ack.duplicate))
}

impl Publisher for NatsPublisher {
    async fn publish(&self, message: &OutboxMessage) -> Result<Published, PublishError> {
        // While the client is away its requests would queue until it
        // reconnects, long after their ack timed out: do not add to them.
        if self.client.connection_state() != State::Connected {
            return Err(PublishError::unavailable(
                "not connected to the NATS server",
            ));
        }
        let id = message.id.to_string();
        let version = message.version.to_string();
        let seq = message.seq.to_string();
        let fields = [
            ("Nats-Msg-Id", id.as_str()),
            ("Nats-Expected-Stream", self.stream.as_str()),
            ("Idem-Event-Kind", message.kind.as_str()),
            ("Idem-Event-Version", version.as_str()),
            ("Idem-Event-Key", message.key.as_str()),
            ("Idem-Event-Seq", seq.as_str()),
        ];
        let mut headers = HeaderMap::new();
        // The standard names, which the server reads; the others are ours.
        headers.insert(NATS_MESSAGE_ID, id.as_str());
        // Stored in the stream whose duplicate window the start-up check
        // read, or refused by the server: another stream that captured the
        // subject (through a prefix, say) could have a shorter window, and
        // an event published again after a relay died past its ack would
        // be stored twice there.
        headers.insert(NATS_EXPECTED_STREAM, self.stream.as_str());
        for (name, value) in &fields[2..] {
            headers.insert(*name, *value);
        }
        let body = serde_json::to_vec(&message.payload).map_err(PublishError::from_source)?;
        let size = body.len() + header_block_len(&fields);
        let max = self.client.server_info().max_payload;
        if max > 0 && size > max {
            return Err(PublishError::new(format!(
                "the event is {size} bytes with its headers, over the server's max_payload of {max}"
            )));
        }
        let ack = self
            .context
            .publish_with_headers(self.subject_of(message), headers, body.into())
            .await
            // The client did not take it: its queue stayed full (it is
            // reconnecting) or it is closed.
            .map_err(PublishError::unavailable_from)?
            .await;
        let ack = match ack {
            Ok(ack) => ack,
            Err(error) if store_failed(&error) && self.has_room().await => {
                // A working stream with room that could not store this one
                // message (its subject over a per-subject limit): this
                // event's refusal, charged, so that it cannot hold back
                // every other key as an outage would.
                return Err(PublishError::from_source(error));
            }
            Err(error) => return Err(classify(error)),
        };
        stored(&ack)
    }

    async fn check(&self) -> Result<(), PublishError> {
        if self.client.connection_state() != State::Connected {
            return Err(PublishError::unavailable(
                "not connected to the NATS server",
            ));
        }
        // A stream that answers its info has a leader to store messages;
        // a missing stream is unavailable too (it can come back), not a
        // fault of the events waiting for it.
        let stream = self
            .context
            .get_stream(&self.stream)
            .await
            .map_err(PublishError::unavailable_from)?;
        match &stream.cached_info().cluster {
            Some(cluster) if cluster.leader.is_none() => Err(PublishError::unavailable(format!(
                "stream {} has no leader",
                self.stream
            ))),
            _ => Ok(()),
        }
    }

    async fn prepare(&self, horizon: Horizon) -> Result<(), PrepareError> {
        let publish_timeout = TimeoutProvider::timeout(&self.context);
        if horizon.lease <= publish_timeout {
            return Err(PrepareError::LeaseTooShort {
                lease: horizon.lease,
                publish_timeout,
            });
        }
        let window = duplicate_window(&self.context, &self.stream)
            .await
            .map_err(|e| PrepareError::Broker(PublishError::from_source(e)))?;
        horizon.check_window(&self.stream, window)
    }
}

/// The `duplicate_window` of the stream named `stream`, as the server
/// answers its info now: what [`NatsPublisher`]'s start-up check and
/// `idem doctor`'s stream check compare with the relay's [`Horizon`].
pub(crate) async fn duplicate_window(
    context: &Context,
    stream: &str,
) -> Result<std::time::Duration, GetStreamError> {
    let stream = context.get_stream(stream).await?;
    Ok(stream.cached_info().config.duplicate_window)
}

impl NatsPublisher {
    /// Whether the stream answers with a leader and is under its own limits
    /// of messages and bytes, so that it stores messages other than one it
    /// refused.
    async fn has_room(&self) -> bool {
        let Ok(stream) = self.context.get_stream(&self.stream).await else {
            return false;
        };
        let info = stream.cached_info();
        if info.cluster.as_ref().is_some_and(|c| c.leader.is_none()) {
            return false;
        }
        let under = |max: i64, now: u64| max <= 0 || now < max.unsigned_abs();
        under(info.config.max_messages, info.state.messages)
            && under(info.config.max_bytes, info.state.bytes)
    }
}

/// Whether the stream answered that it failed to store the message (503,
/// JetStream's error 10077): no leader or no resources are other codes.
fn store_failed(error: &JsPublishError) -> bool {
    std::error::Error::source(error)
        .and_then(|e| e.downcast_ref::<async_nats::jetstream::Error>())
        .is_some_and(|e| e.error_code() == async_nats::jetstream::ErrorCode::STREAM_STORE_FAILED)
}

/// Sort a failed JetStream publish by its kind and status code.
fn classify(error: JsPublishError) -> PublishError {
    match error.kind() {
        // No answer, or the request dropped with its connection: the
        // server may have stored the message; it goes again under its id.
        PublishErrorKind::TimedOut
        | PublishErrorKind::BrokenPipe
        | PublishErrorKind::MaxAckPending => PublishError::unavailable_from(error),
        // The stream could not store it, and is not known to store others
        // (no leader, no resources, full): waited for.
        PublishErrorKind::Other if status_of(&error) == Some(503) => {
            PublishError::unavailable_from(error)
        }
        // "No responders" (reported as StreamNotFound) and the stream's
        // other answers: the relay's check decides whether the broker was
        // there to mean them.
        _ => PublishError::from_source(error),
    }
}

/// The HTTP-like status of the stream's error answer, if it gave one.
fn status_of(error: &JsPublishError) -> Option<usize> {
    std::error::Error::source(error)?
        .downcast_ref::<async_nats::jetstream::Error>()
        .map(async_nats::jetstream::Error::code)
}

/// The bytes `fields` take as a NATS header block (`NATS/1.0`, one
/// `Name: value` line each, a blank line), which the server counts toward
/// `max_payload`.
fn header_block_len(fields: &[(&str, &str)]) -> usize {
    let lines: usize = fields.iter().map(|(n, v)| n.len() + 2 + v.len() + 2).sum();
    "NATS/1.0\r\n".len() + lines + 2
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The acks as nats-server sends them.
    fn ack(json: &str) -> PublishAck {
        serde_json::from_str(json).expect("a publish ack")
    }

    #[test]
    fn a_duplicate_ack_with_sequence_zero_is_not_a_publish() {
        let stored_once = stored(&ack(r#"{"stream":"S","seq":7}"#)).expect("stored");
        assert!(!stored_once.duplicate);
        let copy = stored(&ack(r#"{"stream":"S","seq":7,"duplicate":true}"#)).expect("a copy");
        assert!(copy.duplicate, "the stream holds it at 7: published");
        let not_stored = stored(&ack(r#"{"stream":"S","seq":0,"duplicate":true}"#))
            .expect_err("sequence 0 says the message was not stored");
        assert!(not_stored.is_unavailable(), "counted against no event");
    }
}
