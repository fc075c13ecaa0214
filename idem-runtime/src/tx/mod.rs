//! The transaction driver: one database transaction on one pooled
//! connection, from `BEGIN` to the classified end of its `COMMIT`.
//!
//! Everything PostgreSQL- and diesel-async-specific about a transaction's
//! life lives here, and only here: how it begins (with its isolation level),
//! how it commits (and what an error, a silence or a lost connection during
//! `COMMIT` means), how it rolls back, and what happens to a connection whose
//! transaction was abandoned. The retry loop above it only decides whether to
//! go again; a second backend would plug in at this module.
//!
//! The plain path uses diesel-async's supported hooks: `begin_transaction_sql`,
//! `commit_transaction` and `rollback_transaction` keep diesel's own
//! transaction depth right (so a `conn.transaction(..)` inside a body becomes
//! a savepoint), and a per-transaction [`Instrumentation`] sees every
//! statement that failed. The pipelined path ([`pipeline`]: statements sent
//! with `BEGIN` and with `COMMIT`) keeps the same depth through the API
//! diesel opens to connection implementations, as diesel-async's own manager
//! does. PostgreSQL answers `COMMIT` in a transaction whose
//! statement failed with a silent `ROLLBACK`; the watch is how a body that
//! swallowed such an error is caught before `COMMIT` is sent.
//!
//! A transaction of the retry loop is bounded at the server: its `BEGIN`
//! carries `SET LOCAL statement_timeout` and `SET LOCAL lock_timeout`
//! ([`Timeouts`]) in the same simple query, so the bound costs no round trip,
//! and, being transaction-scoped, ends with the transaction: nothing is left
//! on the pooled connection (and it holds behind PgBouncer's transaction
//! pooling).

use std::borrow::Cow;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use diesel::connection::{Instrumentation, InstrumentationEvent};
use diesel::result::Error as DieselError;
use diesel_async::pooled_connection::deadpool::Object;
use diesel_async::{
    AnsiTransactionManager, AsyncConnection, AsyncPgConnection, TransactionManager,
};

use crate::pool::PooledConnection;
use crate::retry::{own_timeout, Isolation, RetryCause, Transient};

mod pipeline;
pub(crate) use pipeline::{Closing, Pipelined};

/// One open transaction. Dropping it while open (the caller's future was
/// cancelled) cancels the statement the server may still run for it and
/// closes the connection, so no connection goes back to the pool idle in a
/// transaction, and no row lock outlives the caller.
pub(crate) struct Tx {
    conn: Option<PooledConnection>,
    open: bool,
    watch: Arc<Mutex<WatchState>>,
}

/// How a `COMMIT` ended, when it did not commit for certain.
#[derive(Debug)]
#[doc(hidden)]
pub enum CommitFailure {
    /// The connection failed, or went silent, while `COMMIT` was in flight:
    /// the transaction may or may not have committed.
    Unknown,
    /// A statement of the transaction had failed and its error was ignored:
    /// the transaction was rolled back instead of being committed.
    RolledBack,
    /// `COMMIT` was answered with an error: nothing was committed.
    Failed(DieselError),
}

/// Why `BEGIN` failed; the connection is already discarded.
pub(crate) struct BeginFailure(pub(crate) DieselError);

/// The server's bounds on the statements of one transaction, in whole
/// milliseconds, never 0 (which PostgreSQL reads as "no timeout").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Timeouts {
    statement_ms: u32,
    lock_ms: u32,
}

impl Timeouts {
    /// The bounds of a transaction begun with `left` before the call's
    /// deadline: every statement is cancelled once it has run that long, so
    /// none outlives the deadline by more than the time between `BEGIN` and
    /// its own start. A lock wait gives up at half of it, leaving time to back
    /// off and replay, except on the `last` attempt the budget allows, which
    /// may wait to the end (its statement timeout then comes first).
    pub(crate) fn within(left: Duration, last: bool) -> Timeouts {
        let statement_ms = left.as_millis().clamp(1, i32::MAX as u128) as u32;
        let lock_ms = if last {
            statement_ms
        } else {
            (statement_ms / 2).max(1)
        };
        Timeouts {
            statement_ms,
            lock_ms,
        }
    }

