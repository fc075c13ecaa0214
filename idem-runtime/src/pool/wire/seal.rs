//! The seal and the sever: how a connection stops writing once a body
//! ended idem's transaction ([`Wire::guard`]), and how one a body took away
//! is closed from outside its driver ([`Wire::sever`]).

use std::sync::atomic::Ordering;
use std::sync::MutexGuard;
use std::task::Waker;

use super::{Marks, State, Wire};

impl Wire {
    /// From now until `None`, watch the transaction open since `begun`
    /// (the marks when its `BEGIN` was answered): once the server says it
    /// ended or another began (a body's own `COMMIT`, `ROLLBACK`, `ROLLBACK
    /// AND CHAIN`, `PREPARE TRANSACTION`, `BEGIN`), nothing more is written.
    /// The next write fails, and the connection with it: what a body sends
    /// after ending idem's transaction would run outside it, in a
    /// transaction of its own that commits, or in a chained one without
    /// idem's bounds. The attempt fails either way (see
    /// [`crate::tx::Tx::ended_by_body`]); this keeps it from writing more.
    /// What was sent before the server answered the end (in the same
    /// request, or pipelined behind it) still runs (see `Wire::on_sealed`);
    /// the attempt's rollback cancels it, finding the connection closed
    /// (see [`crate::tx::Tx::roll_back`]).
    pub(crate) fn guard(&self, begun: Option<Marks>) {
        let mut state = self.state();
        state.guard = begun;
        self.reseal(&state);
    }

    /// Seal the connection if the guarded transaction is over, unseal it
    /// when nothing is guarded.
    pub(super) fn reseal(&self, state: &State) {
        let over = state
            .guard
            .is_some_and(|begun| state.marks.since(begun).is_some());
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
        let writing = self.writing();
        self.severed.store(true, Ordering::Release);
        drop(writing);
        let waiting = self.reader.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(waker) = waiting {
            waker.wake();
        }
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

    /// Whether nothing more may be written (see [`Wire::guard`]).
    pub(super) fn sealed(&self) -> bool {
        self.sealed.load(Ordering::Acquire)
    }

    /// The seal refused a write (see [`Wire::guard`]) and the connection
    /// ends. A request sent before the server answered the end (pipelined
    /// behind it) may have run outside any transaction and committed; its
    /// answer will not be read now, so it counts as committed.
    pub(super) fn on_sealed(&self) {
        let mut state = self.state();
        if !state.sent.is_empty() {
            state.marks.commits += 1;
        }
        drop(state);
        self.on_closed();
    }
}
