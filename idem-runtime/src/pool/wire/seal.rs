//! The seal and the sever: how a connection stops writing once a body
//! ended idem's transaction ([`Wire::guard`]), and how one a body took away
//! is closed from outside its driver ([`Wire::sever`]).

use std::sync::atomic::Ordering;
use std::sync::MutexGuard;
use std::task::Waker;

use super::{Marks, State, Wire};

impl Wire {
    /// From now until `None`, watch the transaction open since `begun`
    /// (the marks when its `BEGIN` was answered): once a request that ends
    /// it goes out (a body's own `COMMIT`, `ROLLBACK`, `ROLLBACK AND CHAIN`,
    /// `PREPARE TRANSACTION`), or the server says it ended or another began
    /// (a `BEGIN`), nothing more is written but a lone `ROLLBACK`. The next
    /// write fails, and the connection with it: what a body sends after
    /// ending idem's transaction would run outside it, in a transaction of
    /// its own that commits, or in a chained one without idem's bounds. The
    /// attempt fails either way (see [`crate::tx::Tx::ended_by_body`]); this
    /// keeps it from writing more, whether the body sends it, or had queued
    /// it in tokio-postgres before it returned (written by the driver
    /// later). What was sent in the same request as the end, or the same
    /// write, still runs.
    ///
    /// idem keeps its guard up through its own end: its `ROLLBACK` goes
    /// out behind whatever the body queued (which the seal stops, if it
    /// came after an end), so that its answer says where the body left the
    /// transaction; its `COMMIT`, and what rides on it, never go out behind
    /// an end of the body's (see [`Wire::withheld`]).
    pub(crate) fn guard(&self, begun: Option<Marks>) {
        let mut state = self.state();
        state.guard = begun;
        state.waits.reset();
        self.guarded.store(begun.is_some(), Ordering::Release);
        self.reseal(&state);
    }

    /// Seal the connection if the guarded transaction is over, unseal it
    /// when nothing is guarded.
    pub(super) fn reseal(&self, state: &State) {
        let over = state.guard.is_some_and(|begun| {
            state.marks.since(begun).is_some() || state.sent.iter().any(|s| s.ends)
        });
        self.sealed.store(over, Ordering::Release);
    }

    /// Close the connection from outside its driver: its next read fails,
    /// at once if it waits for one, and so does its next write. For a
    /// connection a body took away from the slot idem lent it in (see
    /// [`crate::pool`]'s identity check): idem's transaction, open on it,
    /// and its locks end with it, wherever it is now held, even idle in a
    /// pool's queue.
    ///
    /// Once this returns, what the wire says of the requests sent is final:
    /// a write the driver has under way on another thread (a request the
    /// body queued in tokio-postgres before it was dropped, a `COMMIT`
    /// say) is finished and counted first, and none starts after.
    pub(crate) fn sever(&self) {
        self.sever_unless(|_| false);
    }

    /// [`Wire::sever`], unless `spare` says otherwise of the wire once a
    /// write under way is counted (and before another starts): whether it
    /// severed.
    pub(crate) fn sever_unless(&self, spare: impl FnOnce(&Wire) -> bool) -> bool {
        let writing = self.writing();
        if spare(self) {
            return false;
        }
        self.severed.store(true, Ordering::Release);
        drop(writing);
        let waiting = self.reader.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(waker) = waiting {
            waker.wake();
        }
        true
    }

    /// Held through a write and its count: see [`Wire::sever`].
    pub(super) fn writing(&self) -> MutexGuard<'_, ()> {
        self.writing.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn severed(&self) -> bool {
        self.severed.load(Ordering::Acquire)
    }

    /// The stream waits for the socket to be readable: a sever wakes it.
    pub(super) fn waits_to_read(&self, waker: &Waker) {
        let mut reader = self.reader.lock().unwrap_or_else(|p| p.into_inner());
        if !reader.as_ref().is_some_and(|w| w.will_wake(waker)) {
            *reader = Some(waker.clone());
        }
    }

    /// Whether a transaction is guarded (see [`Wire::guard`]).
    pub(super) fn guarded(&self) -> bool {
        self.guarded.load(Ordering::Acquire)
    }

    /// Whether nothing more may be written (see [`Wire::guard`]).
    pub(super) fn sealed(&self) -> bool {
        self.sealed.load(Ordering::Acquire)
    }

    /// The seal refused a write (see [`Wire::guard`]) and the connection
    /// ends. What was sent before it stays counted as sent: a request
    /// written behind the end in the same write (its answer will not be
    /// read now) counts as committed ([`Wire::unanswered_may_commit`]).
    /// `lone_commit`: what it refused was a lone `COMMIT` (idem's own).
    pub(super) fn on_sealed(&self, lone_commit: bool) {
        let mut state = self.state();
        state.withheld = true;
        state.withheld_commit = lone_commit;
        drop(state);
        self.on_closed();
    }

    /// Whether the write the seal refused was a lone `COMMIT`, nothing of
    /// the body's with it.
    pub(crate) fn withheld_only_a_commit(&self) -> bool {
        self.state().withheld_commit
    }

    /// Whether the seal refused a write: the request it held (idem's own
    /// `COMMIT`, say) never went out, because the body had sent an end of
    /// the transaction first.
    pub(crate) fn withheld(&self) -> bool {
        self.state().withheld
    }
}