    fn statement(self) -> Duration {
        Duration::from_millis(self.statement_ms.into())
    }

    fn lock(self) -> Duration {
        Duration::from_millis(self.lock_ms.into())
    }

    /// `BEGIN` and both settings as one simple query: one round trip. Only
    /// integers we formatted ourselves go into it.
    fn begin_sql(self, isolation: Isolation) -> String {
        format!(
            "{}; SET LOCAL statement_timeout = '{}ms'; SET LOCAL lock_timeout = '{}ms'",
            isolation.begin_sql(),
            self.statement_ms,
            self.lock_ms
        )
    }
}

impl Tx {
    /// `BEGIN` with `isolation` on a connection fresh from the pool, with
    /// the server's default timeouts.
    pub(crate) async fn begin(
        conn: PooledConnection,
        isolation: Isolation,
    ) -> Result<Tx, BeginFailure> {
        Tx::start(conn, isolation, None).await
    }

    /// `BEGIN` with `isolation`, its statements bounded by `timeouts`.
    pub(crate) async fn begin_bounded(
        conn: PooledConnection,
        isolation: Isolation,
        timeouts: Timeouts,
    ) -> Result<Tx, BeginFailure> {
        Tx::start(conn, isolation, Some(timeouts)).await
    }

    async fn start(
        conn: PooledConnection,
        isolation: Isolation,
        timeouts: Option<Timeouts>,
    ) -> Result<Tx, BeginFailure> {
        let mut tx = Tx::watched(conn, timeouts);
        let sql = match timeouts {
            Some(timeouts) => Cow::Owned(timeouts.begin_sql(isolation)),
            None => Cow::Borrowed(isolation.begin_sql()),
        };
        match AnsiTransactionManager::begin_transaction_sql(tx.conn(), &sql).await {
            Ok(()) => {
                tx.open = true;
                Ok(tx)
            }
            Err(err) => {
                tx.discard();
                Err(BeginFailure(err))
            }
        }
    }

    /// A transaction not begun yet on `conn`, whose statements the watch
    /// sees from now on.
    fn watched(mut conn: PooledConnection, timeouts: Option<Timeouts>) -> Tx {
        let watch = Arc::new(Mutex::new(WatchState {
            timeouts,
            ..WatchState::default()
        }));
        AsyncConnection::set_instrumentation(
            &mut *conn,
            Watch {
                state: Arc::clone(&watch),
                inner: diesel::connection::get_default_instrumentation(),
            },
        );
        Tx {
            conn: Some(conn),
            open: false,
            watch,
        }
    }

    /// How long the server lets each statement of this transaction run.
    fn statement_bound(&self) -> Option<Duration> {
        self.watch
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .timeouts
            .map(Timeouts::statement)
    }

    /// The connection the transaction runs on.
    ///
    /// # Panics
    /// After the connection was discarded, which only the ending methods do,
    /// and they consume or close the transaction.
    pub(crate) fn conn(&mut self) -> &mut AsyncPgConnection {
        self.conn
            .as_mut()
            .expect("a transaction's connection is only discarded when it ends")
    }

    /// Commit, unless a statement failed unnoticed; `timeout` bounds the wait
    /// for the server's answer.
    pub(crate) async fn commit(&mut self, timeout: Duration) -> Result<(), CommitFailure> {
        if self.watch_failed() {
            self.roll_back(timeout).await;
            return Err(CommitFailure::RolledBack);
        }
        let committed = tokio::time::timeout(
            timeout,
            AnsiTransactionManager::commit_transaction(self.conn()),
        )
        .await;
        match committed {
            Ok(Ok(())) => {
                self.open = false;
                Ok(())
            }
            Err(_elapsed) => {
                tracing::warn!("COMMIT got no answer in {timeout:?}; outcome unknown");
                self.cancel_and_discard();
                Err(CommitFailure::Unknown)
            }
            Ok(Err(err)) if err.transient() == Some(RetryCause::ConnectionLost) => {
                tracing::warn!(error = %err, "connection failed during COMMIT; outcome unknown");
                self.discard();
                Err(CommitFailure::Unknown)
            }
            Ok(Err(err)) => {
                // A COMMIT answered with an error ends the transaction on the
                // server, and diesel-async has counted it as ended.
                self.open = false;
                Err(CommitFailure::Failed(err))
            }
        }
    }

