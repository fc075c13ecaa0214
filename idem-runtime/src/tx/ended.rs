//! How the body's requests ended: whether it ended (or began) a
//! transaction itself, and where its requests stand once answered, or once
//! idem stopped waiting for them. What [`Tx::refuse`] and the retry loop
//! decide a body's end on.

use std::time::Duration;

use super::Tx;

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
}
