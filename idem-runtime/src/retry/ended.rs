//! The loop's answer to a body that ended (or began) the transaction
//! itself: `TransactionEnded`, never replayed, and the attempt kept when
//! what the body wrote was committed, for what must follow it.

use std::ops::ControlFlow;

use super::attempt::Attempt;
use super::run::RetryLoop;
use crate::error::{Error, FromIdemError};

impl RetryLoop<'_> {
    /// Whether the call was answered `TransactionEnded { committed: true }`:
    /// the body ended the transaction itself, and what it had written was
    /// (or may have been) committed without anything of idem's that rides
    /// on idem's own `COMMIT` (a local idempotent call's record). Not when
    /// that record rode on the body's `COMMIT` after all (the same text,
    /// queued), committed with its writes: the record is what a repeat finds.
    pub fn body_committed(&self) -> bool {
        self.body_ended == Some(true) && !self.recorded
    }

    /// Whether the call was answered `TransactionEnded { committed }`: the
    /// body ended the transaction itself (`Some(committed)`). A final error
    /// it returned then is neither stored nor the answer.
    pub fn body_ended(&self) -> Option<bool> {
        self.body_ended
    }

    /// Whether the call was answered `ConnectionReplaced`: the body swapped
    /// its connection, and what it wrote through the one it swapped in, or
    /// on the one it took away, idem cannot see; it may have committed. A
    /// delivery or run again would swap again, and write again.
    pub(crate) fn connection_replaced(&self) -> bool {
        self.replaced
    }

    /// The attempt whose body committed by hand ([`Self::body_committed`]),
    /// rolled back, with its connection if it kept one: a write that must
    /// precede the callers waiting on the pool goes there (see
    /// [`Attempt::run_alone`]).
    pub(crate) fn take_ended(&mut self) -> Option<Attempt> {
        self.ended.take()
    }

    /// The answer to a body that ended the transaction itself, its
    /// attempt (rolled back) kept when the body committed.
    pub(super) fn ended_by_body<T, E: FromIdemError>(
        &mut self,
        committed: bool,
        attempt: Attempt,
    ) -> ControlFlow<Result<T, E>> {
        let outcome = self.answer_ended(committed);
        self.keep_ended(attempt, outcome)
    }

    pub(super) fn answer_ended<T, E: FromIdemError>(
        &mut self,
        committed: bool,
    ) -> ControlFlow<Result<T, E>> {
        self.body_ended = Some(committed);
        self.done(
            Err(E::from(Error::TransactionEnded { committed })),
            "ended_by_body",
        )
    }

    /// `outcome`, keeping `attempt` for [`Self::take_ended`] if its body
    /// committed by hand.
    pub(super) fn keep_ended<O>(&mut self, attempt: Attempt, outcome: O) -> O {
        if self.body_committed() {
            self.ended = Some(attempt);
        }
        outcome
    }
}
