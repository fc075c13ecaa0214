//! The pull loop over a JetStream consumer (feature `nats`): each message is
//! handled by [`Inbox::handle`] and acknowledged only after its outcome is
//! committed, so a crash at any point leaves either no record (the message
//! comes back and runs) or a record (the message comes back and is skipped).

use std::fmt::Display;
use std::future::Future;

use async_nats::jetstream::consumer::pull::MessagesError;
use async_nats::jetstream::consumer::{PullConsumer, StreamError};
use async_nats::jetstream::AckKind;
use async_nats::HeaderMap;
use diesel_async::AsyncPgConnection;
use futures_util::StreamExt;
use scoped_futures::ScopedBoxFuture;
use sha2::{Digest, Sha256};

use super::{Inbox, Outcome, MAX_ID_BYTES};
use crate::error::FromIdemError;

/// How many errors in a row from the message stream end the loop: the
/// client recovers from a missed heartbeat by itself, not from a deleted
/// consumer.
const MAX_STREAM_ERRORS_IN_A_ROW: u32 = 10;

/// What [`Inbox::run`] did until it stopped: deliveries by outcome.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RunReport {
    /// Effects run and committed with their record (acked).
    pub done: u64,
    /// Deliveries of messages recorded before, skipped (acked).
    pub duplicates: u64,
    /// Messages parked by this loop (termed).
    pub parked: u64,
    /// Deliveries of messages parked before, skipped (termed again).
    pub dead: u64,
    /// Failed effects, left to come back (nak with delay).
    pub retried: u64,
    /// Deliveries the inbox could not settle (nak with delay).
    pub errors: u64,
}

