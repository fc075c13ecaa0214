//! The NATS path: the provider's callback published to JetStream under its
//! transaction id, and a consumer applying it through `idem::inbox`.

use std::future::Future;
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::{pull, AckPolicy, PullConsumer};
use async_nats::jetstream::{self, AckKind};
use futures_util::StreamExt;
use idem::inbox::{message_id, Inbox, InboxConfig, Outcome};
use idem::Pool;
use idem_testing::nats::TestStream;

use crate::service::{self, Callback};

/// The durable consumer's name, which is also the inbox's key space.
const NAME: &str = "orders-payments";

/// How long JetStream waits for an ack before it delivers again.
const ACK_WAIT: Duration = Duration::from_secs(1);

pub struct Consumer {
    js: jetstream::Context,
    stream: TestStream,
    consumer: PullConsumer,
    task: tokio::task::JoinHandle<()>,
}

impl Consumer {
    /// A stream of the example's own and the consumer loop, until `stop`.
    pub async fn start(pool: Pool, stop: impl Future<Output = ()> + Send + 'static) -> Consumer {
        let js = idem_testing::nats::jetstream()
            .await
            .expect("a NATS server with JetStream");
        let stream = TestStream::create(&js, "orders").await.expect("a stream");
        let consumer: PullConsumer = stream
            .stream()
            .create_consumer(pull::Config {
                durable_name: Some(NAME.to_owned()),
                ack_policy: AckPolicy::Explicit,
                ack_wait: ACK_WAIT,
                ..Default::default()
            })
            .await
            .expect("the durable consumer");
        let inbox = Inbox::new(pool.clone(), NAME, InboxConfig::new()).expect("the inbox");
        let task = tokio::spawn(consume(pool, inbox, consumer.clone(), stop));
        Consumer {
            js,
            stream,
            consumer,
            task,
        }
    }

    /// The provider's callback for order `id`, with its transaction id as
    /// `Nats-Msg-Id`: a repeat within the window is a duplicate at the broker.
    pub async fn publish(&self, id: i64) {
        let cb = Callback {
            txn: format!("txn-{id}"),
            order: id,
            amount: crate::amount(id),
        };
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", cb.txn.as_str());
        self.js
            .publish_with_headers(
                self.stream.subject().to_owned(),
                headers,
                serde_json::to_vec(&cb).expect("JSON").into(),
            )
            .await
            .expect("publish")
            .await
            .expect("the publish ack");
    }

    /// Waits until every message was delivered and acknowledged.
    pub async fn drain(&self, within: Duration) -> bool {
        let started = Instant::now();
        let mut consumer = self.consumer.clone();
        while started.elapsed() < within {
            let info = consumer.info().await.expect("consumer info");
            if info.num_pending == 0 && info.num_ack_pending == 0 {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        eprintln!("the consumer did not drain within {within:?}");
        false
    }

    pub async fn stop(self) {
        let _ = self.task.await;
        self.stream
            .delete(&self.js)
            .await
            .expect("delete the stream");
    }
}

/// The consumer loop: log the delivery, let the inbox apply it once, ack
/// after its commit. The first delivery of every fifth order is left
/// unacknowledged after its commit (a consumer that died before its ack):
/// JetStream delivers it again and the inbox skips it.
async fn consume(pool: Pool, inbox: Inbox, consumer: PullConsumer, stop: impl Future<Output = ()>) {
    let mut messages = consumer.messages().await.expect("subscribe");
    tokio::pin!(stop);
    loop {
        let message = tokio::select! {
            () = &mut stop => return,
            next = messages.next() => match next {
                Some(Ok(message)) => message,
                Some(Err(e)) => {
                    eprintln!("consumer: {e}");
                    continue;
                }
                None => return,
            },
        };
        let info = message.info().expect("a JetStream message");
        let id = message_id(message.headers.as_ref(), info.stream_sequence);
        let delivered = u64::try_from(info.delivered).unwrap_or(1);
        let cb: Callback = serde_json::from_slice(&message.payload).expect("a callback");
        {
            let mut conn = pool.get().await.expect("a connection");
            service::log_arrival(&mut conn, &cb.txn, "nats")
                .await
                .expect("log the arrival");
        }
        let outcome = inbox
            .handle(&id, &message.payload, delivered, service::payment_message)
            .await
            .expect("the inbox");
        let ack = match outcome {
            Outcome::Done(_) if delivered == 1 && cb.order % 5 == 0 => continue,
            Outcome::Done(_) | Outcome::Duplicate | Outcome::Dead => AckKind::Ack,
            Outcome::Retry { after, .. } => AckKind::Nak(Some(after)),
            Outcome::Parked { .. } => AckKind::Term,
        };
        message.ack_with(ack).await.expect("ack");
    }
}
