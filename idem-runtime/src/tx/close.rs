//! How a transaction's connection is closed rather than returned to the
//! pool: a plain discard, a cancel of what its backend may still run, and
//! both connections of a body that swapped the one it was lent.

use std::time::Duration;

use deadpool::managed::Object;

use super::Tx;
use crate::pool::{Replication, Wire};

impl Tx {
    /// Whether the connection in the transaction's slot is still the one
    /// it began on (see [`crate::pool::Connection::holds_its_session`]).
    pub(crate) fn holds_its_session(&self) -> bool {
        match self.conn.as_ref() {
            Some(conn) => conn.holds_its_session(),
            None => true,
        }
    }

    /// The body swapped the connection it was lent for another: the one it
    /// took away, with idem's transaction open on it, is closed wherever
    /// it is now held (a body's task, another checkout of the pool, idle
    /// in the pool's queue), and the one swapped in with what the body began
    /// on it. Nothing is sent on either; a statement either still runs is
    /// cancelled through a connection of its own.
    pub(super) fn replaced(&mut self) {
        tracing::error!("the body swapped the connection it was lent for another; closing both, nothing committed (what either had begun rolls back)");
        if let Some(conn) = self.conn.as_ref() {
            // A statement it still runs keeps the transaction and its locks
            // until it ends (the server notices a closed socket only when
            // it next writes): cancelled, as `cancel_and_discard` does.
            if conn.wire().keeps_session_statements() {
                crate::pool::cancel(conn.made_with());
            }
            conn.wire().sever();
        }
        self.cancel_and_discard();
    }

    /// A statement still in flight on a connection idem's transaction no
    /// longer holds (a local key's hold the call was dropped in): the
    /// connection goes back to the pool once it is answered, or within the
    /// transaction's statement bound, in a task of its own. Until then its
    /// slot stays taken: returned at once, its statement would be given a
    /// moment and then abandoned, and the caller waiting next would run
    /// beside it, before what it writes is committed.
    fn release_when_answered(&mut self) {
        let running = self.wire().is_some_and(Wire::running);
        let (Some(conn), Ok(runtime)) = (
            self.conn.take().filter(|_| running),
            tokio::runtime::Handle::try_current(),
        ) else {
            return;
        };
        let within = self.timeouts.bounds().statement;
        runtime.spawn(async move {
            conn.wire().settled(within).await;
            drop(conn);
        });
    }

    /// Close the connection instead of returning it to the pool.
    pub(crate) fn discard(&mut self) {
        self.close_watches();
        if let Some(conn) = self.conn.take() {
            // After the body committed by hand, with something to write for
            // it (see `Tx::after_body_commit`): closed, its slot kept.
            let committed = self.body_committed(conn.wire());
            if self.writes_after_body_commit() && committed {
                conn.wire().sever();
                self.lost = Some(conn);
            } else {
                drop(Object::take(conn));
            }
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
        self.cancel_running();
        // Closed at once, not after the cancel, which needs no answer.
        self.discard();
    }

    /// [`Tx::cancel_and_discard`], but the answers are read first, within
    /// `timeout`, the write guard kept up (what the body queued behind is
    /// not written meanwhile): for a `COMMIT` of the body's still running
    /// when idem stopped waiting (a deferred check slower than
    /// `commit_timeout_ms`), whose answer, not its silence, must decide
    /// what is held. A `COMMIT` the cancel aborted committed nothing.
    ///
    /// Returns whether every request was answered on the open connection.
    pub(super) async fn cancel_and_read(&mut self, wire: &Wire, timeout: Duration) -> bool {
        self.cancel_running();
        // Once cancelled and waited for, not again.
        let timeout = if self.waited { Duration::ZERO } else { timeout };
        // The seal may close the connection at a write the body queued
        // behind its `COMMIT`, once that is answered: the wire's marks
        // then say how the `COMMIT` ended.
        let answered = wire.settled(timeout).await && !wire.closed();
        self.discard();
        answered
    }

    /// A write of the body's the seal refuses waits for a `COMMIT` the body
    /// sent up to `timeout` from its send, as idem's own `COMMIT` is given,
    /// then cancels it and waits as long again (see `Wire::bounds_commit`):
    /// never cancelled with a synchronous standby (see
    /// [`Tx::cancel_running`]), only waited for.
    pub(crate) fn bound_body_commit(&self, timeout: Duration) {
        if let Some(wire) = self.wire() {
            let cancel = self.replication() != Some(Replication::Synchronous);
            wire.bounds_commit(timeout, cancel);
        }
    }

    /// Send a cancel request for the statement the server runs for this
    /// transaction (see [`Tx::cancel_and_discard`]), the connection kept.
    pub(super) fn cancel_running(&self) {
        // Behind a transaction pooler the cancel of a client that is closing
        // is dropped anyway, and PgBouncer 1.18 (Debian 12) exits when a
        // cancel it is forwarding meets that client's disconnect, taking
        // every client down (seen in CI after a panicking body's
        // transaction was dropped): none is sent there.
        // `client_connection_check_interval` on the server ends the
        // statement instead (see `Pooler`).
        let pooled = self.wire().is_some_and(|w| !w.keeps_session_statements());
        // A cancel would turn a `COMMIT`'s wait for the synchronous standby
        // (the body's own, say) into a local commit, visible and not
        // replicated: the backend is left to wait, as `Tx::send_commit`
        // leaves idem's own. Also once the seal closed the connection with
        // that `COMMIT` unanswered: the backend runs it all the same (a
        // `COPY` the close cut off aside, which rolled back with what came
        // after it). So too a statement behind the body's end, whose own
        // commit waits for the standby (what the seal does not cancel
        // either, see `wire::stop`).
        let waits_for_standby = self.replication() == Some(Replication::Synchronous)
            && self.wire().is_some_and(Wire::unanswered_may_commit);
        if let Some(conn) = self.conn.as_ref().filter(|_| !pooled && !waits_for_standby) {
            crate::pool::cancel(conn.cancel_token());
        }
    }
}

impl Drop for Tx {
    fn drop(&mut self) {
        self.stop_writing_unless_committed();
        self.close_watches();
        if self.hand_off_after_body_commit() {
            return;
        }
        if self.open {
            tracing::warn!("transaction dropped while open; closing its connection");
            // A call dropped (or a body that panicked) after swapping the
            // connection: the one in the slot is not idem's, and the one
            // taken away, wherever it is held, still has idem's transaction
            // open; both go, as on every other path (see `Tx::replaced`).
            if self.holds_its_session() {
                self.cancel_and_discard();
            } else {
                self.replaced();
            }
        } else {
            // Back to the pool, unguarded. A connection closed keeps its
            // guard: what the body queued behind its own end is not
            // written while it closes (see `Wire::guard`).
            self.unguard();
            self.release_when_answered();
        }
        // Kept by `discard` (here too, with no runtime to hand off to): its
        // slot goes now, the connection closed.
        if let Some(lost) = self.lost.take() {
            drop(Object::take(lost));
        }
    }
}