/// Why [`Inbox::run`] stopped other than by its shutdown signal.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// The pull subscription could not be set up.
    #[error("could not pull from the consumer: {0}")]
    Subscribe(#[source] StreamError),
    /// The message stream kept failing.
    #[error("the consumer's message stream kept failing: {0}")]
    Messages(#[source] MessagesError),
    /// The JetStream consumer stops redelivering a message (its
    /// `max_deliver`) before the inbox would park it
    /// ([`InboxConfig::max_deliveries`](super::InboxConfig::max_deliveries)):
    /// a message that kept failing would be dropped by the broker with no
    /// dead letter. Nothing was pulled. Raise the consumer's `max_deliver`
    /// (or leave it unlimited), or lower `max_deliveries` to it.
    #[error("the consumer redelivers a message at most {max_deliver} times, but the inbox parks it only at delivery {max_deliveries}: a failing message would be dropped with no dead letter; raise the consumer's max_deliver or lower max_deliveries")]
    MaxDeliverBelowInbox {
        /// The consumer's `max_deliver`.
        max_deliver: i64,
        /// The inbox's `max_deliveries`.
        max_deliveries: u64,
    },
}

/// The id a JetStream message is recorded under: its `Nats-Msg-Id` header
/// (the id the stream deduplicates publishes by), else `seq:` and its
/// stream sequence. A header that cannot be recorded as it is, because it
/// is longer than [`MAX_ID_BYTES`], holds a NUL (which PostgreSQL's text
/// cannot), or begins `seq:` or `sha256:` (the two derived forms, which a
/// producer could otherwise forge to take another message's record), is
/// recorded as `sha256:` and the hex digest of the whole header.
///
/// The client trims a header's value, so ids that differ only in spaces at
/// either end are one id here, though the stream keeps both messages.
///
/// ```
/// let mut headers = async_nats::HeaderMap::new();
/// headers.insert("Nats-Msg-Id", "order-17");
/// assert_eq!(idem_runtime::inbox::message_id(Some(&headers), 9), "order-17");
/// assert_eq!(idem_runtime::inbox::message_id(None, 9), "seq:9");
///
/// // A producer's id in a derived form is not taken as it is.
/// let mut forged = async_nats::HeaderMap::new();
/// forged.insert("Nats-Msg-Id", "seq:9");
/// assert!(idem_runtime::inbox::message_id(Some(&forged), 1).starts_with("sha256:"));
/// ```
pub fn message_id(headers: Option<&HeaderMap>, stream_sequence: u64) -> String {
    let header = headers
        // Parsed from the wire the name is the client's standard header;
        // built by hand with a string it is a custom one, which compares
        // unequal: look for both.
        .and_then(|h| {
            h.get(async_nats::header::NATS_MESSAGE_ID)
                .or_else(|| h.get("Nats-Msg-Id"))
        })
        .map(|v| v.as_str())
        .filter(|id| !id.is_empty());
    match header {
        Some(id) if recordable_as_is(id) => id.to_owned(),
        Some(id) => {
            let digest = Sha256::digest(id.as_bytes());
            format!("{HASHED}{}", crate::sql::to_hex(&digest))
        }
        None => format!("{SEQUENCE}{stream_sequence}"),
    }
}

/// The prefixes of the ids [`message_id`] derives.
const SEQUENCE: &str = "seq:";
const HASHED: &str = "sha256:";

/// Whether a producer's id can be the record's id as it is: not too long,
/// storable, and not in a form [`message_id`] derives.
fn recordable_as_is(id: &str) -> bool {
    id.len() <= MAX_ID_BYTES
        && !id.contains('\0')
        && !id.starts_with(SEQUENCE)
        && !id.starts_with(HASHED)
}

impl Inbox {
    /// Pull messages from `consumer` and handle each with `effect` (see
    /// [`Inbox::handle`]) until `shutdown` completes or the message stream
    /// ends. One message at a time: each is acknowledged after its outcome
    /// committed, with `+ACK` (done, or a duplicate), `+TERM` (parked) or
    /// `-NAK` with the backoff delay (failed). A message being handled when
    /// `shutdown` completes is finished first. Refused before anything is
    /// pulled ([`RunError::MaxDeliverBelowInbox`]) when the consumer's
    /// `max_deliver` is below [`InboxConfig::max_deliveries`](super::InboxConfig::max_deliveries).
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use idem_runtime::inbox::Inbox;
    /// use scoped_futures::ScopedFutureExt;
    ///
    /// # async fn demo(inbox: Inbox, js: async_nats::jetstream::Context) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// let stream = js.get_stream("ORDERS").await?;
    /// let consumer: async_nats::jetstream::consumer::PullConsumer =
    ///     stream.get_consumer("billing-orders").await?;
    /// // Any future: a signal, a cancellation token, a timer.
    /// let shutdown = tokio::time::sleep(Duration::from_secs(3600));
    /// let report = inbox
    ///     .run(&consumer, shutdown, |_conn, payload| {
    ///         async move { Ok::<_, idem_runtime::Error>(payload.len()) }.scope_boxed()
    ///     })
    ///     .await?;
    /// println!("{} applied, {} duplicates skipped", report.done, report.duplicates);
    /// # Ok(()) }
    /// ```
    pub async fn run<'a, T, E, F, S>(
        &self,
        consumer: &PullConsumer,
        shutdown: S,
        mut effect: F,
    ) -> Result<RunReport, RunError>
    where
        F: for<'c> FnMut(
                &'c mut AsyncPgConnection,
                &'c [u8],
            ) -> ScopedBoxFuture<'a, 'c, Result<T, E>>
            + Send,
        E: FromIdemError + Display,
        S: Future<Output = ()>,
    {
        // Unlimited is -1 (or 0, unset); the info is as the consumer was
        // fetched or created.
        let max_deliver = consumer.cached_info().config.max_deliver;
        if u64::try_from(max_deliver).is_ok_and(|n| n > 0 && n < self.config.max_deliveries) {
            return Err(RunError::MaxDeliverBelowInbox {
                max_deliver,
                max_deliveries: self.config.max_deliveries,
            });
        }
        let mut report = RunReport::default();
        let mut messages = consumer.messages().await.map_err(RunError::Subscribe)?;
        let mut errors_in_a_row = 0;
        tokio::pin!(shutdown);
        loop {
            let next = tokio::select! {
                biased;
                () = &mut shutdown => return Ok(report),
                next = messages.next() => next,
            };
            let message = match next {
                None => return Ok(report),
                Some(Ok(message)) => message,
                Some(Err(err)) => {
                    errors_in_a_row += 1;
                    if errors_in_a_row >= MAX_STREAM_ERRORS_IN_A_ROW {
                        return Err(RunError::Messages(err));
                    }
                    tracing::warn!(consumer = %self.consumer, error = %err, "idem.inbox: message stream error");
                    continue;
                }
            };
            errors_in_a_row = 0;
            let (delivered, sequence) = match message.info() {
                Ok(info) => (
                    u64::try_from(info.delivered).unwrap_or(1),
                    info.stream_sequence,
                ),
                Err(err) => {
                    // Not a JetStream delivery: nothing to acknowledge.
                    tracing::warn!(consumer = %self.consumer, error = %err, "idem.inbox: message without JetStream metadata skipped");
                    continue;
                }
            };
            let id = message_id(message.headers.as_ref(), sequence);
            let handled = self
                .handle(&id, &message.payload, delivered, &mut effect)
                .await;
            let ack = match handled {
                Ok(Outcome::Done(_)) => {
                    report.done += 1;
                    AckKind::Ack
                }
                Ok(Outcome::Duplicate) => {
                    report.duplicates += 1;
                    AckKind::Ack
                }
                Ok(Outcome::Parked { .. }) => {
                    report.parked += 1;
                    AckKind::Term
                }
                Ok(Outcome::Dead) => {
                    report.dead += 1;
                    AckKind::Term
                }
                Ok(Outcome::Retry { after, .. }) => {
                    report.retried += 1;
                    AckKind::Nak(Some(after))
                }
                Err(err) => {
                    report.errors += 1;
                    tracing::warn!(consumer = %self.consumer, msg_id = %id, error = %err, "idem.inbox: delivery not settled; it will be redelivered");
                    AckKind::Nak(Some(self.config.backoff_after(delivered)))
                }
            };
            // A lost acknowledgement costs a redelivery, which the record
            // skips: nothing to do about it but say so.
            if let Err(err) = message.ack_with(ack).await {
                tracing::debug!(consumer = %self.consumer, msg_id = %id, error = %err, "idem.inbox: acknowledgement not sent");
            }
        }
    }
}
