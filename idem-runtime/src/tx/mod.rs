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
//! It begins and ends transactions through diesel-async's supported hooks
//! only (`begin_transaction_sql`, `commit_transaction`,
//! `rollback_transaction`), which keep diesel's own transaction depth right,
//! so a `conn.transaction(..)` inside a body becomes a savepoint. What
//! happened inside a transaction it learns from the server, not from
//! diesel: idem's pool reads every connection on the wire
//! ([`crate::pool`]), so a statement that failed reaches it with its
//! SQLSTATE whatever diesel call ran it (`execute`, `get_result`, `load`, a
//! stream). PostgreSQL answers `COMMIT` in a transaction whose statement
//! failed with a silent `ROLLBACK`: a transaction the server reports failed
//! is rolled back instead of committed, and a `COMMIT` the server answers
//! `ROLLBACK` (a statement still in flight when it was sent failed) is
//! reported as one.
//!
//! A transaction of the retry loop is bounded at the server: its `BEGIN`
//! carries `SET LOCAL statement_timeout` and `SET LOCAL lock_timeout`
//! ([`Timeouts`]) in the same simple query (or, when statements ride on it,
//! the same `set_config(.., true)` prepared), so the bound costs no round trip,
//! and, being transaction-scoped, ends with the transaction: nothing is left
//! on the pooled connection (and it holds behind PgBouncer's transaction
//! pooling).

use std::sync::Arc;
use std::time::Duration;

use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel::QueryResult;
use diesel_async::{AnsiTransactionManager, AsyncPgConnection, TransactionManager};

use crate::cause::{RetryCause, Transient};
use crate::pool::{Marks, PooledConnection, Refusal, Replication, Row, Wire};

mod begin;
mod close;
mod ended;
mod pipeline;
mod prepared;
mod rollback;
pub use begin::Isolation;
pub(crate) use begin::Timeouts;
use begin::SYNCHRONOUS;
pub(crate) use ended::{AfterBodyCommit, EndWatch};
use ended::{EndState, Settled};
pub(crate) use pipeline::{Closing, Last, Opening, Render};
pub(crate) use prepared::{Prepared, Session};
pub(crate) use rollback::RolledBack;

/// One open transaction. Dropping it while open (the caller's future was
/// cancelled) cancels the statement the server may still run for it and
/// closes the connection, so no connection goes back to the pool idle in a
/// transaction, and no row lock outlives the caller.
pub(crate) struct Tx {
    conn: Option<PooledConnection>,
    open: bool,
    /// The loop's bounds on its statements.
    timeouts: Timeouts,
    /// The connection's transaction control once `BEGIN` was answered.
    begun: Marks,
    /// Open on the server while diesel-async counts no transaction: a
    /// statement sent with `BEGIN` or `COMMIT` failed it (see
    /// [`pipeline`]). It is rolled back with a `ROLLBACK` of idem's own.
    unmanaged: bool,
    /// The rows of the statements sent with `BEGIN`, until taken.
    opened: Option<QueryResult<Vec<Vec<Row>>>>,
    /// What this transaction's [`EndWatch`]es share with it.
    end_state: Option<Arc<EndState>>,
    /// See [`Tx::after_body_commit`].
    after_body_commit: Option<AfterBodyCommit>,
    /// A connection lost after the body committed by hand, closed, its
    /// pool slot kept until the transaction is dropped (see
    /// [`Tx::keeps_a_lost_slot`]).
    lost: Option<PooledConnection>,
    /// A cancel went out for a request of the body's still running (its
    /// `COMMIT`, see [`Tx::ended_by_body_settled`]) and the answers had
    /// their second `commit_timeout_ms`: nothing waits for them again.
    waited: bool,
}

/// How a `COMMIT` ended, when it did not commit for certain.
#[derive(Debug)]
#[doc(hidden)]
pub enum CommitFailure {
    /// The connection failed, or went silent, while `COMMIT` was in flight:
    /// the transaction may or may not have committed.
    Unknown,
    /// A statement of the transaction had failed (and its error was
    /// ignored): the transaction was rolled back instead of being committed.
    /// The failure's cause, when it is worth replaying the transaction for.
    RolledBack(Option<RetryCause>),
    /// `COMMIT` was answered with an error: nothing was committed.
    Failed(DieselError),
    /// The body ended the transaction itself (or began another): `committed`
    /// when what it had written by then was committed (or prepared).
    EndedByBody {
        /// Something was committed.
        committed: bool,
        /// What was to ride on idem's `COMMIT` (a local call's record)
        /// rode on the body's and committed with it: there is nothing to
        /// hold for what the body committed.
        recorded: bool,
    },
    /// The body left a savepoint open (a `conn.transaction(..)` whose future
    /// it dropped, say), so diesel-async's `COMMIT` was a `RELEASE
    /// SAVEPOINT`: the connection was closed with its transaction open, and
    /// nothing was committed.
    SavepointOpen,
    /// The body swapped the connection it was lent for another: nothing was
    /// committed, the one swapped in was closed.
    Replaced,
}

