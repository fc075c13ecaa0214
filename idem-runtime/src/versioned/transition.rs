//! `Model::update(key)...transition(from, to)`: a compare-and-set update that
//! also moves the state column along a declared edge of its state machine,
//! and tells a repeated transition from a conflict.

use diesel::pg::Pg;
use diesel::query_builder::QueryFragment;
use diesel_async::AsyncPgConnection;

use super::builder::{judge, NoChanges, Pending, TenantGiven, Update, VersionGiven, WithChanges};
use super::record::TransitionRecord;
use super::{StateMachine, Transitioned, Versioned, VersionedChanges, VersionedError};
use crate::attempt;

/// A guarded state transition of one row: `SET <changes>, <state> = to,
/// <version> = <version> + 1 WHERE <tenant, key> AND <version> = expected AND
/// <state> = from`. Made by [`Update::transition`]; await
/// [`execute`](Transition::execute).
#[must_use = "a Transition does nothing until `.execute(conn)` is awaited"]
pub struct Transition<M: Versioned, T, V, C> {
    update: Update<M, T, V, C>,
    from: M::State,
    to: M::State,
    /// `StateMachine::allowed` of the state type, taken where that bound is
    /// checked, so that a state type without one is one error, at
    /// `.transition(..)`, and not a second at `.execute(..)`.
    allowed: fn(&M::State, &M::State) -> bool,
    /// `StateMachine::as_text`, taken there too: the record of an applied
    /// transition stores the edge as the states' texts.
    as_text: fn(&M::State) -> &'static str,
}

impl<M: Versioned, T, V, C> Update<M, T, V, C> {
    /// Move the row's state from `from` to `to`, as the last step before
    /// `.execute(conn)` (after `.tenant(..)`, `.expect_version(..)` and, if
    /// other columns change too, `.set(&changes)`, which must not assign the
    /// state column itself).
    ///
    /// The state type must be a [`StateMachine`] (`#[derive(idem::States)]`).
    /// A transition its table does not list is refused with
    /// [`VersionedError::IllegalTransition`] before any SQL is sent. `from`
    /// replaces any `.expect_state(..)`. An applied transition is recorded
    /// (in the table `idem_transitions`, by the same statement; run
    /// [`migrate`](crate::migrate::migrate) first). When no row matches, it
    /// is answered [`Transitioned::Duplicate`] only if the row is in `to` at
    /// the expected version + 1 and that version was written by this very
    /// transition, `from` -> `to`, as its record says (a record names its
    /// table by oid and is bound to the transaction id of the write it made,
    /// which must still be the row's `xmin`); otherwise the error is
    /// `Stale`, `NotFound` or `StateMismatch`, as for any update.
    pub fn transition(self, from: M::State, to: M::State) -> Transition<M, T, V, C>
    where
        M::State: StateMachine,
    {
        Transition {
            update: self,
            from,
            to,
            allowed: <M::State as StateMachine>::allowed,
            as_text: <M::State as StateMachine>::as_text,
        }
    }
}

/// The changes of a transition: none besides the state, or a changeset's.
#[doc(hidden)]
pub trait TransitionChanges<M: Versioned> {
    #[doc(hidden)]
    type Changes: VersionedChanges<M> + Sync;
    #[doc(hidden)]
    fn changes(&self) -> &Self::Changes;
}

impl<M: Versioned> TransitionChanges<M> for NoChanges {
    type Changes = StateOnly;
    fn changes(&self) -> &StateOnly {
        &StateOnly
    }
}

impl<M: Versioned, C: VersionedChanges<M> + Sync> TransitionChanges<M> for WithChanges<'_, C> {
    type Changes = C;
    fn changes(&self) -> &C {
        self.get()
    }
}

/// The changeset of a transition that assigns nothing but the state; not
/// nameable outside this module, so no plain update can use it.
pub struct StateOnly;

impl<M: Versioned> VersionedChanges<M> for StateOnly {
    fn __changeset(&self) -> impl QueryFragment<Pg> + Send + Sync + '_ {}
}

impl<M: Versioned, T, V, C> Transition<M, T, V, C> {
    /// Make the transition. `Ok(Applied(row))`: written, version + 1;
    /// `Ok(Duplicate(row))`: the row's current version was written by this
    /// same transition, from the same version; `Err`: refused
    /// ([`IllegalTransition`](VersionedError::IllegalTransition), nothing
    /// sent) or matched no row for another reason (`Stale`, `NotFound`,
    /// `StateMismatch`).
    pub fn execute<'c>(self, conn: &'c mut AsyncPgConnection) -> Pending<'c, Transitioned<M>>
    where
        T: TenantGiven<M> + Send + 'c,
        V: VersionGiven + Send + 'c,
        C: TransitionChanges<M> + Send + 'c,
    {
        Pending::new(async move {
            let Transition {
                update,
                from,
                to,
                allowed,
                as_text,
            } = self;
            if !allowed(&from, &to) {
                return Err(VersionedError::IllegalTransition {
                    from: format!("{from:?}"),
                    to: format!("{to:?}"),
                });
            }
            let tenant = update.tenant.into_tenant();
            let expected = update.version.expected();
            // Only ever stored by a write that matched, at `expected`,
            // which cannot be `i64::MAX` (the bump would overflow first).
            let record = TransitionRecord::new(
                &M::table_sql(),
                expected.saturating_add(1),
                as_text(&from),
                as_text(&to),
            );
            let written = M::__transition(
                conn,
                tenant.clone(),
                update.key.clone(),
                expected,
                from.clone(),
                to.clone(),
                &record,
                update.changes.changes(),
            )
            .await?;
            if let Some(row) = written {
                return Ok(Transitioned::Applied(row));
            }
            // The read that classifies: the whole row, so that a duplicate
            // is answered with it, and in the same statement whether its
            // record says this very transition wrote its current version.
            let id = attempt::RowId::of::<M, _>(&update.key);
            let current = M::__load_made(conn, tenant, update.key, &record).await?;
            match current {
                // In `to` at the version this transition would have written:
                // a duplicate only if that version's write was this very
                // transition, which only its record can say (another edge
                // into `to`, a plain update of a row already in `to`, or a
                // row whose versions started again leaves the row looking
                // the same). Otherwise the row is at another version than
                // expected: `Stale`.
                Some((row, made))
                    if expected.checked_add(1) == Some(row.version())
                        && row.__state().as_ref() == Some(&to) =>
                {
                    if made {
                        return Ok(Transitioned::Duplicate(row));
                    }
                    let probe = Some((row.version(), row.__state()));
                    Err(judge::<M>(id, probe, expected, Some(from)))
                }
                current => {
                    let probe = current.map(|(row, _)| (row.version(), row.__state()));
                    Err(judge::<M>(id, probe, expected, Some(from)))
                }
            }
        })
    }
}

impl<M: Versioned, T, V, C> std::fmt::Debug for Transition<M, T, V, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transition")
            .field("from", &self.from)
            .field("to", &self.to)
            .finish_non_exhaustive()
    }
}
