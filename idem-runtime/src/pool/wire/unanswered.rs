//! Requests sent and not yet answered: waiting for their answers, and
//! what they may still do to the transaction once idem stops waiting (a
//! future the body dropped, a connection closed under them).

use std::time::Duration;

use super::{State, Wire};

impl State {
    /// See [`Wire::unanswered_may_commit`].
    pub(super) fn may_commit(&self) -> bool {
        if self.closed && self.copy_in {
            return false;
        }
        let mut outside = self.outside;
        self.sent.iter().any(|sent| {
            let commits = sent.commit || outside && !sent.rollback_only;
            outside |= sent.ends && !sent.chained;
            commits
        })
    }
}

impl Wire {
    /// Wait up to `within` for every request sent to be answered (or the
    /// connection to end); false when one still runs then.
    pub(crate) async fn settled(&self, within: Duration) -> bool {
        // Almost always so at once (a checkout, a commit): the wait, with its
        // timer, is boxed so as not to sit inline in every caller's future.
        if self.answered() {
            return true;
        }
        Box::pin(self.answered_within(within)).await
    }

    /// Whether a request still unanswered may commit the transaction (a
    /// `COMMIT` whose future the body dropped, say): idem's cancel and
    /// close, which roll back what is still running, may come after the
    /// server ran it. Such a request counts as committed, and so does one
    /// that runs anything but a `ROLLBACK` after the transaction ended (an
    /// `INSERT` pipelined behind a body's `ROLLBACK`), which commits on its
    /// own.
    ///
    /// Not once the connection closed while the server waited for a `COPY
    /// .. FROM STDIN`'s data: it never got it, so that request, with what
    /// ran in its implicit transaction, rolled back, and nothing behind it
    /// ran.
    pub(crate) fn unanswered_may_commit(&self) -> bool {
        self.state().may_commit()
    }

    /// Whether a request still unanswered ends the transaction, other than
    /// a lone `ROLLBACK` (which may be idem's own).
    pub(crate) fn unanswered_end(&self) -> bool {
        let state = self.state();
        state
            .sent
            .iter()
            .any(|sent| sent.ends && !sent.rollback_only)
    }

    /// What is left of `timeout` for a `COMMIT` (or `END`, `PREPARE`) of
    /// the body's still unanswered, counted from its send, as the seal
    /// counts it (see [`Wire::bounds_commit`]): a body that returned long
    /// after sending it has had its wait. `timeout` when none is.
    pub(crate) fn left_for_commit(&self, timeout: Duration) -> Duration {
        let state = self.state();
        let sent = state.sent.iter().find(|sent| sent.commit_end);
        sent.map_or(timeout, |sent| timeout.saturating_sub(sent.at.elapsed()))
    }

    /// Whether a request sent is unanswered on a connection still open:
    /// the server may still be running it.
    pub(crate) fn running(&self) -> bool {
        !self.answered()
    }

    /// Every request sent has its answer (or the connection ended).
    fn answered(&self) -> bool {
        let state = self.state();
        state.closed || state.sent.is_empty()
    }

    /// See [`Wire::settled`].
    async fn answered_within(&self, within: Duration) -> bool {
        let until = tokio::time::Instant::now() + within;
        loop {
            let notified = self.answered.notified();
            if self.answered() {
                return true;
            }
            if tokio::time::timeout_at(until, notified).await.is_err() {
                return false;
            }
        }
    }
}
