//! The loop itself. `#[retryable]` expands to the same four calls the closure
//! form [`retry`] makes: [`RetryLoop::begin`], [`RetryLoop::scope`] around the
//! body, [`RetryLoop::finish`], and again while `finish` says so.

use std::future::Future;
use std::ops::ControlFlow;
use std::pin::Pin;
use std::time::Instant;

use diesel::connection::{TransactionDepthChange, TransactionManagerStatus};
use diesel_async::pooled_connection::deadpool::Object;
use diesel_async::{
    AnsiTransactionManager, AsyncPgConnection, SimpleAsyncConnection, TransactionManager,
};
use scoped_futures::ScopedBoxFuture;
use tracing::Instrument;

use super::backoff;
use super::{is_in_failed_transaction, OnConflict, RetryCause, RetryError, RetryPolicy, Transient};
use crate::attempt::{self, AttemptContext, ATTEMPT};
use crate::pool::{Pool, PooledConnection};

/// One round trip that commits only a healthy transaction: in a transaction
/// that saw a failed statement, `SELECT 1` fails with 25P02 and the server
/// skips the `COMMIT`, instead of answering it with a silent `ROLLBACK`.
const COMMIT_IF_HEALTHY: &str = "SELECT 1; COMMIT";

/// Run `body` as a retried transaction: the closure form of `#[retryable]`.
///
/// The closure is called once per attempt with that attempt's connection,
/// inside an open transaction; it must return a boxed future (diesel-async's
/// `scope_boxed()`), as `AsyncConnection::transaction` does.
///
/// ```no_run
/// use diesel_async::RunQueryDsl;
/// use idem_runtime::retry::{retry, RetryError, RetryPolicy};
/// use scoped_futures::ScopedFutureExt;
///
/// # async fn demo(pool: &idem_runtime::pool::Pool) -> Result<(), diesel::result::Error> {
/// #[derive(Debug)]
/// enum AppError { Db(diesel::result::Error), Retry(RetryError) }
/// impl From<RetryError> for AppError { fn from(e: RetryError) -> Self { AppError::Retry(e) } }
/// impl idem_runtime::retry::Transient for AppError {
///     fn transient(&self) -> Option<idem_runtime::retry::RetryCause> {
///         match self { AppError::Db(e) => e.transient(), AppError::Retry(_) => None }
///     }
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
    E: Transient + From<RetryError>,
{
    let mut retry_loop = RetryLoop::new(pool, policy, name);
    loop {
        let mut attempt = retry_loop.begin().await.map_err(E::from)?;
        let result = retry_loop.scope(body(attempt.conn())).await;
        if let ControlFlow::Break(outcome) = retry_loop.finish(attempt, result).await {
            return outcome;
        }
    }
}

/// The state of one call's retry loop: budget spent, and whether rows are
/// being locked after a conflict.
pub struct RetryLoop<'p> {
    pool: &'p Pool,
    policy: RetryPolicy,
    name: &'static str,
    started: Instant,
    attempts: u32,
    lock_rows: bool,
    span: tracing::Span,
}

/// One attempt's connection, with its transaction open.
///
/// Dropping an `Attempt` whose transaction is still open (the caller's future
/// was cancelled mid-attempt) detaches the connection from the pool and closes
/// it, so the server rolls the transaction back at once and no connection goes
/// back to the pool idle in a transaction.
pub struct Attempt {
    conn: Option<PooledConnection>,
    open: bool,
    /// `BEGIN` not sent yet: the first statement of the attempt sends it in
    /// the same round trip (see [`RetryLoop::begin_deferred`]).
    deferred_begin: Option<&'static str>,
    /// A statement sent in the same round trip as `COMMIT`.
    pre_commit: Option<PreCommitStep>,
    /// The attempt only read (an idempotent replay): its transaction is
    /// ended in the background and the caller answered at once.
    read_only: bool,
}

/// Work that must commit with the attempt.
pub(crate) enum PreCommitStep {
    /// SQL text sent in the same simple query as `COMMIT`, so it costs no
    /// round trip and cannot be overtaken by it. It must fail in a
    /// transaction that saw a failed statement (any statement does: 25P02).
    Sql(String),
    /// A statement awaited before `COMMIT` (one more round trip).
    Statement(Box<dyn PreCommit>),
}

/// A statement that must commit with the attempt, pipelined with `COMMIT`.
pub(crate) trait PreCommit: Send {
    fn run<'c>(
        self: Box<Self>,
        conn: &'c AsyncPgConnection,
    ) -> Pin<Box<dyn Future<Output = diesel::QueryResult<()>> + Send + 'c>>;
}

