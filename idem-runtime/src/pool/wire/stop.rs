//! A write the seal refused, held back while a request ahead of it is
//! still running: a statement the body sent behind its own end of the
//! transaction, or the body's own `COMMIT`. Cancelled when it may be, and
//! its answer read before the connection closes.
//!
//! A statement behind the end (the `INSERT` of `ROLLBACK; INSERT ..`) runs
//! outside idem's transaction and commits on its own. Closed at the
//! refusal, the connection would leave its outcome unread: idem would have
//! to count it as committed, and the cancel it sends to stop a long one
//! (see `Tx::cancel_and_discard`) would race it unseen, aborting it now and
//! then while the key stayed held over nothing. So the refusal waits, up to
//! [`STOP_WAIT`]: the request the server is running is cancelled (each
//! request as it comes to the front, and once more when it was written
//! too recently for the backend to have read it, where a cancel is lost,
//! see [`CANCEL_AGAIN`]; one still in idem's transaction ahead of the end
//! too, which the end rolls back anyway), the driver reads
//! the answers, and only then is the write refused and the connection
//! closed, with the wire's marks saying whether the statement committed.
//!
//! The body's own `COMMIT` (or `END`, `PREPARE TRANSACTION`) is given the
//! attempt's `commit_timeout_ms` first, counted from when it was sent, as
//! idem's own is (see [`Wire::bounds_commit`]): a deferred check may take
//! that long, and closed earlier, the `COMMIT` would be left to run or be
//! lost, unknown. Past it, it is cancelled and waited for as long again,
//! as `Tx::cancel_and_read` waits for one once the body returned. Not
//! cancelled with a synchronous standby, where a cancel turns the wait for
//! the standby into a local commit, visible and not replicated, nor behind
//! a transaction pooler: only waited for. (Nor, with a synchronous
//! standby, a statement behind the end, whose own commit waits for it: the
//! refusal closes at once there, as behind a pooler.)
//!
//! A request that outlasts the wait (a cancel that cannot reach the server,
//! a deferred check that ignores it) is left to the close, and counts as
//! committed. A `COPY .. FROM STDIN` waiting for the data the seal holds
//! back ends the wait at once: the backend ignores a cancel there, and
//! closed, nothing of it or behind it runs.

use std::task::Waker;
use std::time::{Duration, Instant};

use super::{State, Wire};

/// How long the seal's refusal waits for the requests ahead of it once it
/// cancelled them: a backend stops at a cancel within milliseconds.
const STOP_WAIT: Duration = Duration::from_secs(1);

/// A cancel sent within this long of its request's write is sent again
/// once the request is this old: one that reaches the backend while it is
/// still reading the request is ignored there, and the request would run
/// on to the end of the wait. Only once: a request the backend runs stops
/// at the first cancel it gets, or was written to ignore cancels.
const CANCEL_AGAIN: Duration = Duration::from_millis(200);

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

/// The refused write's wait (see the module docs), reset with the guard.
#[derive(Debug, Default)]
pub(super) struct Waits {
    /// How long the body's own `COMMIT` may hold a refused write back, and
    /// whether what the seal waits for may be cancelled: the attempt's (see
    /// [`Wire::bounds_commit`]). Without one, the write waits for the
    /// `COMMIT`'s answer.
    bound: Option<CommitBound>,
    /// The wait once the first cancel went out.
    stop: Option<Stop>,
    /// When the timer set last wakes the refused write.
    timer: Option<Instant>,
    /// A write is held back now.
    holding: bool,
}

impl Waits {
    /// A new transaction is guarded: its waits start afresh, under the same
    /// attempt's bound.
    pub(super) fn reset(&mut self) {
        self.stop = None;
        self.timer = None;
        self.holding = false;
    }
}

#[derive(Debug, Clone, Copy)]
struct CommitBound {
    timeout: Duration,
    cancel: bool,
}

/// The wait past the body's `COMMIT`'s bound, or from the first cancel of
/// a statement behind the end.
#[derive(Debug, Clone, Copy)]
struct Stop {
    since: Instant,
    /// How long the cancelled requests are waited for.
    wait: Duration,
    /// The request (counted by the answers before it) last cancelled, and
    /// when.
    cancelled: Option<(u64, Instant)>,
}

impl Wire {
    /// `token` cancels what this wire's backend runs: a statement the body
    /// sent behind its own end is stopped and read before the seal closes
    /// the connection (see the module docs). Not set behind a transaction
    /// pooler, where no cancel is sent: a refusal behind such a statement
    /// closes at once there, one behind the body's `COMMIT` only waits.
    pub(crate) fn stops_with(&self, token: tokio_postgres::CancelToken) {
        let _ = self.stopper.token.set(token);
    }

