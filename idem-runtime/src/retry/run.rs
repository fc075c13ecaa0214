//! The loop itself. `#[retryable]`, `#[idempotent]` and the closure form
//! [`retry`] all expand to the same calls: [`RetryLoop::begin`],
//! [`RetryLoop::scope`] around the attempt's body, [`RetryLoop::finish`] with
//! the body's [`Step`], and again while `finish` says so. The loop knows
//! nothing of idempotency: what an attempt asks of its transaction arrives as
//! a [`Step`]; how a transaction begins and ends is [`crate::tx`]'s.

use std::future::Future;
use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use diesel_async::AsyncPgConnection;
use scoped_futures::ScopedBoxFuture;
use tracing::Instrument;

use super::attempt::{open, Attempt, Begin, Opening};
use super::backoff;
use super::{OnConflict, RetryCause, RetryPolicy, Transient};
use crate::attempt::{self, AttemptContext, ConflictSlot, ATTEMPT};
use crate::error::{Error, FromIdemError};
use crate::pool::{Pool, PoolError};
use crate::tx::CommitFailure;

/// Run `body` as a retried transaction: the closure form of `#[retryable]`.
///
/// The closure is called once per attempt with that attempt's connection,
/// inside an open transaction; it must return a boxed future (diesel-async's
/// `scope_boxed()`), as `AsyncConnection::transaction` does.
///
/// ```no_run
/// use diesel_async::RunQueryDsl;
/// use idem_runtime::retry::{retry, RetryPolicy};
/// use scoped_futures::ScopedFutureExt;
///
/// # async fn demo(pool: &idem_runtime::pool::Pool) -> Result<(), diesel::result::Error> {
/// #[derive(Debug, thiserror::Error)]
/// enum AppError {
///     #[error(transparent)] Idem(#[from] idem_runtime::Error),
///     #[error(transparent)] Db(#[from] diesel::result::Error),
/// }
///
/// let amount = 100_i64;
/// let moved: Result<usize, AppError> = retry(pool, RetryPolicy::new(), "transfer", |conn| {
///     async move {
///         diesel::sql_query("UPDATE accounts SET balance = balance - $1 WHERE id = 1")
///             .bind::<diesel::sql_types::BigInt, _>(amount)
///             .execute(conn)
///             .await
///             .map_err(AppError::Db)
///     }
///     .scope_boxed()
/// })
/// .await;
/// # Ok(()) }
/// ```
pub async fn retry<'a, T, E, F>(
    pool: &Pool,
    policy: RetryPolicy,
    name: &'static str,
    mut body: F,
) -> Result<T, E>
where
    F: for<'c> FnMut(&'c mut AsyncPgConnection) -> ScopedBoxFuture<'a, 'c, Result<T, E>>
        + Send
        + 'a,
    E: FromIdemError,
{
    let mut retry_loop = RetryLoop::new(pool, policy, name);
    loop {
        let mut attempt = retry_loop.begin().await.map_err(E::from)?;
        let result = retry_loop.scope(body(attempt.conn())).await;
        if let ControlFlow::Break(outcome) = retry_loop.finish(attempt, commit(result)).await {
            return outcome;
        }
    }
}

/// An attempt's plain result, as the step "commit and return it".
#[doc(hidden)]
pub fn commit<T, E>(result: Result<T, E>) -> Result<Step<T>, E> {
    result.map(Step::Commit)
}

/// How many `Step::Again` without delay one call gets free of charge (a
/// final error to store, a claim to resume, a record gone between two reads).
const MAX_IMMEDIATE_REPEATS: usize = 8;

/// What an attempt asks of its transaction when its body is done.
#[derive(Debug)]
#[doc(hidden)]
pub enum Step<T> {
    /// Commit, then return `T`.
    Commit(T),
    /// The attempt wrote nothing: return `T` at once and end the transaction
    /// in the background (an idempotent replay).
    Answer(T),
    /// The attempt committed by itself, its last statement sent with its
    /// `COMMIT` (a local idempotent call's record): return `T`, or handle
    /// the failure as that of a [`Step::Commit`].
    Committed(Result<T, CommitFailure>),
    /// Commit what the attempt wrote, then run the next attempt at once (an
    /// external idempotency claim, committed before its body runs). A commit
    /// whose outcome is unknown is replayed: the next attempt finds out.
    CommitAndContinue,
    /// Roll back, wait, and run the next attempt (a duplicate waiting for
    /// the first request, or a final error to store without the body's
    /// writes). Not a failure: it spends no attempt of the budget.
    Again(Duration),
}

