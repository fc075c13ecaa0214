//! Optimistic concurrency that cannot be left out: every write names its tenant,
//! its key and the version it was computed from, and bumps the version.
//!
//! `#[derive(Versioned)]` (in the `idem` crate) implements [`Versioned`] for a
//! diesel model; everything a user calls lives here, on that trait and on the
//! builders it hands out. The typestate builders are what turns "forgot the
//! version" or "forgot the tenant" into a compile error instead of a lost update.

pub mod backstop;
mod builder;
mod cas;
mod once;
mod record;
mod states;
mod transition;

pub use builder::*;
pub use cas::CasUpdate;
pub use once::{
    assert_sql_equality, check_create_once, create_once_guard_sql, CreateOnce, CreateOnceError,
    CreateOnceModel, Creation, OnceGuard, OnceKeyNull, OnceKeyProbe, OnceKeyValue, SqlEquality,
};
pub use record::{JsonbArray, RecordedTransition, TransitionRecord};
pub use states::{state_from_sql, state_to_sql, StateMachine, Transitioned};
pub use transition::{Transition, TransitionChanges};

use std::fmt::Debug;
use std::future::Future;
use std::marker::PhantomData;

use diesel::pg::Pg;
use diesel::query_builder::QueryFragment;
use diesel::result::Error as DieselError;
use diesel_async::AsyncPgConnection;

/// Why a versioned write or read did not happen.
///
/// Zero rows is never success: a write whose predicates matched nothing is
/// classified with one extra query (on the conflict path only) into exactly one
/// of the first three variants.
#[derive(Debug, thiserror::Error)]
pub enum VersionedError {
    /// The row exists in this tenant, but at another version than the one the
    /// write was computed from: somebody else wrote first. Read again, recompute,
    /// and write with the new version (or answer 412 / 409).
    #[error("stale write: it was computed from version {expected}, but the row is at version {actual}; read it again and recompute")]
    Stale {
        /// The version the caller read.
        expected: i64,
        /// The version the row has now.
        actual: i64,
    },
    /// No row with this key in this tenant. A row with the same key in another
    /// tenant is reported the same way, and nothing about it is revealed.
    #[error("no such row in this tenant")]
    NotFound,
    /// The row is at the expected version but not in the expected state: the
    /// transition was already made, or is out of order.
    #[error(
        "state transition refused: it requires state {expected}, but the row is in state {actual}"
    )]
    StateMismatch {
        /// The state the transition requires (`Debug` form).
        expected: String,
        /// The state the row is in (`Debug` form).
        actual: String,
    },
    /// A `.transition(from, to)` the state machine does not allow: `to`
    /// cannot directly follow `from`. Refused before any SQL was sent.
    #[error("illegal state transition: {to} cannot follow {from}")]
    IllegalTransition {
        /// The state the transition starts from (`Debug` form).
        from: String,
        /// The state it asked for (`Debug` form).
        to: String,
    },
    /// The database refused the statement, or the connection failed.
    #[error("database error: {0}")]
    Database(#[from] DieselError),
}

impl crate::cause::Transient for VersionedError {
    fn transient(&self) -> Option<crate::cause::RetryCause> {
        match self {
            VersionedError::Stale { .. } => Some(crate::cause::RetryCause::Stale),
            VersionedError::Database(e) => crate::cause::Transient::transient(e),
            VersionedError::NotFound
            | VersionedError::StateMismatch { .. }
            | VersionedError::IllegalTransition { .. } => None,
        }
    }
}

/// An integer type that can hold a row version: `i16`, `i32` or `i64`.
#[diagnostic::on_unimplemented(
    message = "the version field of a `#[derive(Versioned)]` model must be an integer, not `{Self}`",
    label = "expected `i64`, `i32` or `i16`",
    note = "use `i64` with a `bigint NOT NULL DEFAULT 0 CHECK (version >= 0)` column (`i32`/`i16` also work)"
)]
pub trait VersionValue: Copy + Send + Sync + 'static {
    /// The version a new row starts at.
    const ZERO: Self;
    /// Widen to `i64`, the type every API of idem reports versions in.
    fn to_i64(self) -> i64;
    /// Narrow an expected version; `None` when it cannot be a version of this
    /// column (such a write can only be stale).
    fn from_i64(v: i64) -> Option<Self>;
}

macro_rules! version_value {
    ($($t:ty),*) => {$(
        impl VersionValue for $t {
            const ZERO: Self = 0;
            fn to_i64(self) -> i64 {
                self.into()
            }
            fn from_i64(v: i64) -> Option<Self> {
                <$t>::try_from(v).ok()
            }
        }
    )*};
}
version_value!(i16, i32, i64);

/// The `State` of a model declared without `state = ..`: it has no values, so a
/// state precondition cannot be written for such a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoState {}

