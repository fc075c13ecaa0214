//! How the body's requests ended: whether it ended (or began) a
//! transaction itself, and where its requests stand once answered, or once
//! idem stopped waiting for them. What [`Tx::refuse`] and the retry loop
//! decide a body's end on.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
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
    state: Arc<EndState>,
}

/// What a transaction's watches share with it.
#[derive(Default)]
pub(crate) struct EndState {
    /// The answer when the connection left the transaction: from then on
    /// what commits is another user's (the connection back in the pool),
    /// not the body's.
    seen: OnceLock<bool>,
    /// When idem was about to send its own `COMMIT`, with the record riding
    /// on it: the ride units written by then, and what the body had
    /// committed (see [`body_committed`]).
    own_commit: OnceLock<(u64, bool)>,
    /// Dropped after its body committed by hand, the transaction was handed
    /// to its [`AfterBodyCommit`] with its connection.
    handed_off: AtomicBool,
}

impl EndWatch {
    /// The transaction committed since `BEGIN`, or a request that may
    /// commit went unanswered, up to when the connection left the
    /// transaction or idem sent its own `COMMIT` (which does not count).
    pub(crate) fn committed(&self) -> bool {
        match self.state.seen.get() {
            Some(seen) => *seen,
            None => body_committed(&self.wire, self.begun, Some(&self.state)),
        }
    }

    /// Whether the transaction, dropped after its body committed by hand,
    /// went to its [`AfterBodyCommit`] (see [`Tx::after_body_commit`]).
    pub(crate) fn handed_off(&self) -> bool {
        AtomicBool::load(&self.state.handed_off, Ordering::SeqCst)
    }
}

/// What to run, on the transaction's own connection, when a transaction is
/// dropped open after its body committed by hand: the connection's pool
/// slot stays taken until it is done (see [`Tx::after_body_commit`]).
pub(crate) type AfterBodyCommit =
    Box<dyn FnOnce(Tx) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

pub(super) fn committed_since(wire: &Wire, begun: Marks) -> bool {
    wire.marks().since(begun) == Some(true) || wire.unanswered_may_commit()
}

/// What the body committed, as [`committed_since`] says until idem's own
/// `COMMIT` goes out, then as it stood before (`state`'s `own_commit`):
/// what commits from there is idem's, the record riding on it. Had the
/// body sent an end of its own first (a `COMMIT` it queued in
/// tokio-postgres, written after idem looked), the seal would have held
/// idem's back (see `Wire::withheld`).
fn body_committed(wire: &Wire, begun: Marks, state: Option<&EndState>) -> bool {
    match state.and_then(|state| state.own_commit.get()) {
        Some(&(units, before)) if wire.units_sent() > units => before,
        _ => committed_since(wire, begun),
    }
}