/// The state of one call's retry loop: budget spent, and whether rows are
/// being locked after a conflict.
#[doc(hidden)]
pub struct RetryLoop<'p> {
    pool: &'p Pool,
    policy: RetryPolicy,
    name: &'static str,
    started: Instant,
    /// When the current attempt began (its checkout included).
    attempt_started: Instant,
    /// Time not charged to the deadline: repeats that spend no attempt.
    uncharged: Duration,
    attempts: u32,
    lock_rows: bool,
    /// A version conflict met by the current attempt's versioned writes.
    conflict: ConflictSlot,
    /// `Step::Again` with no delay so far: free up to a bound.
    immediate_repeats: usize,
    /// The last `Step::CommitAndContinue` got no answer to its `COMMIT`:
    /// the next attempt is told ([`Attempt::follows_unknown_commit`]).
    unknown_commit: bool,
    /// The call ended with the body's own end of the transaction:
    /// `Some(true)` when that committed what it had written (or may have),
    /// see [`RetryLoop::body_ended`].
    pub(super) body_ended: Option<bool>,
    /// What the body ended had idem's ride (a local call's record) go out
    /// on its own `COMMIT`, committed with its writes.
    pub(super) recorded: bool,
    /// The attempt whose body committed by hand, rolled back, its
    /// connection kept until [`RetryLoop::take_ended`] (or the loop's end).
    pub(super) ended: Option<Attempt>,
    /// The call was answered `ConnectionReplaced` (see
    /// [`RetryLoop::connection_replaced`]).
    pub(super) replaced: bool,
    span: tracing::Span,
}

impl<'p> RetryLoop<'p> {
    /// A loop over `pool` with `policy`; `name` identifies the function in
    /// traces and metrics.
    pub fn new(pool: &'p Pool, policy: RetryPolicy, name: &'static str) -> Self {
        let span = tracing::info_span!(
            "idem.retry",
            function = name,
            max_attempts = policy.max_attempts,
            attempts = tracing::field::Empty,
            outcome = tracing::field::Empty,
        );
        RetryLoop {
            pool,
            policy: RetryPolicy {
                max_attempts: policy.max_attempts.max(1),
                ..policy
            },
            name,
            started: Instant::now(),
            attempt_started: Instant::now(),
            uncharged: Duration::ZERO,
            attempts: 0,
            lock_rows: false,
            conflict: ConflictSlot::default(),
            immediate_repeats: 0,
            unknown_commit: false,
            body_ended: None,
            recorded: false,
            ended: None,
            replaced: false,
            span,
        }
    }

    /// Attempts started so far.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// The policy this loop runs under.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// Start the next attempt as `begin` says: at once ([`RetryLoop::begin`])
    /// or with its transaction deferred to its first use.
    pub async fn begin_with(&mut self, begin: Begin) -> Result<Attempt, Error> {
        let unknown = std::mem::take(&mut self.unknown_commit);
        let mut attempt = self.start(begin).await?;
        attempt.set_follows_unknown_commit(unknown);
        Ok(attempt)
    }

    async fn start(&mut self, begin: Begin) -> Result<Attempt, Error> {
        match begin {
            Begin::Now => self.begin().await,
            Begin::OnFirstUse => {
                if attempt::inside_attempt() {
                    return Err(Error::Nested);
                }
                let Some(left) = self.time_left() else {
                    return Err(self.out_of_time());
                };
                self.attempts += 1;
                self.attempt_started = Instant::now();
                // What is left now, when the body starts, is the deferred
                // transaction's from when it begins: the body's call to
                // another system holds nothing of the database, and a
                // record cancelled for want of the time that call took
                // would turn a call that happened into an unknown outcome.
                Ok(Attempt::deferred(
                    self.pool.clone(),
                    self.policy.isolation,
                    left,
                    self.is_last_attempt(),
                    self.policy.commit_timeout,
                ))
            }
        }
    }

    /// The time charged to the deadline so far: all of it but the repeats
    /// that spend no attempt (a duplicate waiting for the first request, a
    /// claim committed before the body). Those are bounded by whoever asks
    /// for them (`IdempotencyConfig::wait`, at most a few immediate repeats),
    /// and a wait longer than the deadline must not cut the call short.
    fn charged(&self) -> Duration {
        self.started.elapsed().saturating_sub(self.uncharged)
    }

    /// The time left before the deadline, if any.
    fn time_left(&self) -> Option<Duration> {
        self.policy
            .deadline
            .checked_sub(self.charged())
            .filter(|left| !left.is_zero())
    }

