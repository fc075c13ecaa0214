//! How the body's requests ended: whether it ended (or began) a
//! transaction itself, and where its requests stand once answered, or once
//! idem stopped waiting for them. What [`Tx::refuse`] and the retry loop
//! decide a body's end on.

use std::sync::Arc;
use std::time::Duration;

use diesel::pg::Pg;
use diesel::query_builder::{QueryFragment, QueryId};
use diesel_async::RunQueryDsl;

use super::Tx;
use crate::pool::{Marks, Wire};

/// Whether the body committed by hand, still readable once the attempt and
/// its connection are gone (a call dropped, or a body that panicked, after
/// its own `COMMIT`).
pub(crate) struct EndWatch {
    wire: Arc<Wire>,
    begun: Marks,
}

impl EndWatch {
    /// The transaction committed since `BEGIN` (idem's own `COMMIT` counts
    /// too), or a request that may commit went unanswered.
    pub(crate) fn committed(&self) -> bool {
        self.wire.marks().since(self.begun) == Some(true) || self.wire.unanswered_may_commit()
    }
}

/// Where the body's requests stand once [`Tx::settle`] stopped waiting.
pub(super) enum Settled {
    /// Every request has its answer (or the connection ended with none
    /// unanswered that may commit).
    Answered,
    /// One is unanswered that may commit: counted as committed.
    MayHaveCommitted,
    /// One is unanswered on an open connection: it may still run.
    Running,
}

impl Tx {
    /// A watch on how this transaction ends, see [`EndWatch`].
    pub(crate) fn watch_end(&self) -> Option<EndWatch> {
        Some(EndWatch {
            wire: self.conn.as_ref()?.wire_arc(),
            begun: self.begun,
        })
    }

    /// Whether the body ended (or began) a transaction itself since `BEGIN`
    /// (a `COMMIT`, `ROLLBACK`, `BEGIN` or `PREPARE TRANSACTION` of its own,
    /// or a statement whose failure ended the transaction): `Some(true)` when
    /// it committed (or prepared) what it had written by then.
    pub(crate) fn ended_by_body(&self) -> Option<bool> {
        self.wire()?.marks().since(self.begun)
    }

    /// [`Tx::ended_by_body`] once what the body sent is answered, waiting
    /// up to `timeout`: the answer to an end the body stopped waiting for
    /// (a `COMMIT` future it dropped before returning an error) may still
    /// be on its way. A request unanswered then that may commit counts as
    /// committed.
    pub(crate) async fn ended_by_body_settled(&self, timeout: Duration) -> Option<bool> {
        match self.settle(timeout).await? {
            Settled::MayHaveCommitted => Some(true),
            Settled::Answered | Settled::Running => self.ended_by_body(),
        }
    }

    /// Wait (up to `timeout`) for the body's requests still owed an answer:
    /// a statement's error arrives before the status that says what it did
    /// to the transaction, and a statement whose future the body dropped may
    /// still run. `None` without a wire to ask.
    pub(super) async fn settle(&self, timeout: Duration) -> Option<Settled> {
        let wire = self.wire()?;
        let answered = wire.settled(timeout).await;
        // Unanswered still (the wait ran out, or the connection closed
        // first): a `COMMIT` of the body's may have run, or may run before
        // the server sees the connection end.
        Some(if wire.unanswered_may_commit() {
            Settled::MayHaveCommitted
        } else if answered {
            Settled::Answered
        } else {
            Settled::Running
        })
    }

    /// Once the body ended the transaction and idem rolled back what was
    /// left: run `statement` alone (it commits on its own) on the same
    /// connection, before it goes back to the pool, within `timeout`.
    /// `None` when the connection is gone or still in a transaction.
    ///
    /// For a write that must come before anything else gets the
    /// connection: callers waiting on the pool would get it first, and run
    /// before the write (a local idempotent call's key, held after a body
    /// committed by hand, with duplicates queued on a pool of one).
    pub(crate) async fn run_alone<Q>(
        &mut self,
        timeout: Duration,
        statement: Q,
    ) -> Option<Result<usize, String>>
    where
        Q: QueryFragment<Pg> + QueryId + Send,
    {
        if self.open || self.conn.is_none() || !self.holds_its_session() {
            return None;
        }
        match tokio::time::timeout(timeout, statement.execute(self.conn())).await {
            Ok(Ok(written)) => Some(Ok(written)),
            Ok(Err(e)) => Some(Err(e.to_string())),
            Err(_) => {
                // It may still run, and hold its locks: stopped with the
                // connection.
                self.cancel_and_discard();
                Some(Err(format!("no answer within {timeout:?}")))
            }
        }
    }
}
