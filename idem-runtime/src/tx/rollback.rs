//! How a transaction is rolled back, and what the answer to idem's
//! `ROLLBACK` says of where the body had left it.

use std::sync::Arc;
use std::time::Duration;

use diesel_async::{
    AnsiTransactionManager, AsyncPgConnection, SimpleAsyncConnection, TransactionManager,
};

use super::{ended, Tx};
use crate::cause::{RetryCause, Transient};
use crate::pool::Wire;

/// How [`Tx::roll_back_reading`] ended.
pub(crate) struct RolledBack {
    /// The connection turned out to be lost: the transaction died with it.
    pub(crate) lost: bool,
    /// Whether the body had ended (or begun) a transaction itself:
    /// `Some(true)` when what it wrote may have committed (see
    /// [`Tx::ended_by_body`]).
    pub(crate) ended: Option<bool>,
}

impl Tx {
    /// Roll back, or discard the connection when that fails or goes
    /// unanswered, cancelling what its backend may still run: either way
    /// the transaction is gone. A failing rollback is
    /// logged, never returned, so it cannot hide the error that caused it.
    ///
    /// Returns true when the connection turned out to be lost: the
    /// transaction died with it.
    pub(crate) async fn roll_back(&mut self, timeout: Duration) -> bool {
        self.roll_back_reading(timeout).await.lost
    }

    /// [`Tx::roll_back`], and where the body had left the transaction: its
    /// `ROLLBACK` goes out behind whatever the body sent or queued in
    /// tokio-postgres (the guard up, see `Wire::guard`), so once it is
    /// answered, every request the body made is too.
    pub(crate) async fn roll_back_reading(&mut self, timeout: Duration) -> RolledBack {
        let (lost, wire, answered) = self.send_rollback(timeout).await;
        let ended = match wire {
            // Answered last, a lone `ROLLBACK` counted one idle status.
            Some(wire) if answered => wire.marks().before_a_lone_rollback().since(self.begun),
            Some(wire) => ended::body_end(&wire, self.begun),
            None => None,
        };
        RolledBack { lost, ended }
    }

    /// See [`Tx::roll_back`]; also the transaction's wire, and whether
    /// idem's lone `ROLLBACK` was the last request answered on it.
    async fn send_rollback(&mut self, timeout: Duration) -> (bool, Option<Arc<Wire>>, bool) {
        if !self.open {
            return (false, None, false);
        }
        if !self.holds_its_session() {
            self.unguard();
            self.replaced();
            return (false, None, false);
        }
        let wire = self.wire_arc();
        // A statement the body stopped waiting for may still run: the
        // `ROLLBACK` queues behind it, and its timeout is then no sign of a
        // lost connection.
        let behind = wire.running();
        // Still running after its cancel and a second `timeout` (see
        // `Tx::ended_by_body_settled`): a `ROLLBACK` would wait behind it
        // again. Closed, the write guard up; the wire's marks say the rest.
        if behind && self.waited {
            self.discard();
            return (false, Some(wire), false);
        }
        let broken = !self.unmanaged && self.lost_track();
        if broken && !self.handed_off() {
            // Closed, which rolls back; what the dropped statement left
            // running is cancelled.
            tracing::warn!("the body dropped a savepoint's statement before its answer; closing the connection");
            self.cancel_and_discard();
            return (false, Some(wire), false);
        }
        // Behind a `COMMIT` of the body's, what is left of its bound from its
        // send (see `Tx::settle`): past it, it is cancelled below.
        let wait = wire.left_for_commit(timeout);
        // Handed on after the body's own end (its call dropped while
        // diesel-async's manager had a request of its own unanswered, idem's
        // `ROLLBACK` say): a `ROLLBACK` of idem's own, whatever the manager
        // counts, behind the body's `COMMIT`, whose answer decides what to
        // hold; a cancel would abort that `COMMIT` unread. Then closed.
        let rolled_back = if self.unmanaged || broken {
            let mut shared: &AsyncPgConnection = self.conn();
            tokio::time::timeout(wait, shared.batch_execute("ROLLBACK")).await
        } else {
            tokio::time::timeout(
                wait,
                AnsiTransactionManager::rollback_transaction(self.conn()),
            )
            .await
        };
        // Kept up while a `ROLLBACK` that timed out is read past the body's
        // `COMMIT` below, or the connection closes: what the body queued
        // behind it stays held (see `Wire::guard`).
        if rolled_back.is_ok() {
            self.unguard();
        }
        match rolled_back {
            Ok(Ok(())) if broken => {
                self.discard();
                (false, Some(wire), true)
            }
            // A savepoint the body left open made it a `ROLLBACK TO
            // SAVEPOINT`: the transaction, and its locks, would go back to
            // the pool. Closed instead, which rolls it back.
            Ok(Ok(())) if self.still_open() => {
                tracing::warn!("the body left a savepoint open: ROLLBACK was to the savepoint; closing the connection");
                self.discard();
                (false, Some(wire), false)
            }
            Ok(Ok(())) => {
                self.open = false;
                self.unmanaged = false;
                (false, Some(wire), true)
            }
            Ok(Err(err)) => {
                tracing::warn!(error = %err, "ROLLBACK failed; discarding the connection");
                let lost = err.transient() == Some(RetryCause::ConnectionLost) || wire.closed();
                // The backend may still run what was sent before: a request
                // a body pipelined behind its own end of the transaction,
                // whose connection the seal closed (see `Wire::guard`), runs
                // on in the chained transaction, without idem's bounds.
                self.cancel_and_discard();
                (lost, Some(wire), false)
            }
            // Behind the body's own `COMMIT` still running (a deferred
            // check slower than `timeout`), handed on or not: cancelled,
            // then its answer read, within `timeout` again. A `COMMIT` the
            // cancel aborted committed nothing, and holds nothing.
            Err(_elapsed) if self.handed_off() || wire.unanswered_may_commit() => {
                tracing::warn!("ROLLBACK got no answer behind the body's own COMMIT; cancelling it and reading how it ended");
                let answered = self.cancel_and_read(&wire, timeout).await;
                (!answered && !behind, Some(wire), answered)
            }
            Err(_elapsed) => {
                tracing::warn!(behind, "ROLLBACK got no answer; discarding the connection");
                self.cancel_and_discard();
                (!behind, Some(wire), false)
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
}