    /// Whether the attempt begun last is the last one the budget of attempts allows.
    fn is_last_attempt(&self) -> bool {
        self.attempts >= self.policy.max_attempts
    }

    /// The deadline passed before an attempt could begin (only a repeat
    /// that spends no budget, or a long checkout, gets there).
    fn out_of_time(&self) -> Error {
        self.record_end("exhausted");
        Error::Exhausted {
            attempts: self.attempts,
            elapsed: self.started.elapsed(),
            last_cause: RetryCause::DeadlineExceeded,
        }
    }

    /// Start the next attempt: a fresh checkout and `BEGIN`. A connection
    /// that cannot be set up or that broke while idle in the pool ran nothing
    /// yet, so another one is tried within the budget.
    pub async fn begin(&mut self) -> Result<Attempt, Error> {
        if attempt::inside_attempt() {
            return Err(Error::Nested);
        }
        self.attempt_started = Instant::now();
        loop {
            let Some(left) = self.time_left() else {
                return Err(self.out_of_time());
            };
            self.attempts += 1;
            // The wait for a connection is bounded by the deadline too (and
            // by the pool's own wait timeout, whichever comes first), and
            // every statement of the attempt by what is left after it.
            let until = Instant::now() + left;
            let opened = open(
                self.pool,
                self.policy.isolation,
                until,
                self.is_last_attempt(),
                None,
            )
            .instrument(self.span.clone())
            .await;
            let cause = match opened {
                Ok(tx) => return Ok(Attempt::begun(tx, self.policy.commit_timeout)),
                // The pool could not set up a new connection (the server went
                // away, say): nothing ran, and another try may succeed. When
                // the budget runs out the pool's own error is the answer.
                Err(Opening::Checkout(PoolError::Backend(err))) => {
                    tracing::info!(parent: &self.span, error = %err, "could not set up a connection");
                    if let ControlFlow::Break(_) = self.back_off(RetryCause::ConnectionLost).await {
                        self.record_end("pool_error");
                        return Err(Error::Pool(PoolError::Backend(err)));
                    }
                    continue;
                }
                Err(Opening::Checkout(err)) => {
                    self.record_end("pool_error");
                    return Err(Error::Pool(err));
                }
                Err(Opening::Begin(err)) if err.transient() == Some(RetryCause::ConnectionLost) => {
                    RetryCause::ConnectionLost
                }
                Err(Opening::Begin(err)) => {
                    self.record_end("begin_failed");
                    return Err(Error::Begin(err));
                }
            };
            if let ControlFlow::Break(exhausted) = self.back_off(cause).await {
                self.record_end("exhausted");
                return Err(exhausted);
            }
        }
    }

    /// Run one attempt's body with the attempt's context (attempt number, row
    /// locking) visible to versioned reads, inside the attempt's span.
    pub fn scope<F: Future>(&self, body: F) -> impl Future<Output = F::Output> {
        self.conflict.take();
        let ctx = AttemptContext {
            conflict: self.conflict.clone(),
            reads: Default::default(),
            attempt: self.attempts,
            lock_rows: self.lock_rows,
            hot_row_memory: (self.policy.on_conflict == OnConflict::Lock)
                .then_some(self.policy.hot_row_memory),
            emits: Default::default(),
        };
        let span = tracing::debug_span!(parent: &self.span, "idem.attempt", attempt = self.attempts, lock_rows = self.lock_rows);
        ATTEMPT.scope(ctx, body).instrument(span)
    }