/// A diesel model whose every write is a compare-and-set on its version column.
///
/// Implemented by `#[derive(Versioned)]`; not meant to be implemented by hand.
/// The provided methods are the whole API: [`find`](Versioned::find),
/// [`update`](Versioned::update), [`delete`](Versioned::delete) and
/// [`insert`](Versioned::insert).
pub trait Versioned: Sized + Send + Sync + 'static {
    /// The tenant column's Rust type, or `()` for `tenant = none`.
    type Tenant: Clone + Send + Sync + 'static;
    /// The key's Rust type: one field's type or a tuple of them.
    type Key: Clone + std::hash::Hash + Send + Sync + 'static;
    /// The state column's Rust type, or [`NoState`].
    type State: Clone + Debug + PartialEq + Send + Sync + 'static;
    /// Where a builder starts on the tenant: [`TenantMissing`] for tenanted
    /// models, [`Untenanted`] for `tenant = none`.
    #[doc(hidden)]
    type TenantStart: Default + Send;

    /// The table as diesel writes it in SQL: quoted, with its schema when the
    /// `table!` declares one (`"documents"`, `"app"."documents"`).
    fn table_sql() -> String;
    /// The SQL name of the version column.
    const VERSION_COLUMN: &'static str;
    /// The SQL names of the columns that say which row this is: the tenant
    /// column (unless `tenant = none`), then the key columns in declaration
    /// order. [`install_version_guard`](backstop::install_version_guard)
    /// hands them to the trigger, which refuses an UPDATE that changes one of
    /// them and keys a deleted row's last version by them.
    const IDENTITY_COLUMNS: &'static [&'static str];

    /// This row's version, widened to `i64`.
    fn version(&self) -> i64;

    /// A read by tenant and key; call `.tenant(..)` (unless `tenant = none`),
    /// then `.load(conn)`.
    fn find(key: Self::Key) -> Find<Self, Self::TenantStart> {
        Find {
            key,
            tenant: Default::default(),
            _model: PhantomData,
        }
    }

    /// A compare-and-set update; call `.tenant(..)`, `.expect_version(..)`,
    /// `.set(&changes)`, then `.execute(conn)`. A model whose state is a
    /// [`StateMachine`] can end with `.transition(from, to)` instead of (or
    /// after) `.set(..)`, then `.execute(conn)`.
    fn update(key: Self::Key) -> Update<Self, Self::TenantStart, NoExpectedVersion, NoChanges> {
        Update {
            key,
            tenant: Default::default(),
            version: NoExpectedVersion,
            changes: NoChanges,
            from_state: None,
            _model: PhantomData,
        }
    }

    /// A delete guarded like an update; call `.tenant(..)`,
    /// `.expect_version(..)`, then `.execute(conn)`.
    fn delete(key: Self::Key) -> Delete<Self, Self::TenantStart, NoExpectedVersion> {
        Delete {
            key,
            tenant: Default::default(),
            version: NoExpectedVersion,
            _model: PhantomData,
        }
    }

    /// Insert this row at version 0, whatever its version field holds, and
    /// return it as stored.
    fn insert<'c>(
        &'c self,
        conn: &'c mut AsyncPgConnection,
    ) -> impl Future<Output = Result<Self, VersionedError>> + Send + 'c {
        async move { Ok(self.__insert(conn).await?) }
    }

    /// Insert this row once per idempotency key (seed 003's first layer):
    /// `.await` it for [`Creation::Created`] when this call inserted it,
    /// [`Creation::Existing`] when a row with the same tenant and key and the
    /// same `fingerprint(..)` fields was already there (a concurrent creator
    /// is waited for), and [`CreateOnceError::Mismatch`] when the key is
    /// taken by a row with other fields. One statement when the key is new;
    /// see [`CreateOnceModel`] for the declaration and
    /// [`check_create_once`] for the unique index it needs.
    ///
    /// Inside a `#[retryable]` body at REPEATABLE READ or SERIALIZABLE, a
    /// concurrent create the snapshot cannot see is a serialization failure
    /// that the loop replays.
    fn create_once<'c>(&'c self, conn: &'c mut AsyncPgConnection) -> CreateOnce<'c, Self>
    where
        Self: CreateOnceModel,
    {
        CreateOnce::new(self, conn)
    }

    #[doc(hidden)]
    fn __insert<'c>(
        &'c self,
        conn: &'c mut AsyncPgConnection,
    ) -> impl Future<Output = Result<Self, DieselError>> + Send + 'c;

    #[doc(hidden)]
    fn __load<'c>(
        conn: &'c mut AsyncPgConnection,
        tenant: Self::Tenant,
        key: Self::Key,
        for_update: bool,
    ) -> impl Future<Output = Result<Option<Self>, DieselError>> + Send + 'c;

    /// The row's current version and state, for classifying a write that
    /// matched no row.
    #[doc(hidden)]
    fn __probe<'c>(
        conn: &'c mut AsyncPgConnection,
        tenant: Self::Tenant,
        key: Self::Key,
    ) -> impl Future<Output = Result<Option<Probe<Self::State>>, DieselError>> + Send + 'c;

    #[doc(hidden)]
    fn __update<'c, C: VersionedChanges<Self> + Sync>(
        conn: &'c mut AsyncPgConnection,
        tenant: Self::Tenant,
        key: Self::Key,
        expected: i64,
        from_state: Option<Self::State>,
        changes: &'c C,
    ) -> impl Future<Output = Result<Option<Self>, DieselError>> + Send + 'c;

    /// The guarded update of a [`Transition`]: `changes`, the state set to
    /// `to`, the version bumped, where the row is at `expected` and in `from`;
    /// in the same statement, when the row was written, `record` is upserted
    /// into `idem_transitions` under the row's identity (`__identity`).
    #[doc(hidden)]
    #[allow(clippy::too_many_arguments)]
    fn __transition<'c, C: VersionedChanges<Self> + Sync>(
        conn: &'c mut AsyncPgConnection,
        tenant: Self::Tenant,
        key: Self::Key,
        expected: i64,
        from: Self::State,
        to: Self::State,
        record: &'c TransitionRecord,
        changes: &'c C,
    ) -> impl Future<Output = Result<Option<Self>, DieselError>> + Send + 'c;

    /// The row, with whether it made the transition `record` describes: its
    /// record in `idem_transitions` has that version and edge and was
    /// written with the row's current version (`TransitionRecord::made`),
    /// read in one statement with the row.
    #[doc(hidden)]
    fn __load_made<'c>(
        conn: &'c mut AsyncPgConnection,
        tenant: Self::Tenant,
        key: Self::Key,
        record: &'c TransitionRecord,
    ) -> impl Future<Output = Result<Option<(Self, bool)>, DieselError>> + Send + 'c;

    /// The row's identity as `idem_transitions` keys it: a `JsonbArray` of
    /// the tenant (unless `tenant = none`) and the key columns, each bound
    /// with its column's SQL type.
    #[doc(hidden)]
    fn __identity(tenant: Self::Tenant, key: Self::Key) -> impl QueryFragment<Pg> + Send + Sync;

    /// This row's state, or `None` for a model without one.
    #[doc(hidden)]
    fn __state(&self) -> Option<Self::State>;

    #[doc(hidden)]
    fn __delete<'c>(
        conn: &'c mut AsyncPgConnection,
        tenant: Self::Tenant,
        key: Self::Key,
        expected: i64,
    ) -> impl Future<Output = Result<usize, DieselError>> + Send + 'c;
}