impl Attempt {
    /// The connection the attempt's body runs on.
    ///
    /// # Panics
    /// After the loop discarded the connection, which only happens inside
    /// [`RetryLoop::finish`], which consumes the attempt.
    pub fn conn(&mut self) -> &mut AsyncPgConnection {
        self.conn
            .as_mut()
            .expect("an attempt's connection is only discarded by finish()")
    }

    /// The `BEGIN` to send with the attempt's first statement, once.
    pub(crate) fn take_deferred_begin(&mut self) -> Option<&'static str> {
        self.deferred_begin.take()
    }

    /// Send `statement` in the same round trip as the attempt's `COMMIT`.
    pub(crate) fn before_commit(&mut self, step: PreCommitStep) {
        self.pre_commit = Some(step);
    }

    /// Mark the attempt as one that wrote nothing and answers from what it
    /// read: its transaction ends in the background after the answer.
    pub(crate) fn mark_read_only(&mut self) {
        self.read_only = true;
    }

    /// Whether [`Attempt::mark_read_only`] was called.
    #[doc(hidden)]
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// Close the connection instead of returning it to the pool.
    fn discard(&mut self) {
        if let Some(conn) = self.conn.take() {
            drop(Object::take(conn));
        }
        self.open = false;
    }

    /// Cancel the statement the server may still be running for this attempt,
    /// then close the connection.
    ///
    /// Closing the socket alone does not end a running statement: the backend
    /// notices the closed connection only when it next writes to it, and keeps
    /// its transaction and row locks until then (a `pg_sleep(60)` holds them a
    /// minute). A cancel request, sent on a connection of its own, stops it at
    /// once; the backend then reads the closed socket, rolls back and exits.
    /// The connection is discarded, so the request cannot hit a later
    /// statement. Best effort: without a Tokio runtime, or when the server
    /// refuses a cancel request without TLS, the statement runs to its end.
    fn cancel_and_discard(&mut self) {
        if let Some(conn) = self.conn.as_ref() {
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                let token = conn.cancel_token();
                runtime.spawn(async move {
                    if let Err(err) = token.cancel_query(tokio_postgres::NoTls).await {
                        tracing::debug!(error = %err, "could not cancel the abandoned attempt's statement");
                    }
                });
            }
        }
        self.discard();
    }
}

impl Drop for Attempt {
    fn drop(&mut self) {
        if self.open {
            tracing::warn!("attempt dropped with its transaction open; closing its connection");
            self.cancel_and_discard();
        }
    }
}