    /// Roll back, or discard the connection when that fails or goes
    /// unanswered: either way the transaction is gone. A failing rollback is
    /// logged, never returned, so it cannot hide the error that caused it.
    ///
    /// Returns true when the connection turned out to be lost: the
    /// transaction died with it. (diesel-async may report a lost connection
    /// to the statement that met it without finishing that statement's
    /// instrumentation event, so the watch alone cannot always tell.)
    pub(crate) async fn roll_back(&mut self, timeout: Duration) -> bool {
        if !self.open {
            return false;
        }
        let rolled_back = tokio::time::timeout(
            timeout,
            AnsiTransactionManager::rollback_transaction(self.conn()),
        )
        .await;
        match rolled_back {
            Ok(Ok(())) => {
                self.open = false;
                false
            }
            Ok(Err(err)) => {
                tracing::warn!(error = %err, "ROLLBACK failed; discarding the connection");
                self.discard();
                err.transient() == Some(RetryCause::ConnectionLost)
            }
            Err(_elapsed) => {
                tracing::warn!("ROLLBACK got no answer; discarding the connection");
                self.cancel_and_discard();
                true
            }
        }
    }

    /// End a transaction that wrote nothing without making the caller wait:
    /// the connection goes back to the pool once `ROLLBACK` is answered, or is
    /// closed when that fails. Nothing was written, so nothing can be lost.
    pub(crate) fn end_in_background(mut self, timeout: Duration) {
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    self.roll_back(timeout).await;
                });
            }
            Err(_) => self.discard(),
        }
    }

    /// Why a statement of this transaction failed, when no savepoint undid
    /// it and the failure is worth replaying the transaction for.
    pub(crate) fn failure_cause(&self) -> Option<RetryCause> {
        self.watch.lock().unwrap_or_else(|p| p.into_inner()).cause
    }

    /// A statement of this transaction failed and no savepoint undid it.
    fn watch_failed(&self) -> bool {
        self.watch
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .failed_at
            .is_some()
    }

    /// Close the connection instead of returning it to the pool.
    pub(crate) fn discard(&mut self) {
        if let Some(conn) = self.conn.take() {
            drop(Object::take(conn));
        }
        self.open = false;
    }

    /// Cancel the statement the server may still be running for this
    /// transaction, then close the connection.
    ///
    /// Closing the socket alone does not end a running statement: the backend
    /// notices the closed connection only when it next writes to it, and keeps
    /// its transaction and row locks until then (a `pg_sleep(60)` holds them a
    /// minute). A cancel request, sent on a connection of its own, stops it at
    /// once; the backend then reads the closed socket, rolls back and exits.
    /// Best effort: without a Tokio runtime, or when the server refuses a
    /// cancel request without TLS, the statement runs to its end.
    pub(crate) fn cancel_and_discard(&mut self) {
        if let Some(conn) = self.conn.as_ref() {
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                let token = conn.cancel_token();
                runtime.spawn(async move {
                    if let Err(err) = token.cancel_query(tokio_postgres::NoTls).await {
                        tracing::debug!(error = %err, "could not cancel the abandoned transaction's statement");
                    }
                });
            }
        }
        // Closed at once, not after the cancel: PgBouncer 1.18 (Debian 12)
        // was seen to exit when a cancel it was forwarding met its client's
        // disconnect, taking every client down. Behind it, the cancel of a
        // closed client is dropped; `client_connection_check_interval` on
        // the server is then what ends the statement (see `Pooler`).
        self.discard();
    }
}