/// The error of a `BEGIN` that opened no transaction; it reads as a lost
/// connection, which the retry loop's checkout replaces at once.
const NOT_BEGUN: &str =
    "idem: the statement sent as BEGIN opened no transaction (a statement of the \
     application's stands under a name idem reserves, idem_..); the connection was closed";

/// Why `BEGIN` failed; the connection is already discarded.
pub(crate) struct BeginFailure(pub(crate) DieselError);

impl Tx {
    /// `BEGIN` with `isolation` on a connection fresh from the pool, its
    /// statements bounded by `timeouts`, and the statements `opening` writes
    /// sent with it: its rows are kept for [`Tx::opened`]. When `BEGIN` ran
    /// and `opening` failed, the transaction is returned, failed, with the
    /// error as what it opened with.
    pub(crate) async fn begin(
        conn: PooledConnection,
        isolation: Isolation,
        timeouts: Timeouts,
        opening: Option<Render<'_>>,
    ) -> Result<Tx, BeginFailure> {
        let mut tx = Tx {
            conn: Some(conn),
            open: false,
            timeouts,
            begun: Marks::default(),
            unmanaged: false,
            opened: None,
            end_state: None,
            after_body_commit: None,
            lost: None,
            waited: false,
        };
        // From here, whether BEGIN ran is not known until it is answered: a
        // drop closes the connection.
        tx.open = true;
        let mut sql = timeouts.begin_sql(isolation);
        let synchronous = tx.replication() == Some(Replication::Synchronous);
        if synchronous {
            // A lower setting (a database's or role's default of `local` or
            // `off`) would acknowledge a commit the standby lacks.
            sql.push_str("; ");
            sql.push_str(SYNCHRONOUS);
        }
        let wire = tx.wire_arc();
        let before = wire.marks();
        // Sent once more when a statement of idem's that was to ride on it
        // (`BEGIN` itself among them) was gone unseen or its name taken: the
        // wire has moved to new names by then, and no transaction is open.
        let mut tries = 2;
        let (begun, rows) = loop {
            tries -= 1;
            let losses = wire.losses();
            let mut riding = None;
            if let Some(render) = opening {
                let begin = |session: &mut Session<'_>| {
                    timeouts.write_begin(isolation, session)?;
                    if synchronous {
                        session.plain(SYNCHRONOUS);
                    }
                    Ok(())
                };
                match pipeline::ride_unit(&wire, begin, render, None) {
                    Ok(unit) => {
                        wire.ride(sql.clone().into_bytes(), unit.messages, unit.parses);
                        riding = Some(unit.first);
                    }
                    // Nothing to send with BEGIN: the transaction opens
                    // without them, and answers their failure.
                    Err(err) => tx.opened = Some(Err(err)),
                }
            }
            let begun = AnsiTransactionManager::begin_transaction_sql(tx.conn(), &sql).await;
            let lost = begun.is_err()
                && riding.is_some()
                && wire.losses() > losses
                && wire.settled(timeouts.bounds().statement).await
                && !wire.unfinished();
            let rows = riding.map(|first| (wire.unride(), first));
            if !(lost && tries > 0) {
                break (begun, rows);
            }
        };
        tx.begun = wire.marks();
        // The body's statements go out only while this transaction lasts
        // (see `Wire::guard`); whatever ends it here is answered below.
        wire.guard(Some(tx.begun));
        match begun {
            // What ran under idem's name for `BEGIN` opened no transaction:
            // a statement of the application's stands there (prepared inside
            // a function, where the wire cannot see it). The body must not
            // run with each statement its own transaction; the connection
            // goes, and another is tried.
            Ok(()) if !wire.in_block() => {
                tracing::error!("the statement sent as BEGIN opened no transaction: another statement stands under its name; closing the connection");
                tx.discard();
                Err(BeginFailure(DieselError::DatabaseError(
                    DatabaseErrorKind::ClosedConnection,
                    Box::new(NOT_BEGUN.to_owned()),
                )))
            }
            Ok(()) => {
                if let Some((rows, first)) = rows {
                    tx.opened = Some(pipeline::captured(rows, first));
                }
                Ok(tx)
            }
            // BEGIN ran and a statement sent with it failed: the transaction
            // is open, failed, and diesel-async does not count it. (The
            // server sends the error before the status that says so.)
            Err(err)
                if rows.is_some()
                    && tx.begun.since(before).is_some()
                    && wire.settled(timeouts.bounds().statement).await
                    && wire.unfinished()
                    && !wire.closed() =>
            {
                tx.unmanaged = true;
                tx.opened = Some(Err(err));
                Ok(tx)
            }
            Err(err) => {
                tx.discard();
                Err(BeginFailure(err))
            }
        }
    }

    /// The transaction failed on a prepared statement of idem's the session
    /// did not hold (dropped where the wire could not see it), or on a
    /// name of idem's the application had taken: the next attempt prepares
    /// them again, under new names.
    pub(crate) fn statement_lost(&self) -> bool {
        self.wire()
            .and_then(Wire::abort)
            .is_some_and(|r| crate::pool::loses_statements(&r.code))
    }

    /// What the statements sent with `BEGIN` answered, taken.
    pub(crate) fn opened(&mut self) -> Option<QueryResult<Vec<Vec<Row>>>> {
        self.opened.take()
    }

    /// The connection the transaction runs on.
    ///
    /// # Panics
    /// After the connection was discarded, which only the ending methods do,
    /// and they consume or close the transaction.
    pub(crate) fn conn(&mut self) -> &mut AsyncPgConnection {
        let conn = self
            .conn
            .as_mut()
            .expect("a transaction's connection is only discarded when it ends");
        conn
    }

    /// Its pool's [`Replication`], while it has its connection.
    pub(crate) fn replication(&self) -> Option<Replication> {
        self.conn.as_ref().map(|conn| conn.replication())
    }

    fn wire(&self) -> Option<&Wire> {
        self.conn.as_ref().map(|conn| conn.wire())
    }

    /// The wire's handle, shared: it outlives a borrow of the transaction.
    fn wire_arc(&self) -> Arc<Wire> {
        self.conn
            .as_ref()
            .expect("a transaction's connection is only discarded when it ends")
            .wire_arc()
    }

    /// Commit, unless the server reports the transaction failed; `timeout`
    /// bounds the wait for the server's answer.
    pub(crate) async fn commit(&mut self, timeout: Duration) -> Result<(), CommitFailure> {
        if let Some(refusal) = self.refuse(timeout).await {
            return Err(refusal);
        }
        self.send_commit(timeout).await
    }

    /// Send `COMMIT` (the transaction is known sound) and classify its end.
    async fn send_commit(&mut self, timeout: Duration) -> Result<(), CommitFailure> {
        // What commits once it goes out is idem's own, not a body's: with
        // the record riding on it, it commits or rolls back together with
        // the body's writes, and a call dropped while it is in flight has
        // nothing to hold (nor has one whose `COMMIT` goes unanswered).
        self.own_commit_next();
        let wire = self.wire_arc();
        let rollbacks = wire.rollbacks();
        // The guard stays up through `COMMIT` (see `Wire::guard`): an end
        // the body had queued in tokio-postgres, written since `refuse`
        // looked, keeps it (and what rides on it) from going out.
        let committed = tokio::time::timeout(
            timeout,
            AnsiTransactionManager::commit_transaction(self.conn()),
        )
        .await;
        let committed = match committed {
            // It never went out: the seal holds it back behind a `COMMIT` of
            // the body's (in a request with other statements, which nothing
            // replaced) still running, which the seal cancels at the same
            // bound and reads within as long again (see
            // `Wire::holds_refused`). Its answer, not this silence, says
            // what committed.
            Err(elapsed) if wire.holds_a_write() => {
                let settled = wire.settled(timeout).await;
                match settled && wire.withheld() {
                    true => Ok(Err(diesel::result::Error::BrokenTransactionManager)),
                    false => Err(elapsed),
                }
            }
            committed => committed,
        };
        // Unanswered, the connection closes with its guard up: idem's
        // `COMMIT`, if the seal still holds it, is never written.
        if committed.is_ok() {
            self.unguard();
        }
        match committed {
            // The ride went out in place of a `COMMIT` the body had queued
            // (the same text, in the same write), and committed: it was
            // idem's commit. The refusal of the `COMMIT` behind it waited
            // for that answer.
            Ok(Err(_))
                if wire.withheld_only_a_commit()
                    && self.own_commit_sent(&wire)
                    && wire.marks().since(self.begun) == Some(true) =>
            {
                self.open = false;
                self.discard();
                Ok(())
            }
            // The same ride, with something of the body's behind that
            // `COMMIT` withheld: the body's end stands as its answer, the
            // record, committed with its writes, as what a repeat finds.
            Ok(Err(_)) if wire.withheld() => {
                tracing::warn!("the body sent an end of the transaction of its own after idem looked (a request it had queued); COMMIT was not sent, and the connection is closed");
                let committed = ended::committed_since(&wire, self.begun);
                let recorded = committed && self.own_commit_sent(&wire);
                self.discard();
                Err(CommitFailure::EndedByBody {
                    committed,
                    recorded,
                })
            }
            // A statement still in flight when COMMIT was sent failed (a
            // future the body dropped): the server said ROLLBACK.
            Ok(Ok(())) if wire.rollbacks() > rollbacks => {
                self.open = false;
                Err(CommitFailure::RolledBack(self.failure_cause()))
            }
            // A transaction is still open: the body left a savepoint open,
            // and what went out was its `RELEASE`.
            Ok(Ok(())) if self.still_open() => {
                tracing::error!("the body left a savepoint open: COMMIT was a RELEASE SAVEPOINT; closing the connection, nothing committed");
                self.discard();
                Err(CommitFailure::SavepointOpen)
            }
            Ok(Ok(())) => {
                self.open = false;
                Ok(())
            }
            Err(_elapsed) => {
                tracing::warn!("COMMIT got no answer in {timeout:?}; outcome unknown");
                match self.conn.as_ref().map(|c| c.replication()) {
                    // A cancel would turn a wait for the synchronous standby
                    // into a local commit, visible and not replicated: the
                    // backend is left to wait, its locks held.
                    Some(Replication::Synchronous) => self.discard(),
                    _ => self.cancel_and_discard(),
                }
                Err(CommitFailure::Unknown)
            }
            Ok(Err(err)) if err.transient() == Some(RetryCause::ConnectionLost) => {
                tracing::warn!(error = %err, "connection failed during COMMIT; outcome unknown");
                self.discard();
                Err(CommitFailure::Unknown)
            }
            // diesel-async still counts a transaction: what failed was the
            // `RELEASE SAVEPOINT` of a savepoint the body left open (and
            // then released or rolled back by hand), which leaves the
            // transaction open, failed.
            Ok(Err(err)) if self.counted_open() => {
                tracing::error!(error = %err, "the body left a savepoint open: COMMIT was a RELEASE SAVEPOINT, which failed; closing the connection, nothing committed");
                self.discard();
                Err(CommitFailure::SavepointOpen)
            }
            Ok(Err(err)) => {
                // A COMMIT answered with an error ends the transaction on the
                // server, and diesel-async has counted it as ended.
                self.open = false;
                Err(CommitFailure::Failed(err))
            }
        }
    }

    /// Why this transaction must not be committed, if it must not: the body
    /// ended it itself, or it failed, or its connection is gone. It is
    /// rolled back (which also ends a transaction the body began itself).
    ///
    /// It first settles the body's requests ([`Tx::settle`]). One unanswered
    /// then that may commit is cancelled and its answer read (see
    /// [`Tx::cancel_and_read`]), and counts as committed if none comes; any
    /// other still running is cancelled with its transaction: nothing is
    /// committed, for certain.
    pub(crate) async fn refuse(&mut self, timeout: Duration) -> Option<CommitFailure> {
        // Checked first: every other check reads the wire, which watches
        // the session idem began on, not the one swapped in.
        if !self.holds_its_session() {
            self.replaced();
            return Some(CommitFailure::Replaced);
        }
        match self.settle(timeout).await {
            // Cancelled, then read within `timeout` again: a `COMMIT` the
            // cancel aborted committed nothing; one still unanswered counts
            // as committed.
            Some(Settled::MayHaveCommitted) => {
                tracing::warn!(
                    "a COMMIT the body sent is unanswered; cancelling it and reading how it ended"
                );
                let wire = self.wire_arc();
                self.cancel_and_read(&wire, timeout).await;
                return Some(CommitFailure::EndedByBody {
                    committed: ended::committed_since(&wire, self.begun),
                    recorded: false,
                });
            }
            Some(Settled::Running) => {
                tracing::warn!("a statement of the transaction still runs at COMMIT (its future was dropped?); rolling back");
                let cause = self.failure_cause();
                self.cancel_and_discard();
                return Some(CommitFailure::RolledBack(cause));
            }
            Some(Settled::Answered) | None => {}
        }
        // What the body sent and idem's seal refused, unanswered on a
        // closed connection, counts too (see `ended::body_end`).
        let ended = self
            .wire()
            .and_then(|wire| ended::body_end(wire, self.begun));
        let refusal = match ended {
            Some(committed) => CommitFailure::EndedByBody {
                committed,
                recorded: false,
            },
            None if self.lost_track() => {
                tracing::error!("the body dropped a savepoint's SAVEPOINT, RELEASE or ROLLBACK TO before its answer: the transaction's depth is unknown; closing the connection, nothing committed");
                self.discard();
                return Some(CommitFailure::SavepointOpen);
            }
            None if self.wire().is_some_and(Wire::unfinished) => {
                CommitFailure::RolledBack(self.failure_cause())
            }
            None => return None,
        };
        self.roll_back(timeout).await;
        Some(refusal)
    }

    /// idem's own end of the transaction goes out (see `Wire::guard`).
    fn unguard(&self) {
        if let Some(wire) = self.wire() {
            wire.guard(None);
        }
    }

    /// After a `COMMIT` or `ROLLBACK` diesel-async answered `Ok`: whether a
    /// transaction is still open, as diesel-async counts (a savepoint the
    /// body left open made it a `RELEASE SAVEPOINT` or a `ROLLBACK TO
    /// SAVEPOINT`) or as the server last said (a body that told
    /// diesel-async's manager its transaction was a test transaction).
    ///
    /// Not `PoolableConnection::is_broken`, which is also true of a closed
    /// connection: a backend that ends right after answering `COMMIT` (a
    /// kill, a failover) would make a committed transaction read as a
    /// savepoint left open, "nothing committed".
    fn still_open(&mut self) -> bool {
        self.wire().is_some_and(Wire::in_block) || self.counted_open()
    }

    /// Whether diesel-async's transaction manager still counts a
    /// transaction (or lost track of it), whatever became of the socket.
    fn counted_open(&mut self) -> bool {
        <AnsiTransactionManager as TransactionManager<AsyncPgConnection>>::is_broken_transaction_manager(
            self.conn(),
        )
    }

    /// Whether diesel-async lost track of the transaction's depth: the body
    /// dropped a future of its transaction manager (a nested
    /// `conn.transaction(..)` given a timeout, say) while its `SAVEPOINT`,
    /// `RELEASE SAVEPOINT` or `ROLLBACK TO SAVEPOINT` was unanswered. The
    /// manager then counts the savepoint or not, whatever the server did,
    /// and its next transaction statement (idem's `COMMIT` or `ROLLBACK`)
    /// would panic in a debug build or go to the wrong depth in a release
    /// one. diesel-async reports that flag only together with "a
    /// transaction is open"; read with its status set aside for the
    /// moment (a fresh one: no transaction), it is the flag alone.
    fn lost_track(&mut self) -> bool {
        type Manager = AnsiTransactionManager;
        let conn = self.conn();
        let status = std::mem::take(
            <Manager as TransactionManager<AsyncPgConnection>>::transaction_manager_status_mut(
                conn,
            ),
        );
        let lost =
            <Manager as TransactionManager<AsyncPgConnection>>::is_broken_transaction_manager(conn);
        *<Manager as TransactionManager<AsyncPgConnection>>::transaction_manager_status_mut(conn) =
            status;
        lost
    }

    /// The refusal that failed the transaction, or the one of the request
    /// still being answered (the server sends an error the moment it is
    /// raised, and its `ReadyForQuery` after it: a body may return the error
    /// before the status arrives).
    pub(crate) fn failure_cause(&self) -> Option<RetryCause> {
        let wire = self.wire()?;
        let bounds = Some(self.timeouts.bounds());
        let cause = |r: Refusal| r.cause(bounds);
        wire.abort()
            .or_else(|| wire.pending())
            .and_then(cause)
            .or_else(|| wire.closed().then_some(RetryCause::ConnectionLost))
    }

    /// Why a body that returned an error failed, as the server said: the
    /// failure of the transaction, or else a refusal a rollback to a
    /// savepoint undid (a deadlock inside `conn.transaction(..)` whose error
    /// the body passed on), when it is worth replaying for.
    pub(crate) fn error_cause(&self) -> Option<RetryCause> {
        let bounds = Some(self.timeouts.bounds());
        self.failure_cause().or_else(|| {
            self.wire()?
                .refusals()
                .into_iter()
                .find_map(|r| r.cause(bounds))
        })
    }
}