enum CommitFailure {
    Unknown,
    RolledBack,
    Failed(diesel::result::Error),
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
            attempts: 0,
            lock_rows: false,
            span,
        }
    }

    /// Attempts started so far.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Start the next attempt: a fresh checkout and `BEGIN`.
    pub async fn begin(&mut self) -> Result<Attempt, RetryError> {
        if attempt::inside_attempt() {
            return Err(RetryError::Nested);
        }
        loop {
            self.attempts += 1;
            let conn = self.check_out().await?;
            let mut attempt = Attempt {
                conn: Some(conn),
                open: false,
                deferred_begin: None,
                pre_commit: None,
                read_only: false,
            };
            let begin = AnsiTransactionManager::begin_transaction_sql(
                attempt.conn(),
                self.policy.isolation.begin_sql(),
            )
            .instrument(self.span.clone())
            .await;
            match begin {
                Ok(()) => {
                    attempt.open = true;
                    return Ok(attempt);
                }
                Err(err) => {
                    attempt.discard();
                    // A connection that broke while idle in the pool: nothing
                    // ran yet, so another connection is always safe to try.
                    if err.transient() == Some(RetryCause::ConnectionLost) {
                        if let ControlFlow::Break(exhausted) =
                            self.back_off(RetryCause::ConnectionLost).await
                        {
                            self.record_end("exhausted");
                            return Err(exhausted);
                        }
                        continue;
                    }
                    return Err(RetryError::Begin(err));
                }
            }
        }
    }

    /// Start the next attempt without sending `BEGIN`: the caller must send
    /// [`Attempt::take_deferred_begin`] pipelined with its first statement
    /// (the idempotency claim does), which saves a round trip per request.
    #[doc(hidden)]
    pub async fn begin_deferred(&mut self) -> Result<Attempt, RetryError> {
        if attempt::inside_attempt() {
            return Err(RetryError::Nested);
        }
        self.attempts += 1;
        let conn = self.check_out().await?;
        let mut attempt = Attempt {
            conn: Some(conn),
            open: true,
            deferred_begin: Some(self.policy.isolation.begin_sql()),
            pre_commit: None,
            read_only: false,
        };
        // diesel must believe the transaction is open, so that a nested
        // `conn.transaction()` in the body becomes a savepoint.
        let counted = match AnsiTransactionManager::transaction_manager_status_mut(attempt.conn()) {
            TransactionManagerStatus::Valid(status) if status.transaction_depth().is_none() => {
                status
                    .change_transaction_depth(TransactionDepthChange::IncreaseDepth)
                    .is_ok()
            }
            _ => false,
        };
        if !counted {
            attempt.discard();
            return Err(RetryError::Begin(
                diesel::result::Error::AlreadyInTransaction,
            ));
        }
        Ok(attempt)
    }

    /// Run one attempt's body with the attempt's context (attempt number, row
    /// locking) visible to versioned reads, inside the attempt's span.
    pub fn scope<F: Future>(&self, body: F) -> impl Future<Output = F::Output> {
        let ctx = AttemptContext {
            attempt: self.attempts,
            lock_rows: self.lock_rows,
            hot_row_memory: (self.policy.on_conflict == OnConflict::Lock)
                .then_some(self.policy.hot_row_memory),
        };
        let span = tracing::debug_span!(parent: &self.span, "idem.attempt", attempt = self.attempts, lock_rows = self.lock_rows);
        ATTEMPT.scope(ctx, body).instrument(span)
    }

    /// End an attempt: commit on `Ok`, roll back on `Err`, and say whether to
    /// go again (`Continue`, after the backoff sleep) or return (`Break`).
    pub async fn finish<T, E>(
        &mut self,
        mut attempt: Attempt,
        result: Result<T, E>,
    ) -> ControlFlow<Result<T, E>>
    where
        E: Transient + From<RetryError>,
    {
        let cause = match result {
            Ok(value) if attempt.read_only => {
                end_in_background(attempt);
                return self.done(Ok(value), "read_only");
            }
            Ok(value) => match self.commit(&mut attempt).await {
                Ok(()) => return self.done(Ok(value), "committed"),
                Err(CommitFailure::Unknown) => {
                    let err = RetryError::CommitUnknown {
                        attempts: self.attempts,
                        elapsed: self.started.elapsed(),
                    };
                    return self.done(Err(E::from(err)), "commit_unknown");
                }
                Err(CommitFailure::RolledBack) => {
                    return self.done(Err(E::from(RetryError::RolledBack)), "rolled_back")
                }
                Err(CommitFailure::Failed(err)) => match err.transient() {
                    Some(cause) if self.policy.replays(cause) => cause,
                    _ => return self.done(Err(E::from(RetryError::Commit(err))), "commit_failed"),
                },
            },
            Err(err) => {
                self.roll_back(&mut attempt).await;
                match err.transient() {
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

    fn done<T, E>(&self, outcome: Result<T, E>, label: &'static str) -> ControlFlow<Result<T, E>> {
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
            let succeeded = label == "committed" || label == "read_only";
            if succeeded && self.attempts > 1 {
                metrics::counter!("idem_retry_success_after_retry_total", "function" => self.name)
                    .increment(1);
            }
        }
    }

    /// A checkout that failed ends the call.
    async fn check_out(&mut self) -> Result<PooledConnection, RetryError> {
        match self.pool.get().instrument(self.span.clone()).await {
            Ok(conn) => Ok(conn),
            Err(err) => {
                self.record_end("pool_error");
                Err(RetryError::Pool(err))
            }
        }
    }

    /// Decide whether another attempt fits the budget, and sleep before it.
    async fn back_off(&mut self, cause: RetryCause) -> ControlFlow<RetryError> {
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
        if self.attempts >= self.policy.max_attempts || elapsed + sleep >= self.policy.deadline {
            tracing::info!(parent: &self.span, function = self.name, attempts = self.attempts, elapsed_ms = elapsed.as_millis() as u64, cause = cause.as_str(), "retry budget exhausted");
            #[cfg(feature = "metrics")]
            metrics::counter!("idem_retry_exhausted_total", "function" => self.name, "cause" => cause.as_str()).increment(1);
            return ControlFlow::Break(RetryError::Exhausted {
                attempts: self.attempts,
                elapsed,
                last_cause: cause,
            });
        }
        tracing::info!(parent: &self.span, function = self.name, attempt = self.attempts, cause = cause.as_str(), backoff_us = sleep.as_micros() as u64, elapsed_ms = elapsed.as_millis() as u64, lock_rows = self.lock_rows, "attempt failed; replaying");
        tokio::time::sleep(sleep).await;
        ControlFlow::Continue(())
    }

    async fn commit(&self, attempt: &mut Attempt) -> Result<(), CommitFailure> {
        let pre_commit = attempt.pre_commit.take();
        let conn: &mut AsyncPgConnection = attempt.conn();
        let both = async move {
            match pre_commit {
                None => conn.batch_execute(COMMIT_IF_HEALTHY).await,
                Some(PreCommitStep::Sql(sql)) => {
                    conn.batch_execute(&format!("{sql}; COMMIT")).await
                }
                // Awaited first: a statement still to be prepared would
                // otherwise be overtaken by the COMMIT.
                Some(PreCommitStep::Statement(statement)) => {
                    statement.run(&*conn).await?;
                    conn.batch_execute(COMMIT_IF_HEALTHY).await
                }
            }
        };
        let sent = tokio::time::timeout(self.policy.commit_timeout, both)
            .instrument(self.span.clone())
            .await;
        match sent {
            Ok(Ok(())) => {
                attempt.open = false;
                if !forget_transaction(attempt.conn()) {
                    attempt.discard();
                }
                Ok(())
            }
            Err(_elapsed) => {
                tracing::warn!(parent: &self.span, "COMMIT got no answer in {:?}; outcome unknown", self.policy.commit_timeout);
                attempt.discard();
                Err(CommitFailure::Unknown)
            }
            Ok(Err(err)) if err.transient() == Some(RetryCause::ConnectionLost) => {
                tracing::warn!(parent: &self.span, error = %err, "connection failed during COMMIT; outcome unknown");
                attempt.discard();
                Err(CommitFailure::Unknown)
            }
            Ok(Err(err)) => {
                let swallowed = is_in_failed_transaction(&err);
                self.roll_back(attempt).await;
                Err(if swallowed {
                    CommitFailure::RolledBack
                } else {
                    CommitFailure::Failed(err)
                })
            }
        }
    }

    /// Roll back, or discard the connection when that fails: either way the
    /// transaction is gone. A failing rollback is logged, never returned, so it
    /// cannot hide the error that caused it.
    async fn roll_back(&self, attempt: &mut Attempt) {
        if attempt.conn.is_none() {
            return;
        }
        let rolled_back = tokio::time::timeout(
            self.policy.commit_timeout,
            AnsiTransactionManager::rollback_transaction(attempt.conn()),
        )
        .instrument(self.span.clone())
        .await;
        match rolled_back {
            Ok(Ok(())) if in_transaction(attempt.conn()) == Some(false) => attempt.open = false,
            Ok(Ok(())) => attempt.discard(),
            Ok(Err(err)) => {
                tracing::warn!(parent: &self.span, error = %err, "ROLLBACK failed; discarding the connection");
                attempt.discard();
            }
            Err(_elapsed) => {
                tracing::warn!(parent: &self.span, "ROLLBACK got no answer; discarding the connection");
                attempt.discard();
            }
        }
    }
}

/// End a read-only attempt's transaction without making the caller wait: the
/// connection goes back to the pool once `ROLLBACK` is answered, or is closed
/// when that fails. Nothing was written, so nothing can be lost.
fn end_in_background(mut attempt: Attempt) {
    let Some(mut conn) = attempt.conn.take() else {
        return;
    };
    attempt.open = false;
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            runtime.spawn(async move {
                let rolled_back = AnsiTransactionManager::rollback_transaction(&mut *conn).await;
                if rolled_back.is_err() || in_transaction(&mut conn) != Some(false) {
                    drop(Object::take(conn));
                }
            });
        }
        Err(_) => drop(Object::take(conn)),
    }
}