    /// An attempt's: a refused write waits up to `timeout` from its send
    /// for a `COMMIT` of the body's, then cancels it when `cancel` (not
    /// with a synchronous standby) and waits as long again.
    pub(crate) fn bounds_commit(&self, timeout: Duration, cancel: bool) {
        self.state().waits.bound = Some(CommitBound { timeout, cancel });
    }

    /// At a write the seal refuses: whether to hold it back, a request
    /// still running ahead of it that may commit (see the module docs).
    /// `waker` is woken when the wait runs out.
    pub(super) fn holds_refused(&self, waker: &Waker) -> bool {
        let mut state = self.state();
        let holds = hold(self.stopper.token.get(), &mut state, waker);
        state.waits.holding = holds;
        holds
    }

    /// Whether the seal holds a write back now (see
    /// [`Wire::holds_refused`]): nothing after it has gone out (idem's own
    /// `COMMIT` behind the body's, say), and what it waits for is answered,
    /// or cancelled and answered, within its bound.
    pub(crate) fn holds_a_write(&self) -> bool {
        self.state().waits.holding
    }
}

/// See [`Wire::holds_refused`]; `token` cancels what the backend runs.
fn hold(token: Option<&tokio_postgres::CancelToken>, state: &mut State, waker: &Waker) -> bool {
    if state.closed || state.copy_in {
        return false;
    }
    let now = Instant::now();
    let commit = state.sent.iter().find(|sent| sent.commit_end).map(|s| s.at);
    // Neither cancelled with a synchronous standby: a statement behind the
    // end commits on its own, and waits for the standby too.
    let cancel = state.waits.bound.is_none_or(|bound| bound.cancel);
    let wait = match commit {
        Some(sent) => {
            let Some(bound) = state.waits.bound else {
                return true;
            };
            let due = sent + bound.timeout;
            if now < due {
                return wake_at(&mut state.waits, due, waker);
            }
            // Read for as long again, cancelled or not, as
            // `Tx::cancel_and_read` reads a `COMMIT` of the body's once it
            // returned: closed, a pooler would take the backend down with
            // the client, the `COMMIT` with it, while it counted as
            // committed.
            bound.timeout
        }
        None if state.may_commit() => STOP_WAIT,
        None => return false,
    };
    let token = token.filter(|_| cancel);
    if token.is_none() && commit.is_none() {
        return false;
    }
    let front = state.answers;
    let stop = *state.waits.stop.get_or_insert(Stop {
        since: now,
        wait,
        cancelled: None,
    });
    let until = stop.since + stop.wait;
    if now >= until {
        return false;
    }
    // The front request is cancelled as it comes to the front, and once
    // more when that cancel went out so soon after the request was written
    // that the backend may not have read it yet (see `CANCEL_AGAIN`).
    let written = state.sent.front().map(|sent| sent.at);
    let again = |at: Instant| {
        written
            .filter(|written| at < *written + CANCEL_AGAIN)
            .map(|written| written + CANCEL_AGAIN)
    };
    let due = match stop.cancelled {
        Some((request, at)) if request == front => again(at),
        _ => Some(now),
    };
    let cancel = token.filter(|_| due.is_some_and(|due| now >= due));
    let later = if cancel.is_some() { again(now) } else { due };
    let next = match (token, later) {
        (Some(_), Some(later)) => until.min(later),
        _ => until,
    };
    if !wake_at(&mut state.waits, next, waker) {
        return false;
    }
    if let Some(token) = cancel {
        state.waits.stop = Some(Stop {
            cancelled: Some((front, now)),
            ..stop
        });
        // One that comes after its request ended finds the backend idle
        // (ignored there), closing, or running the next request of this
        // wait's, which it is meant for anyway: the seal lets nothing else
        // out but a lone `ROLLBACK`, which writes nothing.
        crate::pool::cancel(token.clone());
    }
    true
}

/// Wake the refused write at `at`, once per instant: false outside a
/// runtime, where no timer can be set (the write is refused at once).
fn wake_at(waits: &mut Waits, at: Instant, waker: &Waker) -> bool {
    if waits.timer == Some(at) {
        return true;
    }
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return false;
    };
    waits.timer = Some(at);
    let waker = waker.clone();
    runtime.spawn(async move {
        tokio::time::sleep_until(at.into()).await;
        waker.wake();
    });
    true
}
