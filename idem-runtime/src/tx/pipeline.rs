//! A transaction's first statements sent with its `BEGIN`, and its last
//! statement with its `COMMIT`: one round trip each, where sending them one
//! after the other costs two. A local-mode idempotent call opens with the
//! advisory lock and the read of its record and closes with the record's one
//! write, so a new request makes as many round trips as the bare handler.
//!
//! # Order
//!
//! PostgreSQL runs a connection's messages in the order they arrive, so what
//! matters is the order they are sent in:
//!
//! * `BEGIN` goes out as a simple query, sent when its future is first
//!   polled; the statements behind it are polled after it, so none reaches
//!   the server first.
//! * Every other statement goes through diesel-async's statement cache. A
//!   statement already prepared is sent on its first poll; one that is not is
//!   prepared while the cache (a FIFO mutex) is held, and sent before the
//!   next statement gets the cache. `COMMIT` is sent the same way (as a
//!   prepared statement, not a simple query), so it reaches the server after
//!   the last statement whether either was prepared yet, and with the cache
//!   off (behind a transaction pooler) too.
//! * The futures are joined in a fixed order (`futures_util`'s `join`, not
//!   `tokio::join!`, which rotates the branch it polls first): a statement
//!   that Tokio's cooperative budget holds back is still polled, and so
//!   queued on the cache, before the one behind it.
//!
//! # Failure
//!
//! When the server refuses the last statement, the transaction is aborted
//! and the `COMMIT` behind it ends it as a rollback. A statement the commit
//! depends on (the idempotency record) must therefore raise an error where it
//! would write nothing. A statement that fails before it reaches the server
//! (its binds cannot be encoded) fails on its first poll, and `COMMIT` is then
//! not sent at all. Everything else ends as [`Tx::commit`] does.
//!
//! diesel-async's transaction manager learns of this `BEGIN` and `COMMIT`
//! exactly as its own `begin_transaction_sql` and `commit_transaction` tell
//! it, through the depth API diesel opens to connection implementations
//! (which diesel-async turns on for itself), so a `conn.transaction(..)` in a
//! body still becomes a savepoint.

use std::future::poll_fn;
use std::num::NonZeroU32;
use std::task::Poll;
use std::time::Duration;

use diesel::connection::{InstrumentationEvent, TransactionDepthChange};
use diesel::pg::Pg;
use diesel::query_builder::{AstPass, QueryFragment, QueryId};
use diesel::result::Error as DieselError;
use diesel::QueryResult;
use diesel_async::{
    AnsiTransactionManager, AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection,
    TransactionManager,
};
use futures_util::future::{join, BoxFuture};

use super::{BeginFailure, CommitFailure, Timeouts, Tx};
use crate::pool::PooledConnection;
use crate::retry::{Isolation, RetryCause, Transient};

/// Statements sent behind `BEGIN` or ahead of `COMMIT`, through a shared
/// reference to the connection (which is how diesel-async pipelines).
pub(crate) trait Pipelined {
    type Output: Send;
    /// The statements, sent when the future is first polled.
    fn send<'c>(&'c self, conn: &'c AsyncPgConnection) -> BoxFuture<'c, QueryResult<Self::Output>>;
}

/// How a transaction whose last statement went out with its `COMMIT` ended,
/// when it did not commit.
#[derive(Debug)]
pub(crate) enum Closing {
    /// The last statement failed: nothing was committed. The transaction
    /// may still be open (aborted), for its owner to roll back once it has
    /// read the failure's cause.
    Failed(DieselError),
    /// The statement was answered, the `COMMIT` was not committed for
    /// certain (as [`Tx::commit`]); `Unknown` also when the connection
    /// failed, or went silent, before the statement was answered.
    Commit(CommitFailure),
}

/// `COMMIT` as a prepared statement, so that it queues behind the statement
/// before it (see the module's docs).
#[derive(Debug, Clone, Copy)]
struct Commit;

impl QueryFragment<Pg> for Commit {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("COMMIT");
        Ok(())
    }
}

impl QueryId for Commit {
    type QueryId = Commit;
    const HAS_STATIC_QUERY_ID: bool = true;
}

fn lost(err: &DieselError) -> bool {
    err.transient() == Some(RetryCause::ConnectionLost)
}

fn change_depth(conn: &mut AsyncPgConnection, change: TransactionDepthChange) -> QueryResult<()> {
    <AnsiTransactionManager as TransactionManager<AsyncPgConnection>>::transaction_manager_status_mut(conn)
        .transaction_state()?
        .change_transaction_depth(change)
}

impl Tx {
    /// `BEGIN` with `isolation`, its statements bounded by `timeouts`, and
    /// `first` sent behind it in the same round trip. The transaction is
    /// open when this returns `Ok`, whatever `first` answered (a failure of
    /// `first` is on the watch, as any statement's).
    pub(crate) async fn begin_with<P: Pipelined>(
        conn: PooledConnection,
        isolation: Isolation,
        timeouts: Timeouts,
        first: &P,
    ) -> Result<(Tx, QueryResult<P::Output>), BeginFailure> {
        let mut tx = Tx::watched(conn, Some(timeouts));
        let conn = tx.conn();
        // As `begin_transaction_sql` refuses it: a connection in a transaction.
        let depth = <AnsiTransactionManager as TransactionManager<AsyncPgConnection>>::transaction_manager_status_mut(conn)
            .transaction_depth();
        if let Err(err) = depth.and_then(|depth| match depth {
            Some(_) => Err(DieselError::AlreadyInTransaction),
            None => Ok(()),
        }) {
            tx.discard();
            return Err(BeginFailure(err));
        }
        conn.instrumentation()
            .on_connection_event(InstrumentationEvent::begin_transaction(NonZeroU32::MIN));
        // From here, whether BEGIN ran is not known until it is answered: a
        // drop closes the connection.
        tx.open = true;
        let sql = timeouts.begin_sql(isolation);
        let (begun, first) = {
            let shared: &AsyncPgConnection = tx.conn();
            let mut begin_on = shared;
            join(begin_on.batch_execute(&sql), first.send(shared)).await
        };
        match begun.and_then(|()| change_depth(tx.conn(), TransactionDepthChange::IncreaseDepth)) {
            Ok(()) => Ok((tx, first)),
            Err(err) => {
                tx.discard();
                Err(BeginFailure(err))
            }
        }
    }

