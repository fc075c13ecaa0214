//! The worker: claims due jobs of the kinds it handles, runs them, and
//! waits when none is due.

use std::collections::BTreeMap;
use std::fmt::{self, Display};
use std::future::Future;
use std::pin::pin;
use std::time::{Duration, Instant};

use crate::pool::PoolError;
use diesel_async::AsyncPgConnection;
use scoped_futures::ScopedBoxFuture;

use super::run::{self, Ended, Handler};
use super::{store, Job, Ladder};
use crate::pool::Pool;
use crate::retry::RetryPolicy;

/// Why [`Worker::run_once`] stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerError {
    /// No connection could be checked out for the claim.
    #[error("the jobs worker could not check out a connection: {0}")]
    Checkout(#[from] PoolError),
    /// The claim failed.
    #[error("the jobs worker's claim on idem_jobs failed: {0}")]
    Database(#[from] diesel::result::Error),
}

/// What one round of [`Worker::run_once`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Round {
    /// Jobs claimed.
    pub claimed: usize,
    /// Jobs whose handler's effect committed with their deletion.
    pub done: usize,
    /// Jobs that failed and are due again after the ladder's next step.
    pub retried: usize,
    /// Jobs that failed past the ladder and are now dead.
    pub dead: usize,
    /// Runs that a newer run took over, or whose failure could not be
    /// recorded: their lease decides.
    pub lost: usize,
}

/// Runs compensation jobs: claims the due jobs of the kinds it has
/// handlers for, runs each handler under the retry loop with the job's
/// deletion in the same transaction, and moves failed jobs up the
/// [`Ladder`]. Any number of workers, in any number of processes, may run
/// against one database.
///
/// ```no_run
/// use std::time::Duration;
/// use diesel_async::RunQueryDsl;
/// use idem_runtime::jobs::{Job, Worker};
/// use scoped_futures::ScopedFutureExt;
///
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct MarkPaid { order: i64 }
/// impl Job for MarkPaid {
///     const KIND: &'static str = "order.mark_paid";
///     fn key(&self) -> String { format!("order-{}", self.order) }
/// }
///
/// # async fn start(pool: idem_runtime::Pool, shutdown: tokio::sync::oneshot::Receiver<()>)
/// # -> Result<(), idem_runtime::jobs::WorkerError> {
/// Worker::new(pool)
///     .handle(|conn, job: &MarkPaid| {
///         async move {
///             diesel::sql_query("UPDATE orders SET status = 'paid' WHERE id = $1 AND status = 'pending'")
///                 .bind::<diesel::sql_types::BigInt, _>(job.order)
///                 .execute(conn)
///                 .await
///                 .map(drop)
///         }
///         .scope_boxed()
///     })
///     .poll_interval(Duration::from_millis(500))
///     // Stops when `shutdown` fires, after the round in flight.
///     .run(async { let _ = shutdown.await; })
///     .await
/// # }
/// ```
pub struct Worker {
    pool: Pool,
    handlers: BTreeMap<&'static str, Handler>,
    name: String,
    batch_size: u32,
    poll_interval: Duration,
    lease: Duration,
    ladder: Ladder,
    policy: RetryPolicy,
    gauge_interval: Duration,
}

impl fmt::Debug for Worker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Worker")
            .field("kinds", &self.handlers.keys().collect::<Vec<_>>())
            .field("name", &self.name)
            .field("batch_size", &self.batch_size)
            .field("poll_interval", &self.poll_interval)
            .field("lease", &self.lease)
            .field("ladder", &self.ladder)
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

impl Worker {
    /// A worker with no handlers and the defaults: batch 10, poll every
    /// 1 s, lease 60 s, the default [`Ladder`] (5 s, 30 s, 2 min), each run
    /// under [`RetryPolicy::new`] with a 30 s deadline, gauges every 15 s,
    /// named `pid-<process id>`.
    pub fn new(pool: Pool) -> Self {
        Worker {
            pool,
            handlers: BTreeMap::new(),
            name: format!("pid-{}", std::process::id()),
            batch_size: 10,
            poll_interval: Duration::from_secs(1),
            lease: Duration::from_secs(60),
            ladder: Ladder::default(),
            policy: RetryPolicy::new().deadline(Duration::from_secs(30)),
            gauge_interval: Duration::from_secs(15),
        }
    }