    /// End an attempt as its [`Step`] asks, and say whether to go again
    /// (`Continue`, after any backoff sleep) or return (`Break`). An `Err` is
    /// rolled back and replayed when it is [`Transient`] and the budget allows.
    pub async fn finish<T, E>(
        &mut self,
        mut attempt: Attempt,
        result: Result<Step<T>, E>,
    ) -> ControlFlow<Result<T, E>>
    where
        E: FromIdemError,
    {
        // A body that swapped its connection is answered so whatever it
        // returned: its error, a failure the wire saw (on the connection it
        // took away), or a decline to store, would have it run again, and
        // write again through the one it swapped in. (A commit checks it
        // before `COMMIT`, see `Tx::refuse`.)
        let rolls_back = matches!(result, Ok(Step::Again(_)) | Err(_));
        if rolls_back && !attempt.holds_its_session() {
            attempt.roll_back().instrument(self.span.clone()).await;
            self.replaced = true;
            return self.done(
                Err(E::from(Error::ConnectionReplaced)),
                "connection_replaced",
            );
        }
        let cause = match result {
            Ok(Step::Answer(value)) => {
                attempt.end_in_background();
                return self.done(Ok(value), "answered");
            }
            Ok(Step::Again(after)) => {
                // A decline to store, or a repeat idem asks for, after the
                // body ended the transaction itself: what it committed by
                // hand must not be written again, nor a decline stored.
                // Read once idem's `ROLLBACK`, queued behind all the body
                // sent, is answered.
                let rolled = attempt
                    .roll_back_reading()
                    .instrument(self.span.clone())
                    .await;
                if let Some(committed) = rolled.ended {
                    return self.ended_by_body(committed, attempt);
                }
                // Not a failure: the attempt is not charged to the budget. A
                // wait (`after` > 0) is bounded by whoever asks for it; an
                // immediate repeat is bounded here, so no condition that
                // keeps recurring can spin the loop: past a few, it is
                // charged like a lost race.
                self.immediate_repeats += usize::from(after.is_zero());
                if self.immediate_repeats <= MAX_IMMEDIATE_REPEATS {
                    drop(attempt);
                    self.attempts -= 1;
                    if !after.is_zero() {
                        tokio::time::sleep(after).await;
                    }
                    self.uncharged += self.attempt_started.elapsed();
                    return ControlFlow::Continue(());
                }
                RetryCause::SerializationFailure
            }
            Ok(Step::CommitAndContinue) => {
                match attempt.commit().instrument(self.span.clone()).await {
                    Ok(()) => {
                        self.attempts -= 1;
                        self.uncharged += self.attempt_started.elapsed();
                        return ControlFlow::Continue(());
                    }
                    // The next attempt reads what happened.
                    Err(CommitFailure::Unknown) => {
                        self.unknown_commit = true;
                        RetryCause::ConnectionLost
                    }
                    Err(failure) => {
                        return self.commit_failed(failure);
                    }
                }
            }
            Ok(Step::Commit(value)) => {
                let committed = attempt.commit().instrument(self.span.clone()).await;
                match self.committed(committed.map(|()| value)) {
                    ControlFlow::Break(outcome) => return self.keep_ended(attempt, outcome),
                    ControlFlow::Continue(cause) => cause,
                }
            }
            Ok(Step::Committed(committed)) => match self.committed(committed) {
                ControlFlow::Break(outcome) => return self.keep_ended(attempt, outcome),
                ControlFlow::Continue(cause) => cause,
            },
            Err(err) => {
                // What failed on the attempt decides, not the error the body
                // chose to return: a dead transaction is replayed whatever
                // the body made of its error.
                let observed = attempt.failure_cause().or_else(|| self.conflict.take());
                let rolled = attempt
                    .roll_back_reading()
                    .instrument(self.span.clone())
                    .await;
                if let Some(committed) = rolled.ended {
                    // What the body committed by hand must not be written again.
                    return self.ended_by_body(committed, attempt);
                }
                // A request the body had queued may have failed since.
                let observed = observed.or_else(|| attempt.failure_cause());
                let observed = observed.or(rolled.lost.then_some(RetryCause::ConnectionLost));
                match observed {
                    Some(cause) if self.policy.replays(cause) => cause,
                    _ => return self.done(Err(err), "failed"),
                }
            }
        };
        drop(attempt);
        match self.back_off(cause).await {
            ControlFlow::Continue(()) => ControlFlow::Continue(()),
            ControlFlow::Break(exhausted) => self.done(Err(E::from(exhausted)), "exhausted"),
        }
    }

    /// The end of a commit: the answer, or the cause to replay for.
    #[allow(clippy::type_complexity)]
    fn committed<T, E: FromIdemError>(
        &mut self,
        committed: Result<T, CommitFailure>,
    ) -> ControlFlow<ControlFlow<Result<T, E>>, RetryCause> {
        match committed {
            Ok(value) => ControlFlow::Break(self.done(Ok(value), "committed")),
            // The body swallowed a failure worth replaying for (a lock timeout
            // met by a row-returning statement, say): the server rolled the
            // transaction back, and the next attempt may commit.
            Err(CommitFailure::RolledBack(Some(cause))) if self.policy.replays(cause) => {
                ControlFlow::Continue(cause)
            }
            Err(CommitFailure::Failed(err))
                if err.transient().is_some_and(|c| self.policy.replays(c)) =>
            {
                ControlFlow::Continue(err.transient().unwrap_or(RetryCause::SerializationFailure))
            }
            Err(failure) => ControlFlow::Break(self.commit_failed(failure)),
        }
    }

