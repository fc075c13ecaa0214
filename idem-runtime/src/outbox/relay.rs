//! The relay: claims committed events, publishes them with no transaction
//! open, and marks them sent.

use std::future::Future;
use std::pin::{pin, Pin};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::pool::PoolError;
use diesel_async::{AsyncPgConnection, SimpleAsyncConnection};
use futures_util::StreamExt;

use super::publisher::{Horizon, OutboxMessage, PrepareError, PublishError, Publisher};
use super::store;
use super::timing::backoff_after;
pub use super::timing::RelayTiming;
use crate::pool::{Pool, PooledConnection};

/// Why [`Relay::run`] or [`Relay::run_once`] stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// The publisher refused to start (for NATS: a duplicate window shorter
    /// than the relay's horizon).
    #[error(transparent)]
    Prepare(#[from] PrepareError),
    /// No connection could be checked out.
    #[error("the relay could not check out a connection: {0}")]
    Checkout(#[from] PoolError),
    /// A statement on `idem_outbox` failed.
    #[error("the relay's statement on idem_outbox failed: {0}")]
    Database(#[from] diesel::result::Error),
}

/// What one round of [`Relay::run_once`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Round {
    /// Events claimed.
    pub claimed: usize,
    /// Events the broker acked (duplicates included).
    pub sent: usize,
    /// Of those, the ones the broker already had.
    pub duplicates: usize,
    /// Publishes the broker refused, or that failed for their event:
    /// counted, retried after backoff or parked as dead.
    pub failed: usize,
    /// Publishes that failed because the broker was unavailable: given back
    /// as they were, counted against no event. The relay then waits for the
    /// broker before its next round.
    pub unavailable: usize,
}

/// Publishes the outbox to a broker: at least once, in commit order per key.
///
/// Build it with [`Relay::new`], set what differs from the defaults, then
/// [`run`](Relay::run) it until a shutdown signal. Any number of relays may
/// run against one database.
///
/// ```no_run
/// # #[cfg(feature = "nats")]
/// # async fn start(
/// #     pool: idem_runtime::Pool,
/// #     shutdown: tokio::sync::oneshot::Receiver<()>,
/// # ) -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use idem_runtime::outbox::{NatsPublisher, Relay};
///
/// let client = async_nats::connect("127.0.0.1:4222").await?;
/// let publisher = NatsPublisher::new(async_nats::jetstream::new(client), "EVENTS");
/// Relay::new(pool, publisher)
///     .batch_size(200)
///     .poll_interval(Duration::from_millis(500))
///     // Stops when `shutdown` fires (say, on Ctrl-C).
///     .run(async { let _ = shutdown.await; })
///     .await?;
/// # Ok(()) }
/// ```
pub struct Relay<P> {
    pool: Pool,
    publisher: Arc<P>,
    batch_size: u32,
    poll_interval: Duration,
    lease: Duration,
    max_attempts: u32,
    backoff_base: Duration,
    backoff_max: Duration,
    retention: Duration,
    cleanup_interval: Duration,
    cleanup_batch: u32,
    listen: bool,
}

impl<P: Publisher> Relay<P> {
    /// A relay with the defaults: batch 100 keys, poll every 1 s (and on
    /// `NOTIFY`), lease 15 s, 8 attempts with backoff from 200 ms doubling to
    /// at most 10 s (a horizon of 37.6 s, inside JetStream's default 2 min
    /// duplicate window), sent rows kept 1 h and cleaned every 60 s, 1000 at
    /// a time.
    pub fn new(pool: Pool, publisher: P) -> Self {
        let timing = RelayTiming::default();
        Relay {
            pool,
            publisher: Arc::new(publisher),
            batch_size: 100,
            poll_interval: Duration::from_secs(1),
            lease: timing.lease,
            max_attempts: timing.max_attempts,
            backoff_base: timing.backoff_base,
            backoff_max: timing.backoff_max,
            retention: Duration::from_secs(60 * 60),
            cleanup_interval: Duration::from_secs(60),
            cleanup_batch: 1000,
            listen: true,
        }
    }

    /// How many keys one round claims (one event per key). Default 100.
    pub fn batch_size(mut self, keys: u32) -> Self {
        self.batch_size = keys.max(1);
        self
    }
    /// How long an idle relay waits before looking again, when no `NOTIFY`
    /// woke it. Default 1 s.
    pub fn poll_interval(mut self, every: Duration) -> Self {
        self.poll_interval = every;
        self
    }
    /// How long a claim lasts: a relay that dies mid-publish leaves its
    /// events to the others after this. Must exceed the publisher's own
    /// timeout (its wait for one ack; the NATS publisher refuses to start
    /// otherwise, [`PrepareError::LeaseTooShort`]). Default 15 s.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }
    /// Failed publishes of one event before it is parked as dead (and its
    /// key stops until [`requeue`](super::requeue)). Default 8. Only
    /// refusals and errors of the event count: a publish that failed because
    /// the broker was unavailable counts toward nothing.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }
    /// The wait after a first failure, doubled after each next one up to
    /// `max`. Default 200 ms, at most 10 s. The same steps, with jitter,
    /// space the relay's checks of an unavailable broker.
    pub fn backoff(mut self, base: Duration, max: Duration) -> Self {
        self.backoff_base = base;
        self.backoff_max = max.max(base);
        self
    }
    /// How long sent events stay in `idem_outbox` before the cleanup deletes
    /// them. Default 1 h.
    pub fn retention(mut self, keep: Duration) -> Self {
        self.retention = keep;
        self
    }
    /// How often the relay deletes sent events past the retention, and how
    /// many per statement. Default every 60 s, 1000 at a time.
    pub fn cleanup(mut self, every: Duration, batch: u32) -> Self {
        self.cleanup_interval = every;
        self.cleanup_batch = batch.max(1);
        self
    }
    /// Whether to hold one connection that `LISTEN`s for new events, so the
    /// relay wakes at commit instead of at its next poll. Default true; the
    /// connection is one of the pool's, kept for as long as the relay runs
    /// (size the pool for it). A broken listener is made again, and until
    /// then the relay polls. Each time it starts listening the relay looks
    /// once more, so an event committed before `LISTEN` took effect is not
    /// left for the next poll.
    pub fn listen(mut self, on: bool) -> Self {
        self.listen = on;
        self
    }

    /// How long after publishing an event this relay may publish it again:
    /// the lease plus every retry's backoff. The broker must remember ids
    /// at least this long. A broker outage adds its own length (a publish
    /// whose ack was lost goes again when the broker is back): a window
    /// longer than this horizon by the longest outage to ride out keeps
    /// such an event from being stored twice.
    pub fn horizon(&self) -> Horizon {
        RelayTiming {
            lease: self.lease,
            max_attempts: self.max_attempts,
            backoff_base: self.backoff_base,
            backoff_max: self.backoff_max,
        }
        .horizon()
    }

    /// The wait after the `failures`-th failed publish of an event.
    fn backoff_after(&self, failures: u32) -> Duration {
        backoff_after(self.backoff_base, self.backoff_max, failures)
    }

    /// Run until `shutdown` completes: check the publisher, then claim,
    /// publish and mark rounds, waiting between them when nothing is due.
    /// Failures of a round are logged and retried at the next poll; the
    /// round in flight when `shutdown` fires is finished first.
    ///
    /// A round that found the broker unavailable is followed by a wait:
    /// [`Publisher::check`] is asked after each step of the
    /// [`backoff`](Self::backoff) (with jitter, growing while the broker
    /// stays away), and rounds resume once it passes. No event is claimed
    /// nor charged meanwhile.
    ///
    /// # Errors
    ///
    /// Only at start-up: [`RelayError::Prepare`].
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), RelayError> {
        self.publisher.prepare(self.horizon()).await?;
        let mut shutdown = pin!(shutdown);
        let mut listener: Option<PooledConnection> = None;
        let mut last_cleanup = Instant::now();
        // Waits for the broker in a row: the next wait's step. Reset only by
        // a round that stored something, so a broker that passes its check
        // but stores nothing is waited for longer and longer, never in a
        // tight loop.
        let mut outage_steps = 0_u32;
        loop {
            let round = self.run_once().await;
            self.housekeep(&mut last_cleanup).await;
            if matches!(&round, Ok(round) if round.sent > 0) {
                // The broker stored something: whatever else failed, it is
                // not down, and the next wait starts short again.
                outage_steps = 0;
            }
            let busy = match round {
                Ok(round) if round.unavailable > 0 => {
                    if !self
                        .wait_for_broker(shutdown.as_mut(), &mut outage_steps, &mut last_cleanup)
                        .await
                    {
                        return Ok(());
                    }
                    continue;
                }
                Ok(round) => round.claimed == self.batch_size as usize,
                Err(e) => {
                    tracing::warn!(error = %e, "outbox relay round failed; trying again at the next poll");
                    false
                }
            };
            if busy {
                // A full batch: more is probably due; look again at once,
                // unless told to stop.
                if futures_util::FutureExt::now_or_never(shutdown.as_mut()).is_some() {
                    return Ok(());
                }
                continue;
            }
            if self.listen && listener.is_none() {
                listener = self.listener().await;
                if listener.is_some() {
                    // An event committed after this round claimed and before
                    // `LISTEN` took effect notified no one: look once more,
                    // now that a commit cannot go unheard, rather than leave
                    // it for the next poll.
                    continue;
                }
            }
            tokio::select! {
                () = shutdown.as_mut() => return Ok(()),
                woke = wait(listener.as_deref_mut().map(|c| &mut **c), self.poll_interval) => {
                    if !woke {
                        listener = None;
                    }
                }
            }
        }
    }

    /// Wait until [`Publisher::check`] passes, backing off between checks;
    /// false when `shutdown` completed first. Cleanup and gauges go on
    /// meanwhile: they need only the database, and the backlog is what an
    /// operator watches during an outage.
    async fn wait_for_broker(
        &self,
        mut shutdown: Pin<&mut (impl Future<Output = ()> + Send)>,
        steps: &mut u32,
        last_cleanup: &mut Instant,
    ) -> bool {
        let since = Instant::now();
        tracing::info!("outbox relay: waiting for the broker");
        loop {
            *steps = steps.saturating_add(1);
            let pause = equal_jitter(self.backoff_after(*steps));
            tokio::select! {
                () = shutdown.as_mut() => return false,
                () = tokio::time::sleep(pause) => {}
            }
            let checked = tokio::select! {
                () = shutdown.as_mut() => return false,
                checked = self.publisher.check() => checked,
            };
            match checked {
                Ok(()) => {
                    tracing::info!(waited = ?since.elapsed(), "outbox relay: the broker is back; resuming");
                    return true;
                }
                Err(e) => {
                    tracing::debug!(error = %e, next_step = ?self.backoff_after(*steps + 1), "outbox relay: the broker is still unavailable")
                }
            }
            self.housekeep(last_cleanup).await;
        }
    }

    /// Delete sent events past the retention and set the gauges, when the
    /// cleanup interval has passed since `last`.
    async fn housekeep(&self, last: &mut Instant) {
        if last.elapsed() < self.cleanup_interval {
            return;
        }
        *last = Instant::now();
        if let Err(e) = self.clean().await {
            tracing::warn!(error = %e, "outbox cleanup failed");
        }
        #[cfg(feature = "metrics")]
        self.record_gauges().await;
    }

    /// One round: claim up to [`batch_size`](Self::batch_size) heads,
    /// publish each with no transaction open, mark the acked ones sent and
    /// the failed ones for a retry (or dead).
    ///
    /// # Errors
    ///
    /// [`RelayError::Checkout`] or [`RelayError::Database`]; events claimed
    /// but not marked are published again after their lease.
    pub async fn run_once(&self) -> Result<Round, RelayError> {
        let mut conn = self.pool.get().await?;
        let store::Claim {
            readable: claimed,
            unreadable,
        } = store::claim(&mut conn, i64::from(self.batch_size), self.lease).await?;
        // No later round reads them better: dead at once, each blocking its
        // own key only.
        for (message, error) in &unreadable {
            tracing::error!(event_id = %message.id, key = %message.key, seq = message.seq, error, "outbox event parked as dead: its body cannot be read back; its key is blocked until it is discarded");
            store::mark_failed(&mut conn, message.id.0, error, 1, Duration::ZERO).await?;
        }
        // The connection goes back to the pool while the broker is called.
        drop(conn);
        let mut round = Round {
            claimed: claimed.len() + unreadable.len(),
            failed: unreadable.len(),
            ..Round::default()
        };
        // Every claimed event is the head of its own key, so they may be
        // in flight together: order only binds events of one key.
        let results = futures_util::future::join_all(
            claimed
                .iter()
                .map(|message| self.publisher.publish(message)),
        )
        .await;
        let mut acked = Vec::with_capacity(claimed.len());
        let mut failures = Vec::new();
        for (message, result) in claimed.iter().zip(results) {
            match result {
                Ok(published) => {
                    round.duplicates += usize::from(published.duplicate);
                    acked.push(message.id.0);
                }
                Err(e) => failures.push((message, e)),
            }
        }
        let (refused, unavailable) = self.sort_failures(failures).await;
        let mut conn = self.pool.get().await?;
        round.sent = acked.len();
        if !acked.is_empty() {
            store::mark_sent(&mut conn, &acked).await?;
        }
        round.unavailable = unavailable.len();
        if !unavailable.is_empty() {
            tracing::warn!(events = unavailable.len(), error = %unavailable[0].1, "outbox publish failed: the broker is unavailable; the events wait for it, uncharged");
            let (ids, errors): (Vec<_>, Vec<_>) = unavailable
                .iter()
                .map(|(message, error)| (message.id.0, error.to_string()))
                .unzip();
            store::release(&mut conn, &ids, &errors).await?;
        }
        round.failed += refused.len();
        for (message, error) in refused {
            self.record_failure(&mut conn, message, &error.to_string())
                .await?;
        }
        Ok(round)
    }

    /// Split failed publishes into those charged to their event and those
    /// the broker's unavailability explains. A failure the publisher marked
    /// unavailable is the broker's; any other is the event's only if the
    /// broker passes its check now: an answer such as "no responders" means
    /// "no stream takes this subject" from a healthy broker but "no leader
    /// yet" from a failing one, and only the broker can say which.
    async fn sort_failures<'m>(
        &self,
        failures: Vec<(&'m OutboxMessage, PublishError)>,
    ) -> (Failures<'m>, Failures<'m>) {
        let broker = if failures.iter().any(|(_, e)| !e.is_unavailable()) {
            self.publisher.check().await
        } else {
            Ok(())
        };
        if let Err(e) = &broker {
            tracing::debug!(error = %e, "outbox publishes failed while the broker fails its check: none is charged");
        }
        failures
            .into_iter()
            .partition(|(_, e)| !e.is_unavailable() && broker.is_ok())
    }

    async fn record_failure(
        &self,
        conn: &mut AsyncPgConnection,
        message: &OutboxMessage,
        error: &str,
    ) -> Result<(), RelayError> {
        let failures = u32::try_from(message.attempts).unwrap_or(0) + 1;
        let dead = failures >= self.max_attempts;
        if dead {
            tracing::error!(event_id = %message.id, key = %message.key, seq = message.seq, failures, error, "outbox event parked as dead; its key is blocked until requeued");
        } else {
            tracing::warn!(event_id = %message.id, key = %message.key, seq = message.seq, failures, error, "outbox publish failed; retrying after backoff");
        }
        store::mark_failed(
            conn,
            message.id.0,
            error,
            self.max_attempts,
            self.backoff_after(failures),
        )
        .await?;
        Ok(())
    }

    /// Delete sent events past the retention, a batch at a time, until none
    /// is left. Returns how many were deleted.
    ///
    /// # Errors
    ///
    /// [`RelayError::Checkout`] or [`RelayError::Database`].
    pub async fn clean(&self) -> Result<usize, RelayError> {
        let mut conn = self.pool.get().await?;
        Ok(super::delete_sent(&mut conn, self.retention, self.cleanup_batch).await?)
    }

    #[cfg(feature = "metrics")]
    async fn record_gauges(&self) {
        let Ok(mut conn) = self.pool.get().await else {
            return;
        };
        if let Ok(stats) = super::stats(&mut conn).await {
            stats.record_gauges();
        }
    }

    /// A connection listening on the channel the outbox trigger notifies.
    async fn listener(&self) -> Option<PooledConnection> {
        let mut conn = self.pool.get().await.ok()?;
        match conn.batch_execute("LISTEN idem_outbox").await {
            Ok(()) => Some(conn),
            Err(e) => {
                tracing::debug!(error = %e, "LISTEN failed; polling only");
                None
            }
        }
    }
}

