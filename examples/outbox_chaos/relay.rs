//! The relay process (`--relay`): an `idem::outbox::Relay` publishing to
//! JetStream through a publisher that can stop dead at a chosen point, so
//! the parent's `SIGKILL` lands exactly there.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idem::outbox::{NatsPublisher, OutboxMessage, PublishError, Published, Publisher, Relay};
use idem::pool::{build_pool_with, PoolConfig};

use crate::ChildArgs;

/// Where a child stops to be killed. The first three are moments of a
/// relay's round (claim, publish every claimed head at once, mark the acked
/// ones sent); the last is the consumer's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stall {
    /// Claimed and leased, not yet handed to the broker: the event is in no
    /// stream; another relay must publish it once the lease runs out.
    Claim,
    /// Just acked by the broker, other publishes of the round maybe still
    /// in flight: in the stream, not marked sent; republished after the
    /// lease, and the stream drops the copy.
    Publish,
    /// Every publish of the round acked, none marked sent: the whole batch
    /// is republished after the lease.
    Mark,
    /// The consumer committed a message's effect and record, and has not
    /// acked it: JetStream redelivers it, and the inbox must skip it.
    Ack,
}

impl Stall {
    pub fn name(self) -> &'static str {
        match self {
            Stall::Claim => "claim",
            Stall::Publish => "publish",
            Stall::Mark => "mark",
            Stall::Ack => "ack",
        }
    }

    pub fn parse(name: &str) -> Option<Stall> {
        [Stall::Claim, Stall::Publish, Stall::Mark, Stall::Ack]
            .into_iter()
            .find(|s| s.name() == name)
    }

    /// What the moment means, for the kill log.
    pub fn moment(self) -> &'static str {
        match self {
            Stall::Claim => "after claim, before publish",
            Stall::Publish => "after publish (acked), round still publishing",
            Stall::Mark => "after the whole round was acked, before mark-sent",
            Stall::Ack => "after commit, before ack",
        }
    }
}

/// The real publisher, which on its first publish once `after` has passed
/// since it started stops for good at the chosen point and says so on
/// stdout (`STALLED <stall> <event id>`).
struct Chaos {
    inner: NatsPublisher,
    stall: Option<(Stall, Instant)>,
    /// Publishes entered and not yet returned by the broker.
    unfinished: AtomicUsize,
    tripped: AtomicBool,
}

impl Chaos {
    /// Say where, then never return: the round stays open until the kill.
    async fn stop_here<T>(&self, stall: Stall, message: &OutboxMessage) -> T {
        println!("STALLED {} {}", stall.name(), message.id);
        std::future::pending().await
    }
}

impl Publisher for Chaos {
    async fn publish(&self, message: &OutboxMessage) -> Result<Published, PublishError> {
        let trip = match self.stall {
            Some((stall, when))
                if Instant::now() >= when && !self.tripped.swap(true, Ordering::SeqCst) =>
            {
                Some(stall)
            }
            _ => None,
        };
        if trip == Some(Stall::Claim) {
            return self.stop_here(Stall::Claim, message).await;
        }
        self.unfinished.fetch_add(1, Ordering::SeqCst);
        let published = self.inner.publish(message).await;
        self.unfinished.fetch_sub(1, Ordering::SeqCst);
        match trip {
            Some(Stall::Publish) => self.stop_here(Stall::Publish, message).await,
            Some(Stall::Mark) => {
                // The round publishes its heads concurrently and marks them
                // only when all returned: wait for the others' acks, and
                // this one never returns, so the mark never comes.
                while self.unfinished.load(Ordering::SeqCst) > 0 {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                self.stop_here(Stall::Mark, message).await
            }
            _ => published,
        }
    }

    async fn prepare(
        &self,
        horizon: idem::outbox::Horizon,
    ) -> Result<(), idem::outbox::PrepareError> {
        self.inner.prepare(horizon).await
    }
}

/// The lease of a claim: how long the events of a killed relay wait before
/// another relay takes them. Longer than the publish timeout below, as
/// `Relay::lease` requires, so a live relay's slow publish is never
/// overtaken.
pub const LEASE: Duration = Duration::from_secs(4);
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(2);

pub async fn main(args: ChildArgs) {
    let pool = build_pool_with(
        &args.database,
        &PoolConfig {
            max_size: 3,
            wait_timeout: Duration::from_secs(10),
            ..PoolConfig::default()
        },
    )
    .expect("relay pool");
    let client = async_nats::connect(&args.nats)
        .await
        .expect("connect to NATS");
    let js = async_nats::jetstream::context::ContextBuilder::new()
        .timeout(PUBLISH_TIMEOUT)
        .build(client);
    let publisher = Chaos {
        inner: NatsPublisher::new(js, &args.stream).subject_prefix(&args.stream),
        stall: args
            .stall
            .map(|(stall, after)| (stall, Instant::now() + after)),
        unfinished: AtomicUsize::new(0),
        tripped: AtomicBool::new(false),
    };
    // Small batches and a short poll: the three relays take turns on the
    // keys, and a killed relay's batch is a handful of events, not all.
    Relay::new(pool, publisher)
        .batch_size(16)
        .poll_interval(Duration::from_millis(50))
        .lease(LEASE)
        .run(crate::stdin_closed())
        .await
        .expect("the relay starts");
}