/// A row's current version and state, read to classify a write that matched
/// no row.
#[doc(hidden)]
pub type Probe<S> = (i64, Option<S>);

/// A set of column assignments for one versioned model: what
/// `#[derive(VersionedChanges)]` implements. It is deliberately not a diesel
/// `AsChangeset`, so it cannot be handed to `diesel::update` and bypass the
/// version check.
pub trait VersionedChanges<M: Versioned> {
    /// The `SET` list, without the version bump (the update always adds it).
    #[doc(hidden)]
    fn __changeset(&self) -> impl QueryFragment<Pg> + Send + Sync + '_;
}

/// How diesel writes `table` in a FROM clause, e.g. `"app"."documents"`.
#[doc(hidden)]
pub fn table_sql<T>(table: T) -> String
where
    T: diesel::QuerySource,
    T::FromClause: QueryFragment<Pg>,
{
    let mut sql = <Pg as diesel::backend::Backend>::QueryBuilder::default();
    match table.from_clause().to_sql(&mut sql, &Pg) {
        Ok(()) => diesel::query_builder::QueryBuilder::finish(sql),
        // A table's FROM clause is static text; it cannot fail to render.
        Err(_) => String::new(),
    }
}

/// Marks a column a `#[derive(VersionedChanges)]` struct may assign. The derive
/// of the model implements it for every column except the version, the tenant
/// and the key.
#[doc(hidden)]
#[diagnostic::on_unimplemented(
    message = "a changeset of `{M}` cannot assign `{Self}`",
    label = "this is the version, tenant or key column of `{M}`",
    note = "idem bumps the version itself on every update, and the tenant and key say which row is written: remove this field from the changeset"
)]
pub trait Assignable<M> {}

/// Implemented for nothing: the bound that makes a versioned changeset unusable
/// as a plain diesel changeset.
#[doc(hidden)]
#[diagnostic::on_unimplemented(
    message = "a versioned changeset cannot be applied with a plain `diesel::update`",
    label = "this changeset is `#[derive(VersionedChanges)]`",
    note = "a plain update (of one row or of the whole table) would bypass the version check; use `Model::update(key).tenant(..).expect_version(..).set(&changes).execute(conn)`"
)]
pub trait BypassesVersionCheck {}