/// Failed publishes, each with its message.
type Failures<'m> = Vec<(&'m OutboxMessage, PublishError)>;

/// A wait of between half of `step` and all of it ("equal jitter"): relays
/// that met the same outage do not check the broker in lockstep, and the
/// wait still grows with the step.
fn equal_jitter(step: Duration) -> Duration {
    let half = step / 2;
    let spread = u64::try_from(half.as_nanos()).unwrap_or(u64::MAX);
    if spread == 0 {
        return step;
    }
    // A fresh RandomState is randomly keyed; its hash is spread enough for
    // jitter and keeps a random-number crate out.
    let random =
        std::hash::BuildHasher::hash_one(&std::collections::hash_map::RandomState::new(), 0_u8);
    half + Duration::from_nanos(random % spread.saturating_add(1))
}

/// Wait for a notification on `listener` or for `poll`, whichever is first.
/// False when the listening connection broke (it is dropped and made again).
async fn wait(listener: Option<&mut AsyncPgConnection>, poll: Duration) -> bool {
    let Some(conn) = listener else {
        tokio::time::sleep(poll).await;
        return true;
    };
    let mut notes = pin!(conn.notifications_stream());
    match tokio::time::timeout(poll, notes.next()).await {
        Err(_elapsed) => true,
        Ok(Some(Ok(_))) => {
            // Several commits may have notified: one round serves them all.
            while let Some(Some(Ok(_))) = futures_util::FutureExt::now_or_never(notes.next()) {}
            true
        }
        Ok(Some(Err(_)) | None) => false,
    }
}
