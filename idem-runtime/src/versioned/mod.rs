//! Optimistic concurrency that cannot be left out: every write names its tenant,
//! its key and the version it was computed from, and bumps the version.
//!
//! `#[derive(Versioned)]` (in the `idem` crate) implements [`Versioned`] for a
//! diesel model; everything a user calls lives here, on that trait and on the
//! builders it hands out. The typestate builders are what turns "forgot the
//! version" or "forgot the tenant" into a compile error instead of a lost update.

pub mod backstop;
mod cas;

pub use cas::CasUpdate;

use std::fmt::Debug;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll};

use diesel::pg::Pg;
use diesel::query_builder::QueryFragment;
use diesel::result::Error as DieselError;
use diesel_async::AsyncPgConnection;

use crate::attempt;

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
    /// The database refused the statement, or the connection failed.
    #[error("database error: {0}")]
    Database(#[from] DieselError),
}

impl VersionedError {
    /// Kept until the tests move to `idem::http::HttpStatus` (the one table).
    #[doc(hidden)]
    pub fn http_status(&self) -> u16 {
        match self {
            VersionedError::Stale { .. } => 412,
            VersionedError::NotFound => 404,
            VersionedError::StateMismatch { .. } => 409,
            VersionedError::Database(_) => 500,
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
    /// `.set(&changes)`, then `.execute(conn)`.
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

/// A builder state: the tenant has not been named yet.
#[derive(Debug, Default, Clone, Copy)]
pub struct TenantMissing;
/// A builder state: the model was declared `tenant = none`.
#[derive(Debug, Default, Clone, Copy)]
pub struct Untenanted;
/// A builder state: the tenant the caller is acting for.
#[derive(Debug, Clone)]
pub struct Tenant<T>(T);

/// A builder state: no expected version yet.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoExpectedVersion;
/// A builder state: the version the write was computed from.
#[derive(Debug, Clone, Copy)]
pub struct ExpectedVersion(i64);

/// A builder state: no changes yet.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoChanges;
/// A builder state: the changes to apply.
#[derive(Debug, Clone, Copy)]
pub struct WithChanges<'a, C>(&'a C);

/// Satisfied once the builder knows which tenant it acts for.
#[diagnostic::on_unimplemented(
    message = "this versioned statement names no tenant",
    label = "the tenant is missing here",
    note = "call `.tenant(..)` with the tenant the caller acts for before `.execute(..)`/`.load(..)`: without the tenant predicate the version check can pass on another tenant's row",
    note = "a table that really has no tenants says so with `#[versioned(tenant = none)]`"
)]
pub trait TenantGiven<M: Versioned> {
    #[doc(hidden)]
    fn into_tenant(self) -> M::Tenant;
}
impl<M: Versioned<Tenant = T>, T> TenantGiven<M> for Tenant<T> {
    fn into_tenant(self) -> T {
        self.0
    }
}
impl<M: Versioned<Tenant = ()>> TenantGiven<M> for Untenanted {
    fn into_tenant(self) {}
}

/// Satisfied once the builder knows the version the write was computed from.
#[diagnostic::on_unimplemented(
    message = "this versioned write has no expected version",
    label = "the expected version is missing here",
    note = "call `.expect_version(row.version)` with the version you read (or the one an `If-Match` header names): a write without it would silently overwrite (or delete) every change made since that read"
)]
pub trait VersionGiven {
    #[doc(hidden)]
    fn expected(&self) -> i64;
}
impl VersionGiven for ExpectedVersion {
    fn expected(&self) -> i64 {
        self.0
    }
}

/// Satisfied once the builder has changes to apply.
#[diagnostic::on_unimplemented(
    message = "this versioned update sets nothing",
    label = "the changes are missing here",
    note = "call `.set(&changes)` with a `#[derive(VersionedChanges)]` struct for this model"
)]
pub trait ChangesGiven<M: Versioned> {
    #[doc(hidden)]
    type Changes: VersionedChanges<M> + Sync;
    #[doc(hidden)]
    fn changes(&self) -> &Self::Changes;
}
impl<M: Versioned, C: VersionedChanges<M> + Sync> ChangesGiven<M> for WithChanges<'_, C> {
    type Changes = C;
    fn changes(&self) -> &C {
        self.0
    }
}

/// Implemented for nothing: the bound of the `.tenant(..)` that builders of a
/// `tenant = none` model carry only so that calling it explains itself (rustc
/// would otherwise point at the builder's private `tenant` field).
#[doc(hidden)]
#[diagnostic::on_unimplemented(
    message = "`{M}` is declared `#[versioned(tenant = none)]`: it has no tenant to name",
    label = "remove this `.tenant(..)`",
    note = "if the table does have a tenant column, declare it with `#[versioned(tenant = <field>)]` instead"
)]
pub trait HasTenantColumn<M> {}