impl Drop for Tx {
    fn drop(&mut self) {
        if self.open {
            tracing::warn!("transaction dropped while open; closing its connection");
            self.cancel_and_discard();
        }
    }
}

/// What the watch knows of the transaction: diesel's depth as its events
/// tell it, the shallowest depth at which a statement failed, and whether
/// that failure is worth replaying the transaction for; and, to tell the
/// expiry of its own timeouts from the body's, since when a statement runs.
#[derive(Debug, Default)]
struct WatchState {
    depth: u32,
    failed_at: Option<u32>,
    cause: Option<RetryCause>,
    timeouts: Option<Timeouts>,
    /// Statements started and not finished (more than one when a body
    /// pipelines them), and when the oldest of them started.
    running: u32,
    since: Option<Instant>,
}

/// The instrumentation a transaction's connection carries while it is open;
/// it forwards every event to the application's default instrumentation.
struct Watch {
    state: Arc<Mutex<WatchState>>,
    inner: Option<Box<dyn Instrumentation>>,
}

impl Instrumentation for Watch {
    fn on_connection_event(&mut self, event: InstrumentationEvent<'_>) {
        {
            let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
            match &event {
                InstrumentationEvent::BeginTransaction { depth, .. } => state.depth = depth.get(),
                InstrumentationEvent::CommitTransaction { depth, .. } => {
                    state.depth = depth.get() - 1;
                }
                InstrumentationEvent::RollbackTransaction { depth, .. } => {
                    // Rolling back to a savepoint undoes failures inside it.
                    if state.failed_at.is_some_and(|at| at >= depth.get()) {
                        state.failed_at = None;
                        state.cause = None;
                    }
                    state.depth = depth.get() - 1;
                }
                InstrumentationEvent::StartQuery { .. } => {
                    if state.running == 0 {
                        state.since = Some(Instant::now());
                    }
                    state.running += 1;
                }
                InstrumentationEvent::FinishQuery { error, .. } => {
                    // From the oldest running statement's start: a pipelined
                    // statement may seem to have run longer than it did,
                    // which errs towards replaying within the budget.
                    let ran = state.since.map_or(Duration::ZERO, |since| since.elapsed());
                    state.running = state.running.saturating_sub(1);
                    if state.running == 0 {
                        state.since = None;
                    }
                    let at = state.depth;
                    if let Some(err @ DieselError::DatabaseError(..)) = error {
                        if at > 0 && state.failed_at.is_none_or(|f| at < f) {
                            state.failed_at = Some(at);
                            state.cause = state
                                .timeouts
                                .and_then(|t| own_timeout(err, ran, t.statement(), t.lock()))
                                .or_else(|| err.transient());
                        }
                    }
                }
                _ => {}
            }
        }
        if let Some(inner) = self.inner.as_mut() {
            inner.on_connection_event(event);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_are_whole_milliseconds_and_never_zero() {
        let t = Timeouts::within(Duration::from_millis(300), false);
        assert_eq!((t.statement_ms, t.lock_ms), (300, 150));
        assert_eq!(
            t.begin_sql(Isolation::Serializable),
            "BEGIN ISOLATION LEVEL SERIALIZABLE; SET LOCAL statement_timeout = '300ms'; \
             SET LOCAL lock_timeout = '150ms'"
        );
        // The last attempt may wait for a lock as long as it may run.
        let t = Timeouts::within(Duration::from_millis(300), true);
        assert_eq!((t.statement_ms, t.lock_ms), (300, 300));
        // 0 would mean no timeout at all.
        for left in [
            Duration::ZERO,
            Duration::from_micros(999),
            Duration::from_millis(1),
        ] {
            let t = Timeouts::within(left, false);
            assert_eq!((t.statement_ms, t.lock_ms), (1, 1), "{left:?}");
        }
        // Beyond what the server accepts (an int of milliseconds): its largest.
        let t = Timeouts::within(Duration::MAX, false);
        assert_eq!(t.statement_ms, i32::MAX as u32);
    }
}