    /// Send `last`, and `COMMIT` behind it in the same round trip, unless a
    /// statement failed unnoticed. `timeout` bounds the wait for `COMMIT`'s
    /// answer once `last` has run, which the server bounds by the
    /// transaction's statement timeout (a row lock may hold it).
    pub(crate) async fn commit_behind<P: Pipelined>(
        &mut self,
        timeout: Duration,
        last: &P,
    ) -> Result<P::Output, Closing> {
        self.refuse_if_failed(timeout).await?;
        let bound = timeout + self.statement_bound().unwrap_or(timeout);
        let (answered, committed) = {
            let shared: &AsyncPgConnection = self.conn();
            let mut statement = last.send(shared);
            // A statement that cannot be sent fails here, before COMMIT exists.
            let early = poll_fn(|cx| Poll::Ready(statement.as_mut().poll(cx))).await;
            if let Poll::Ready(answered) = early {
                drop(statement);
                return match answered {
                    // Answered at once: COMMIT was not sent yet.
                    Ok(output) => self
                        .commit(timeout)
                        .await
                        .map(|()| output)
                        .map_err(Closing::Commit),
                    // Not sent: the transaction is open, for the loop to
                    // roll back (after reading the watch, which that clears).
                    Err(err) => Err(Closing::Failed(err)),
                };
            }
            let mut commit_on = shared;
            let (answered, committed) = join(
                tokio::time::timeout(bound, statement),
                tokio::time::timeout(bound, Commit.execute(&mut commit_on)),
            )
            .await;
            (answered.ok(), committed.ok())
        };
        match (answered, committed) {
            (Some(Ok(output)), Some(Ok(_))) => {
                self.closed();
                Ok(output)
            }
            // Refused by the server: the transaction was aborted, so the
            // COMMIT behind it rolled it back, answered or not.
            (Some(Err(err)), committed) if !lost(&err) => {
                match committed {
                    Some(Ok(_)) => self.closed(),
                    Some(Err(e)) if !lost(&e) => self.closed(),
                    _ => self.cancel_and_discard(),
                }
                Err(Closing::Failed(err))
            }
            // COMMIT answered with an error: it ended the transaction.
            (Some(Ok(_)), Some(Err(err))) if !lost(&err) => {
                self.closed();
                Err(Closing::Commit(CommitFailure::Failed(err)))
            }
            (Some(_), Some(_)) => {
                tracing::warn!("connection failed during COMMIT; outcome unknown");
                self.discard();
                Err(Closing::Commit(CommitFailure::Unknown))
            }
            _ => {
                tracing::warn!("COMMIT got no answer in {bound:?}; outcome unknown");
                self.cancel_and_discard();
                Err(Closing::Commit(CommitFailure::Unknown))
            }
        }
    }

    /// What [`Tx::commit_behind`] does, one statement after the other:
    /// `last`, answered, then `COMMIT` as a simple query. Behind a
    /// transaction pooler, where each statement is closed after its run, so
    /// that `last`'s close goes out before `COMMIT` (see
    /// [`behind_transaction_pooler`](crate::pool::behind_transaction_pooler)).
    pub(crate) async fn commit_after<P: Pipelined>(
        &mut self,
        timeout: Duration,
        last: &P,
    ) -> Result<P::Output, Closing> {
        self.refuse_if_failed(timeout).await?;
        match last.send(self.conn()).await {
            Ok(output) => self
                .commit(timeout)
                .await
                .map(|()| output)
                .map_err(Closing::Commit),
            // Left open (aborted) for the loop to roll back once it has
            // read the failure off the watch (a rollback clears it).
            Err(err) => Err(Closing::Failed(err)),
        }
    }

    /// A statement of the transaction failed and its error was ignored:
    /// roll back, as [`Tx::commit`] does, rather than send anything more.
    async fn refuse_if_failed(&mut self, timeout: Duration) -> Result<(), Closing> {
        if self.watch_failed() {
            self.roll_back(timeout).await;
            return Err(Closing::Commit(CommitFailure::RolledBack));
        }
        Ok(())
    }

    /// The pipelined COMMIT was answered: the transaction ended on the
    /// server, as diesel-async's manager and the instrumentation now learn.
    fn closed(&mut self) {
        let conn = self.conn();
        conn.instrumentation()
            .on_connection_event(InstrumentationEvent::commit_transaction(NonZeroU32::MIN));
        if let Err(err) = change_depth(conn, TransactionDepthChange::DecreaseDepth) {
            // The manager is out of step with the server: not reusable.
            tracing::warn!(error = %err, "transaction depth out of step after COMMIT; discarding the connection");
            self.discard();
        }
        self.open = false;
    }
}
