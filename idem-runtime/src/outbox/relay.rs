//! The relay: claims committed events, publishes them with no transaction
//! open, and marks them sent.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::pool::PoolError;
use diesel_async::{AsyncPgConnection, SimpleAsyncConnection};
use futures_util::StreamExt;

use super::publisher::{Horizon, OutboxMessage, PrepareError, Publisher};
use super::store;
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
    /// Publishes that failed (retried later, or parked as dead).
    pub failed: usize,
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
        Relay {
            pool,
            publisher: Arc::new(publisher),
            batch_size: 100,
            poll_interval: Duration::from_secs(1),
            lease: Duration::from_secs(15),
            max_attempts: 8,
            backoff_base: Duration::from_millis(200),
            backoff_max: Duration::from_secs(10),
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
    /// timeout. Default 15 s.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }
    /// Failed publishes of one event before it is parked as dead (and its
    /// key stops until [`requeue`](super::requeue)). Default 8.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }
    /// The wait after a first failure, doubled after each next one up to
    /// `max`. Default 200 ms, at most 10 s.
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
    /// then the relay polls.
    pub fn listen(mut self, on: bool) -> Self {
        self.listen = on;
        self
    }

    /// How long after publishing an event this relay may publish it again:
    /// the lease plus every retry's backoff. The broker must remember ids
    /// at least this long.
    pub fn horizon(&self) -> Horizon {
        let retry = (1..self.max_attempts).map(|n| self.backoff_after(n)).sum();
        Horizon {
            lease: self.lease,
            retry,
        }
    }

    /// The wait after the `failures`-th failed publish of an event.
    fn backoff_after(&self, failures: u32) -> Duration {
        let factor = 2u32.saturating_pow(failures.saturating_sub(1));
        self.backoff_base
            .saturating_mul(factor)
            .min(self.backoff_max)
    }

    /// Run until `shutdown` completes: check the publisher, then claim,
    /// publish and mark rounds, waiting between them when nothing is due.
    /// Failures of a round are logged and retried at the next poll; the
    /// round in flight when `shutdown` fires is finished first.
    ///
    /// # Errors
    ///
    /// Only at start-up: [`RelayError::Prepare`].
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), RelayError> {
        self.publisher.prepare(self.horizon()).await?;
        let mut shutdown = pin!(shutdown);
        let mut listener: Option<PooledConnection> = None;
        let mut last_cleanup = Instant::now();
        loop {
            let busy = match self.run_once().await {
                Ok(round) => round.claimed == self.batch_size as usize,
                Err(e) => {
                    tracing::warn!(error = %e, "outbox relay round failed; trying again at the next poll");
                    false
                }
            };
            if last_cleanup.elapsed() >= self.cleanup_interval {
                last_cleanup = Instant::now();
                if let Err(e) = self.clean().await {
                    tracing::warn!(error = %e, "outbox cleanup failed");
                }
                #[cfg(feature = "metrics")]
                self.record_gauges().await;
            }
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
        let claimed = store::claim(&mut conn, i64::from(self.batch_size), self.lease).await?;
        // The connection goes back to the pool while the broker is called.
        drop(conn);
        let mut round = Round {
            claimed: claimed.len(),
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
                Err(e) => failures.push((message, e.to_string())),
            }
        }
        let mut conn = self.pool.get().await?;
        round.sent = acked.len();
        if !acked.is_empty() {
            store::mark_sent(&mut conn, &acked).await?;
        }
        round.failed = failures.len();
        for (message, error) in failures {
            self.record_failure(&mut conn, message, &error).await?;
        }
        Ok(round)
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
            metrics::gauge!("idem_outbox_pending").set(stats.pending as f64);
            metrics::gauge!("idem_outbox_dead").set(stats.dead as f64);
            metrics::gauge!("idem_outbox_oldest_pending_seconds")
                .set(stats.oldest_pending.map_or(0.0, |age| age.as_secs_f64()));
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