/// A read of one row by tenant and key. See [`Versioned::find`].
#[must_use = "a Find does nothing until `.load(conn)` is awaited"]
pub struct Find<M: Versioned, T> {
    key: M::Key,
    tenant: T,
    _model: PhantomData<fn() -> M>,
}

impl<M: Versioned> Find<M, Untenanted> {
    #[doc(hidden)]
    pub fn tenant<X>(self, _tenant: X) -> Self
    where
        Untenanted: HasTenantColumn<M>,
    {
        self
    }
}

impl<M: Versioned> Find<M, TenantMissing> {
    /// The tenant the caller acts for; the read only sees rows of this tenant.
    pub fn tenant(self, tenant: M::Tenant) -> Find<M, Tenant<M::Tenant>> {
        Find {
            key: self.key,
            tenant: Tenant(tenant),
            _model: PhantomData,
        }
    }
}

/// The future of a versioned statement, returned by `.load(conn)` and
/// `.execute(conn)`: await it.
//
// A named type rather than an `async fn`'s opaque one: the opaque type would
// inherit the typestate bounds of its method, so a statement missing its tenant,
// version or changes would be reported three times (at the call, at the whole
// expression and at its `.await`) instead of once, at the call.
#[must_use = "a versioned statement does nothing until it is awaited"]
pub struct Pending<'c, T>(Pin<Box<dyn Future<Output = Result<T, VersionedError>> + Send + 'c>>);

impl<'c, T> Pending<'c, T> {
    fn new(fut: impl Future<Output = Result<T, VersionedError>> + Send + 'c) -> Self {
        Pending(Box::pin(fut))
    }
}

impl<T> Future for Pending<'_, T> {
    type Output = Result<T, VersionedError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.0.as_mut().poll(cx)
    }
}

impl<T> Debug for Pending<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Pending")
    }
}

// The typestate bounds sit on the methods, not on the impls: a bound on the
// impl hides the method ("exists but its trait bounds were not satisfied") and
// rustc then never shows the `on_unimplemented` text that names the fix.
impl<M: Versioned, T> Find<M, T> {
    /// Load the row: the read that supplies the expected version of the next
    /// write. Inside a `#[retryable(on_conflict = lock)]` attempt that follows a
    /// conflict, the row is read `FOR UPDATE`.
    pub fn load<'c>(self, conn: &'c mut AsyncPgConnection) -> Pending<'c, M>
    where
        T: TenantGiven<M> + Send + 'c,
    {
        Pending::new(async move {
            let lock = attempt::lock_row::<M, _>(&self.key);
            let read = attempt::row_in_attempt::<M, _>(&self.key);
            let row = M::__load(conn, self.tenant.into_tenant(), self.key, lock)
                .await?
                .ok_or(VersionedError::NotFound)?;
            if let Some(read) = read {
                attempt::note_read(read, row.version());
            }
            Ok(row)
        })
    }
}

/// A compare-and-set update of one row. See [`Versioned::update`].
#[must_use = "an Update does nothing until `.execute(conn)` is awaited"]
pub struct Update<M: Versioned, T, V, C> {
    key: M::Key,
    tenant: T,
    version: V,
    changes: C,
    from_state: Option<M::State>,
    _model: PhantomData<fn() -> M>,
}

impl<M: Versioned, V, C> Update<M, Untenanted, V, C> {
    #[doc(hidden)]
    pub fn tenant<X>(self, _tenant: X) -> Self
    where
        Untenanted: HasTenantColumn<M>,
    {
        self
    }
}

impl<M: Versioned, V, C> Update<M, TenantMissing, V, C> {
    /// The tenant the caller acts for; the update only matches rows of this tenant.
    pub fn tenant(self, tenant: M::Tenant) -> Update<M, Tenant<M::Tenant>, V, C> {
        Update {
            key: self.key,
            tenant: Tenant(tenant),
            version: self.version,
            changes: self.changes,
            from_state: self.from_state,
            _model: PhantomData,
        }
    }
}

impl<M: Versioned, T, C> Update<M, T, NoExpectedVersion, C> {
    /// The version the new values were computed from.
    pub fn expect_version(self, version: i64) -> Update<M, T, ExpectedVersion, C> {
        Update {
            key: self.key,
            tenant: self.tenant,
            version: ExpectedVersion(version),
            changes: self.changes,
            from_state: self.from_state,
            _model: PhantomData,
        }
    }
}

