//! A statement the body sent behind its own end of the transaction, still
//! running when the seal refuses the next write: cancelled, and its answer
//! read before the connection closes.
//!
//! Such a statement (the `INSERT` of `ROLLBACK; INSERT ..`) runs outside
//! idem's transaction and commits on its own. Closed at the refusal, the
//! connection would leave its outcome unread: idem would have to count it as
//! committed, and the cancel it sends to stop a long one (see
//! `Tx::cancel_and_discard`) would race it unseen, aborting it now and then
//! while the key stayed held over nothing. So the refusal waits: the
//! statement is cancelled at once (a long one stops; one already done is
//! not touched), the driver reads its answer, and only then is the write
//! refused and the connection closed, with the wire's marks saying whether
//! it committed. A cancel that cannot reach the server (refused, or lost)
//! leaves the write waiting as long as the statement runs: idem's own end
//! does not wait on it (it reads the wire within `commit_timeout_ms`, then
//! gives the connection up, the statement counted as committed), but a
//! body awaiting that write does.

use std::sync::atomic::Ordering;

use super::Wire;

/// The cancel token of the connection a wire watches, when a cancel can
/// reach its backend (no transaction pooler in between, see
/// `Tx::cancel_running`).
#[derive(Default)]
pub(super) struct Stopper {
    token: std::sync::OnceLock<tokio_postgres::CancelToken>,
}

impl std::fmt::Debug for Stopper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.token.get().is_some() {
            "Stopper(armed)"
        } else {
            "Stopper"
        })
    }
}

impl Wire {
    /// `token` cancels what this wire's backend runs: a statement the body
    /// sent behind its own end is stopped and read before the seal closes
    /// the connection (see the module docs). Not set behind a transaction
    /// pooler, where no cancel is sent: the refusal closes at once there.
    pub(crate) fn stops_with(&self, token: tokio_postgres::CancelToken) {
        let _ = self.stopper.token.set(token);
    }

    /// At a write the seal refuses: whether to hold it back until the
    /// answers come in, a statement that may commit on its own still
    /// running behind the body's end (cancelled now, once).
    pub(super) fn stops_behind_end(&self) -> bool {
        let Some(token) = self.stopper.token.get() else {
            return false;
        };
        if self.closed() || !self.unanswered_may_commit() {
            return false;
        }
        // A cancel that comes after the statement ended finds its backend
        // idle (and is ignored there) or reading this connection's end:
        // nothing else is written on it, the seal holding all but a lone
        // `ROLLBACK`, which writes nothing.
        if !self.stop_sent.swap(true, Ordering::AcqRel) {
            crate::pool::cancel(token.clone());
        }
        true
    }
}
