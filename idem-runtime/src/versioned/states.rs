//! State machines on a model's state column: the transitions a state type
//! allows, declared once with `#[derive(States)]`, and what a guarded
//! transition answers.

use std::fmt::Debug;
use std::io::Write;

use diesel::deserialize;
use diesel::pg::{Pg, PgValue};
use diesel::serialize::{self, IsNull, Output};

/// A state type whose allowed transitions are declared once, in code.
///
/// Implemented by `#[derive(idem::States)]` on a fieldless enum:
///
/// ```text
/// #[derive(Debug, Clone, Copy, PartialEq, Eq, idem::States)]
/// #[states(Pending => [Paid, Cancelled], Paid => [Shipped])]
/// enum OrderStatus { Pending, Paid, Shipped, Cancelled }
/// ```
///
/// The derive also maps the enum to a diesel `Text` column (each state stored
/// as its [text](StateMachine::as_text)), so it can be a `#[derive(Versioned)]`
/// model's `state = ..` field, and `Model::update(..).transition(from, to)`
/// then refuses, before any SQL, a transition the table does not list.
#[diagnostic::on_unimplemented(
    message = "`{Self}` declares no allowed transitions",
    label = "`.transition(..)` needs a state type with a declared state machine",
    note = "derive it on the state enum, `#[derive(idem::States)] #[states(Pending => [Paid, Cancelled], Paid => [Shipped])]`, and make that enum the model's `state = ..` field; `.expect_state(..)` guards a state of any type"
)]
pub trait StateMachine: Clone + Debug + PartialEq + Send + Sync + 'static {
    /// Every state, in declaration order.
    const STATES: &'static [Self];
    /// Every allowed transition `(from, to)`, in declaration order.
    const TRANSITIONS: &'static [(Self, Self)];

    /// Whether `to` may directly follow `from`.
    fn allowed(from: &Self, to: &Self) -> bool {
        Self::TRANSITIONS.iter().any(|(f, t)| f == from && t == to)
    }

    /// The states that may directly follow `from`, in declaration order.
    fn targets(from: &Self) -> impl Iterator<Item = &'static Self> {
        Self::TRANSITIONS
            .iter()
            .filter(move |(f, _)| f == from)
            .map(|(_, t)| t)
    }

    /// The text this state is stored as: the variant's name in snake case
    /// (`PendingPayment` is `pending_payment`). Stable as long as the variant
    /// keeps its name.
    fn as_text(&self) -> &'static str;

    /// The state stored as `text`, if there is one.
    fn from_text(text: &str) -> Option<Self>;
}

/// What a guarded transition did: both variants are a success, and both carry
/// the row as it is now.
///
/// An applied transition records itself (the version it wrote and the edge
/// it took, in idem's table `idem_transitions`, by the same statement). A
/// transition that matches no row is classified with one read of the row;
/// when that row is in the target state at exactly the expected version + 1
/// and its record says this same edge wrote that version, the transition is
/// [`Duplicate`](Transitioned::Duplicate): it was already made, from the same
/// version (most likely by this very request, retried), so the caller can
/// answer success and the upstream stops retrying. A row that got to that
/// state and version another way (by another declared edge into the same
/// state, by a plain update of a row already in it, or as a row whose
/// versions started again after a `TRUNCATE` or a delete) answers
/// [`Stale`](super::VersionedError::Stale) with the row's version: read it
/// again. Anything else stays an error too (`Stale`, `NotFound`,
/// `StateMismatch`). A record names its table by oid (two schemas never
/// share one) and is bound to the very write it made, the row version's
/// `xmin`: see `docs/versioned.md`.
#[derive(Debug, Clone, PartialEq)]
pub enum Transitioned<M> {
    /// This call made the transition: the row as written, version + 1.
    Applied(M),
    /// The row's current version (the expected version + 1) was written by
    /// this same transition, `from` -> `to`; nothing was written now.
    Duplicate(M),
}

impl<M> Transitioned<M> {
    /// Whether the transition had already been made.
    pub fn is_duplicate(&self) -> bool {
        matches!(self, Transitioned::Duplicate(_))
    }

    /// The row, whichever way it got into its state.
    pub fn row(&self) -> &M {
        match self {
            Transitioned::Applied(row) | Transitioned::Duplicate(row) => row,
        }
    }

    /// The row, whichever way it got into its state.
    pub fn into_row(self) -> M {
        match self {
            Transitioned::Applied(row) | Transitioned::Duplicate(row) => row,
        }
    }
}

/// Writes a state as its text, for the `ToSql<Text, Pg>` the derive emits.
#[doc(hidden)]
pub fn state_to_sql<S: StateMachine>(state: &S, out: &mut Output<'_, '_, Pg>) -> serialize::Result {
    out.write_all(state.as_text().as_bytes())?;
    Ok(IsNull::No)
}

/// Reads a state from its text, for the `FromSql<Text, Pg>` the derive emits.
#[doc(hidden)]
pub fn state_from_sql<S: StateMachine>(value: PgValue<'_>) -> deserialize::Result<S> {
    let text = std::str::from_utf8(value.as_bytes())?;
    S::from_text(text).ok_or_else(|| {
        format!(
            "`{text}` is not a state of `{}`; its states are {}",
            std::any::type_name::<S>(),
            S::STATES
                .iter()
                .map(|s| format!("`{}`", s.as_text()))
                .collect::<Vec<_>>()
                .join(", ")
        )
        .into()
    })
}