    fn commit_failed<T, E: FromIdemError>(
        &mut self,
        failure: CommitFailure,
    ) -> ControlFlow<Result<T, E>> {
        let (err, label) = match failure {
            CommitFailure::Unknown => (
                Error::CommitUnknown {
                    attempts: self.attempts,
                    elapsed: self.started.elapsed(),
                },
                "commit_unknown",
            ),
            CommitFailure::RolledBack(_) => (Error::RolledBack, "rolled_back"),
            CommitFailure::EndedByBody {
                committed,
                recorded,
            } => {
                self.recorded = recorded;
                return self.answer_ended(committed);
            }
            CommitFailure::Failed(err) => (Error::Commit(err), "commit_failed"),
            CommitFailure::SavepointOpen => (Error::SavepointOpen, "savepoint_open"),
            CommitFailure::Replaced => {
                self.replaced = true;
                (Error::ConnectionReplaced, "connection_replaced")
            }
        };
        self.done(Err(E::from(err)), label)
    }

    pub(super) fn done<T, E>(
        &self,
        outcome: Result<T, E>,
        label: &'static str,
    ) -> ControlFlow<Result<T, E>> {
        self.record_end(label);
        ControlFlow::Break(outcome)
    }

    /// Trace and count how the call ended, whichever way it ended: through
    /// `finish`, or in `begin` (no connection, or no budget left).
    fn record_end(&self, label: &'static str) {
        self.span.record("attempts", self.attempts);
        self.span.record("outcome", label);
        tracing::debug!(parent: &self.span, attempts = self.attempts, elapsed_ms = self.started.elapsed().as_millis() as u64, outcome = label, "retry loop done");
        #[cfg(feature = "metrics")]
        {
            metrics::histogram!("idem_retry_attempts", "function" => self.name, "outcome" => label)
                .record(self.attempts as f64);
            let succeeded = label == "committed" || label == "answered";
            if succeeded && self.attempts > 1 {
                metrics::counter!("idem_retry_success_after_retry_total", "function" => self.name)
                    .increment(1);
            }
        }
    }

    /// Decide whether another attempt fits the budget, and sleep before it.
    async fn back_off(&mut self, cause: RetryCause) -> ControlFlow<Error> {
        if cause.is_write_conflict() && self.policy.on_conflict == OnConflict::Lock {
            self.lock_rows = true;
        }
        #[cfg(feature = "metrics")]
        metrics::counter!("idem_retry_failed_attempts_total", "function" => self.name, "cause" => cause.as_str()).increment(1);
        let elapsed = self.started.elapsed();
        let sleep = backoff::full_jitter(backoff::ceiling(
            self.policy.base_backoff,
            self.policy.max_backoff,
            self.attempts,
        ));
        if self.attempts >= self.policy.max_attempts
            || self.charged() + sleep >= self.policy.deadline
        {
            tracing::info!(parent: &self.span, function = self.name, attempts = self.attempts, elapsed_ms = elapsed.as_millis() as u64, cause = cause.as_str(), "retry budget exhausted");
            #[cfg(feature = "metrics")]
            metrics::counter!("idem_retry_exhausted_total", "function" => self.name, "cause" => cause.as_str()).increment(1);
            return ControlFlow::Break(Error::Exhausted {
                attempts: self.attempts,
                elapsed,
                last_cause: cause,
            });
        }
        tracing::info!(parent: &self.span, function = self.name, attempt = self.attempts, cause = cause.as_str(), backoff_us = sleep.as_micros() as u64, elapsed_ms = elapsed.as_millis() as u64, lock_rows = self.lock_rows, "attempt failed; replaying");
        tokio::time::sleep(sleep).await;
        ControlFlow::Continue(())
    }
}

// The loop's futures must be Send, or no multi-threaded server could await them.
#[allow(dead_code)]
fn assert_send(pool: &Pool) {
    fn send<F: Future + Send>(_: F) {}
    send(async move {
        let mut retry_loop = RetryLoop::new(pool, RetryPolicy::new(), "assert_send");
        let attempt = retry_loop.begin().await?;
        let result: Result<Step<()>, Error> = Ok(Step::Commit(()));
        match retry_loop.finish(attempt, result).await {
            ControlFlow::Break(outcome) => outcome,
            ControlFlow::Continue(()) => Ok(()),
        }
    });
}
