//! A statement the body sent behind its own end of the transaction, still
//! running when the seal refuses the next write: cancelled, and its answer
//! read before the connection closes.
//!
//! Such a statement (the `INSERT` of `ROLLBACK; INSERT ..`) runs outside
//! idem's transaction and commits on its own. Closed at the refusal, the
//! connection would leave its outcome unread: idem would have to count it as
//! committed, and the cancel it sends to stop a long one (see
//! `Tx::cancel_and_discard`) would race it unseen, aborting it now and then
//! while the key stayed held over nothing. So the refusal waits, up to
//! [`STOP_WAIT`]: the request the server is running is cancelled (each
//! request once, as it comes to the front: one still in idem's transaction
//! ahead of the end too, which the end rolls back anyway), the driver reads
//! the answers, and only then is the write refused and the connection
//! closed, with the wire's marks saying whether the statement committed.
//! A request that outlasts the wait (a cancel that cannot reach the server,
//! a deferred check that ignores it, a `COPY .. FROM STDIN` waiting for the
//! data the seal holds back) is left to the close, and counts as committed
//! unless it was that `COPY`.

use std::task::Waker;
use std::time::{Duration, Instant};

use super::Wire;

/// How long the seal's refusal waits for the requests ahead of it once it
/// cancelled them: a backend stops at a cancel within milliseconds.
const STOP_WAIT: Duration = Duration::from_secs(1);

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

/// The seal's wait, from the first refusal that began it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Stop {
    since: Instant,
    /// The request (counted by the answers before it) last cancelled.
    cancelled: Option<u64>,
}

impl Wire {
    /// `token` cancels what this wire's backend runs: a statement the body
    /// sent behind its own end is stopped and read before the seal closes
    /// the connection (see the module docs). Not set behind a transaction
    /// pooler, where no cancel is sent: the refusal closes at once there.
    pub(crate) fn stops_with(&self, token: tokio_postgres::CancelToken) {
        let _ = self.stopper.token.set(token);
    }

    /// At a write the seal refuses: whether to hold it back, a statement
    /// that may commit on its own still unanswered behind the body's end
    /// (the request the server runs is cancelled, once). `waker` is woken
    /// when the wait runs out.
    pub(super) fn stops_behind_end(&self, waker: &Waker) -> bool {
        let (Some(token), Ok(runtime)) = (
            self.stopper.token.get(),
            tokio::runtime::Handle::try_current(),
        ) else {
            return false;
        };
        let mut state = self.state();
        if state.closed || state.copy_in || !state.may_commit() {
            return false;
        }
        let (now, front) = (Instant::now(), state.answers);
        let stop = state.stop.get_or_insert_with(|| {
            let waker = waker.clone();
            runtime.spawn(async move {
                tokio::time::sleep(STOP_WAIT).await;
                waker.wake();
            });
            Stop {
                since: now,
                cancelled: None,
            }
        });
        if now.saturating_duration_since(stop.since) >= STOP_WAIT {
            return false;
        }
        if stop.cancelled != Some(front) {
            stop.cancelled = Some(front);
            // One that comes after its request ended finds the backend
            // idle (ignored there), closing, or running the next request
            // of this wait's, which it is meant for anyway: the seal lets
            // nothing else out but a lone `ROLLBACK`, which writes nothing.
            crate::pool::cancel(token.clone());
        }
        true
    }
}