/// Whether the body ended (or began) a transaction since `begun`, as far
/// as `wire` can tell with requests unanswered (a connection closed, or
/// idem's `ROLLBACK` unanswered): `Some(true)` when what it wrote may have
/// committed. An unanswered lone `ROLLBACK` is not counted (it may be
/// idem's own); what it ends writes nothing anyway.
pub(super) fn body_end(wire: &Wire, begun: Marks) -> Option<bool> {
    let committed = committed_since(wire, begun);
    let ended = committed
        || wire.marks().since(begun).is_some()
        || wire.unanswered_end()
        || wire.withheld();
    ended.then_some(committed)
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
    pub(crate) fn watch_end(&mut self) -> Option<EndWatch> {
        let wire = self.conn.as_ref()?.wire_arc();
        let state = self.end_state.get_or_insert_with(Default::default).clone();
        Some(EndWatch {
            wire,
            begun: self.begun,
            state,
        })
    }

    /// The connection leaves the transaction (back to the pool, or
    /// closed), or idem sends its own `COMMIT`: its watches keep what the
    /// body did until now.
    pub(super) fn close_watches(&self) {
        let wire = self.wire().or(self.lost.as_ref().map(|c| c.wire()));
        if let (Some(state), Some(wire)) = (self.end_state.as_ref(), wire) {
            let _ = state
                .seen
                .set(body_committed(wire, self.begun, Some(state)));
        }
    }

    /// idem is about to send its own `COMMIT` (see [`body_committed`]).
    pub(super) fn own_commit_next(&self) {
        if let (Some(state), Some(wire)) = (self.end_state.as_ref(), self.wire()) {
            let before = committed_since(wire, self.begun);
            let _ = state.own_commit.set((wire.units_sent(), before));
        }
    }

    /// Whether idem's own `COMMIT`, with what rides on it, went out (see
    /// [`Tx::own_commit_next`]).
    pub(super) fn own_commit_sent(&self, wire: &Wire) -> bool {
        let own = self.end_state.as_ref().and_then(|s| s.own_commit.get());
        own.is_some_and(|&(units, _)| wire.units_sent() > units)
    }

    /// Whether the body committed by hand, as the wire `wire` of this
    /// transaction says (see [`body_committed`]).
    pub(super) fn body_committed(&self, wire: &Wire) -> bool {
        body_committed(wire, self.begun, self.end_state.as_deref())
    }

    /// Run `then` with this transaction, in a task of its own, if it is
    /// dropped after its body committed by hand, before
    /// [`Tx::done_after_body_commit`]. A drop otherwise
    /// closes the connection at once, and its pool slot goes to the next
    /// caller waiting, before anything else could be written for what the
    /// body committed (a local idempotent call's key, held as outcome
    /// unknown, with its duplicates waiting on the pool).
    pub(crate) fn after_body_commit(&mut self, then: AfterBodyCommit) {
        self.after_body_commit = Some(then);
    }

    /// What [`Tx::after_body_commit`] set was done another way.
    pub(crate) fn done_after_body_commit(&mut self) {
        self.after_body_commit = None;
    }

    /// Whether the transaction lost its connection after its body committed
    /// by hand, and keeps its pool slot taken: what follows the body's
    /// commit is then written on a connection outside the pool
    /// ([`crate::pool::Pool::connect_outside`]), before the callers queued
    /// on the pool get the slot. (A body that writes after its own
    /// `COMMIT` loses its connection that way: see `Wire::guard`.)
    pub(crate) fn keeps_a_lost_slot(&self) -> bool {
        self.lost.is_some()
    }

    /// Whether something is to be written for what the body committed by
    /// hand, before its pool slot goes: it has an [`AfterBodyCommit`], or
    /// it is the transaction handed to one.
    pub(super) fn writes_after_body_commit(&self) -> bool {
        self.after_body_commit.is_some() || self.handed_off()
    }

    /// Whether this is the transaction handed to its [`AfterBodyCommit`].
    pub(super) fn handed_off(&self) -> bool {
        let state = self.end_state.as_ref();
        state.is_some_and(|s| AtomicBool::load(&s.handed_off, Ordering::SeqCst))
    }

    /// A transaction dropped open (its call dropped, or its body
    /// panicked): a request the body queued just before may still be on its
    /// way to the socket (tokio-postgres hands it to the connection's driver
    /// task, which can write it on another thread after this drop looked).
    /// Unless the wire already says the body committed, nothing more is
    /// written (the connection is closing anyway), so that what it says
    /// next is final. A `COMMIT` that got out meanwhile: left to be answered,
    /// for what follows the body's commit (see [`Tx::after_body_commit`]).
    pub(super) fn stop_writing_unless_committed(&mut self) {
        let Some(conn) = self.conn.as_ref() else {
            return;
        };
        if !self.open || !conn.holds_its_session() || self.body_committed(conn.wire()) {
            return;
        }
        // A `COMMIT` the body queued, written while this waited for the
        // write under way: not severed, so that its answer is still read.
        // The seal holds back what the body queued behind it until then
        // (see `Wire::guard`), and the hand-off reads how it ended.
        let handed_off = self.after_body_commit.is_some();
        conn.wire()
            .sever_unless(|wire| handed_off && self.body_committed(wire));
    }

    /// See [`Tx::after_body_commit`]: whether this drop handed the
    /// transaction on.
    pub(super) fn hand_off_after_body_commit(&mut self) -> bool {
        let wire = self.wire().or(self.lost.as_ref().map(|c| c.wire()));
        // As the call's watch saw it when the connection left the
        // transaction (`close_watches`, just before): a `COMMIT` then
        // unanswered is handed on, its answer read there, even when it
        // came in since. Read afresh here, a failure answered meanwhile
        // would leave the call's drop holding the key from the watch's
        // stale answer, without reading how the `COMMIT` ended.
        let seen = self.end_state.as_ref().and_then(|s| s.seen.get().copied());
        let committed = seen.unwrap_or_else(|| wire.is_some_and(|wire| self.body_committed(wire)));
        // Open (the call dropped before idem rolled back), or not (dropped
        // while `then`'s own statement was in flight: a prepare that never
        // got to run it, say).
        if !committed || !self.holds_its_session() {
            return false;
        }
        let (Some(then), Ok(runtime)) = (
            self.after_body_commit.take(),
            tokio::runtime::Handle::try_current(),
        ) else {
            return false;
        };
        if let Some(state) = self.end_state.as_ref() {
            state.handed_off.store(true, Ordering::SeqCst);
        }
        let tx = Tx {
            conn: self.conn.take(),
            open: self.open,
            timeouts: self.timeouts,
            begun: self.begun,
            unmanaged: self.unmanaged,
            opened: None,
            end_state: self.end_state.take(),
            after_body_commit: None,
            lost: self.lost.take(),
            waited: self.waited,
        };
        self.open = false;
        runtime.spawn(then(tx));
        true
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
    /// be on its way. A request unanswered then that may commit (a
    /// deferred check slower than `timeout`) is cancelled and read a second
    /// `timeout`, as [`Tx::refuse`] does, the connection kept for idem's
    /// `ROLLBACK` and the write guard up; still unanswered, it counts as
    /// committed, and nothing waits for it again.
    pub(crate) async fn ended_by_body_settled(&mut self, timeout: Duration) -> Option<bool> {
        if let Settled::MayHaveCommitted = self.settle(timeout).await? {
            self.cancel_running();
            self.waited = true;
            if let Settled::MayHaveCommitted = self.wait_settled(timeout).await? {
                return Some(true);
            }
        }
        self.ended_by_body()
    }

    /// Wait (up to `timeout`) for the body's requests still owed an answer:
    /// a statement's error arrives before the status that says what it did
    /// to the transaction, and a statement whose future the body dropped may
    /// still run. A `COMMIT` of the body's among them is given `timeout`
    /// from its send, not from now, as the seal gives it (see
    /// `Wire::bounds_commit`). `None` without a wire to ask.
    pub(super) async fn settle(&self, timeout: Duration) -> Option<Settled> {
        // Once cancelled and waited for (see `Tx::ended_by_body_settled`),
        // what is still unanswered is taken as it stands.
        let timeout = match self.wire() {
            _ if self.waited => Duration::ZERO,
            Some(wire) => wire.left_for_commit(timeout),
            None => timeout,
        };
        self.wait_settled(timeout).await
    }

    /// [`Tx::settle`], waiting `timeout` whatever was waited before.
    async fn wait_settled(&self, timeout: Duration) -> Option<Settled> {
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