/// Tell diesel's transaction manager that the transaction it began is over,
/// since the `COMMIT` was sent around it. False when its state does not fit.
fn forget_transaction(conn: &mut AsyncPgConnection) -> bool {
    match AnsiTransactionManager::transaction_manager_status_mut(conn) {
        TransactionManagerStatus::Valid(status) => {
            status
                .change_transaction_depth(TransactionDepthChange::DecreaseDepth)
                .is_ok()
                && status.transaction_depth().is_none()
        }
        TransactionManagerStatus::InError => false,
    }
}

fn in_transaction(conn: &mut AsyncPgConnection) -> Option<bool> {
    match AnsiTransactionManager::transaction_manager_status_mut(conn) {
        TransactionManagerStatus::Valid(status) => Some(status.transaction_depth().is_some()),
        TransactionManagerStatus::InError => None,
    }
}

// The loop's futures must be Send, or no multi-threaded server could await them.
#[allow(dead_code)]
fn assert_send(pool: &Pool) {
    fn send<F: Future + Send>(_: F) {}
    send(async move {
        let mut retry_loop = RetryLoop::new(pool, RetryPolicy::new(), "assert_send");
        let attempt = retry_loop.begin().await?;
        let result: Result<(), RetryError> = Ok(());
        match retry_loop.finish(attempt, result).await {
            ControlFlow::Break(outcome) => outcome,
            ControlFlow::Continue(()) => Ok(()),
        }
    });
}