impl<M: Versioned, T, V> Update<M, T, V, NoChanges> {
    /// The assignments to make, besides the version bump.
    pub fn set<C: VersionedChanges<M>>(self, changes: &C) -> Update<M, T, V, WithChanges<'_, C>> {
        Update {
            key: self.key,
            tenant: self.tenant,
            version: self.version,
            changes: WithChanges(changes),
            from_state: self.from_state,
            _model: PhantomData,
        }
    }
}

impl<M: Versioned, T, V, C> Update<M, T, V, C> {
    /// Require the row to be in `state` too (`AND <state> = $from`): a guarded
    /// transition. A repeated or out-of-order transition then matches no row
    /// and is reported as [`VersionedError::StateMismatch`].
    pub fn expect_state(mut self, state: M::State) -> Self {
        self.from_state = Some(state);
        self
    }
}

impl<M: Versioned, T, V, C> Update<M, T, V, C> {
    /// Run the update and return the row as written, with its new version.
    pub fn execute<'c>(self, conn: &'c mut AsyncPgConnection) -> Pending<'c, M>
    where
        T: TenantGiven<M> + Send + 'c,
        V: VersionGiven + Send + 'c,
        C: ChangesGiven<M> + Send + 'c,
    {
        Pending::new(async move {
            let tenant = self.tenant.into_tenant();
            let expected = self.version.expected();
            let written = M::__update(
                conn,
                tenant.clone(),
                self.key.clone(),
                expected,
                self.from_state.clone(),
                self.changes.changes(),
            )
            .await?;
            match written {
                Some(row) => Ok(row),
                None => Err(classify::<M>(conn, tenant, self.key, expected, self.from_state).await),
            }
        })
    }
}

/// A guarded delete of one row. See [`Versioned::delete`].
#[must_use = "a Delete does nothing until `.execute(conn)` is awaited"]
pub struct Delete<M: Versioned, T, V> {
    key: M::Key,
    tenant: T,
    version: V,
    _model: PhantomData<fn() -> M>,
}

impl<M: Versioned, V> Delete<M, Untenanted, V> {
    #[doc(hidden)]
    pub fn tenant<X>(self, _tenant: X) -> Self
    where
        Untenanted: HasTenantColumn<M>,
    {
        self
    }
}

impl<M: Versioned, V> Delete<M, TenantMissing, V> {
    /// The tenant the caller acts for.
    pub fn tenant(self, tenant: M::Tenant) -> Delete<M, Tenant<M::Tenant>, V> {
        Delete {
            key: self.key,
            tenant: Tenant(tenant),
            version: self.version,
            _model: PhantomData,
        }
    }
}

impl<M: Versioned, T> Delete<M, T, NoExpectedVersion> {
    /// The version the decision to delete was made on.
    pub fn expect_version(self, version: i64) -> Delete<M, T, ExpectedVersion> {
        Delete {
            key: self.key,
            tenant: self.tenant,
            version: ExpectedVersion(version),
            _model: PhantomData,
        }
    }
}

impl<M: Versioned, T, V> Delete<M, T, V> {
    /// Delete the row if it is still at the expected version.
    pub fn execute<'c>(self, conn: &'c mut AsyncPgConnection) -> Pending<'c, ()>
    where
        T: TenantGiven<M> + Send + 'c,
        V: VersionGiven + Send + 'c,
    {
        Pending::new(async move {
            let tenant = self.tenant.into_tenant();
            let expected = self.version.expected();
            match M::__delete(conn, tenant.clone(), self.key.clone(), expected).await? {
                0 => Err(classify::<M>(conn, tenant, self.key, expected, None).await),
                _ => Ok(()),
            }
        })
    }
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

/// Tell apart why a guarded write matched no row, with one query.
async fn classify<M: Versioned>(
    conn: &mut AsyncPgConnection,
    tenant: M::Tenant,
    key: M::Key,
    expected: i64,
    from_state: Option<M::State>,
) -> VersionedError {
    let row = attempt::RowId::of::<M, _>(&key);
    let current = match M::__probe(conn, tenant, key).await {
        Ok(current) => current,
        Err(e) => return VersionedError::Database(e),
    };
    let err = match current {
        None => VersionedError::NotFound,
        Some((actual, _)) if actual != expected => VersionedError::Stale { expected, actual },
        Some((_, actual_state)) => match (from_state, actual_state) {
            (Some(want), Some(have)) if want != have => VersionedError::StateMismatch {
                expected: format!("{want:?}"),
                actual: format!("{have:?}"),
            },
            // Same version and state as required, yet no row matched: the row
            // changed and changed back between the write and this probe (e.g.
            // deleted and re-inserted). The write's premise is gone all the same.
            _ => VersionedError::Stale {
                expected,
                actual: expected,
            },
        },
    };
    if matches!(err, VersionedError::Stale { .. }) {
        attempt::note_stale(row, expected);
    }
    err
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