    /// Run jobs of kind [`J::KIND`](Job::KIND) with `handler`, replacing any
    /// handler of that kind. The handler is called once per attempt with the
    /// attempt's connection, inside the transaction that also deletes the
    /// job, and returns a boxed future (`scope_boxed()`), as with
    /// [`retry`](crate::retry::retry). It may [`enqueue`](super::enqueue())
    /// jobs and [`emit`](crate::outbox::emit) events. An `Err` rolls the
    /// run back; its `Display` is stored as the job's `last_error`.
    pub fn handle<J, E, F>(mut self, handler: F) -> Self
    where
        J: Job,
        E: Display + Send + 'static,
        F: for<'c> Fn(
                &'c mut AsyncPgConnection,
                &'c J,
            ) -> ScopedBoxFuture<'static, 'c, Result<(), E>>
            + Send
            + Sync
            + 'static,
    {
        self.handlers.insert(J::KIND, run::erase(handler));
        self
    }

    /// The name stored in `locked_by` while this worker holds a job.
    /// Default `pid-<process id>`.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }
    /// How many jobs one round claims (and runs at once, each on its own
    /// pooled connection). Default 10.
    pub fn batch_size(mut self, jobs: u32) -> Self {
        self.batch_size = jobs.max(1);
        self
    }
    /// How long an idle worker waits before looking again. Default 1 s.
    pub fn poll_interval(mut self, every: Duration) -> Self {
        self.poll_interval = every;
        self
    }
    /// How long a claim lasts: a worker that dies mid-job leaves the job to
    /// the others after this. Longer than a run takes (the policy's
    /// deadline), else a slow run is claimed again as soon as its
    /// transaction ends and finds itself taken over. Default 60 s; one past
    /// a thousand years counts as a thousand.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }
    /// The waits after failed runs. Default [`Ladder::default`].
    pub fn ladder(mut self, ladder: Ladder) -> Self {
        self.ladder = ladder;
        self
    }
    /// The retry loop each run's transaction runs under. Default
    /// [`RetryPolicy::new`] with a 30 s deadline (a compensation is not
    /// answering a client).
    pub fn policy(mut self, policy: RetryPolicy) -> Self {
        self.policy = policy;
        self
    }
    /// How often [`run`](Self::run) sets the gauges (feature `metrics`).
    /// Default 15 s.
    pub fn gauge_interval(mut self, every: Duration) -> Self {
        self.gauge_interval = every;
        self
    }

    /// Run until `shutdown` completes: claim and run rounds, waiting
    /// [`poll_interval`](Self::poll_interval) when a round found less than
    /// a full batch. A failed round is logged and tried again at the next
    /// poll; the round in flight when `shutdown` fires is finished first.
    ///
    /// # Errors
    ///
    /// None yet: the `Result` leaves room for start-up checks.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), WorkerError> {
        let mut shutdown = pin!(shutdown);
        let mut last_gauges: Option<Instant> = None;
        loop {
            let busy = match self.run_once().await {
                Ok(round) => round.claimed == self.batch_size as usize,
                Err(e) => {
                    tracing::warn!(error = %e, "jobs worker round failed; trying again at the next poll");
                    false
                }
            };
            if last_gauges.is_none_or(|at| at.elapsed() >= self.gauge_interval) {
                last_gauges = Some(Instant::now());
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
            tokio::select! {
                () = shutdown.as_mut() => return Ok(()),
                () = tokio::time::sleep(self.poll_interval) => {}
            }
        }
    }

    /// One round: claim up to [`batch_size`](Self::batch_size) due jobs of
    /// this worker's kinds and run them all.
    ///
    /// # Errors
    ///
    /// [`WorkerError`] when the claim failed; nothing was claimed then.
    pub async fn run_once(&self) -> Result<Round, WorkerError> {
        if self.handlers.is_empty() {
            return Ok(Round::default());
        }
        let kinds: Vec<&str> = self.handlers.keys().copied().collect();
        let claimed = {
            let mut conn = self.pool.get().await?;
            store::claim(
                &mut conn,
                &kinds,
                i64::from(self.batch_size),
                self.lease,
                &self.name,
            )
            .await?
        };
        let runs = claimed.iter().map(|job| {
            // Claimed only for kinds in the map.
            let handler = &self.handlers[job.kind.as_str()];
            run::run(&self.pool, self.policy, &self.ladder, handler, job)
        });
        let mut round = Round {
            claimed: claimed.len(),
            ..Round::default()
        };
        for ended in futures_util::future::join_all(runs).await {
            match ended {
                Ended::Done => round.done += 1,
                Ended::Retry => round.retried += 1,
                Ended::Dead => round.dead += 1,
                Ended::Lost => round.lost += 1,
            }
        }
        Ok(round)
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
}
