//! The typestate builders [`Versioned`]'s methods hand out: a read, an
//! update, a delete, each of which only compiles once it names its tenant,
//! its expected version and (for an update) its changes; and the one query
//! that tells apart why a guarded write matched no row.

use std::fmt::Debug;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll};

use diesel_async::AsyncPgConnection;

use super::{Probe, Versioned, VersionedChanges, VersionedError};
use crate::attempt;

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

impl<'a, C> WithChanges<'a, C> {
    pub(super) fn get(&self) -> &'a C {
        self.0
    }
}

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
    pub(super) key: M::Key,
    pub(super) tenant: T,
    pub(super) _model: PhantomData<fn() -> M>,
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
    pub(super) fn new(fut: impl Future<Output = Result<T, VersionedError>> + Send + 'c) -> Self {
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
    pub(super) key: M::Key,
    pub(super) tenant: T,
    pub(super) version: V,
    pub(super) changes: C,
    pub(super) from_state: Option<M::State>,
    pub(super) _model: PhantomData<fn() -> M>,
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
    pub(super) key: M::Key,
    pub(super) tenant: T,
    pub(super) version: V,
    pub(super) _model: PhantomData<fn() -> M>,
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

/// Tell apart why a guarded write matched no row, with one query.
async fn classify<M: Versioned>(
    conn: &mut AsyncPgConnection,
    tenant: M::Tenant,
    key: M::Key,
    expected: i64,
    from_state: Option<M::State>,
) -> VersionedError {
    let row = attempt::RowId::of::<M, _>(&key);
    match M::__probe(conn, tenant, key).await {
        Ok(current) => judge::<M>(row, current, expected, from_state),
        Err(e) => VersionedError::Database(e),
    }
}

/// Why a guarded write matched no row, given the row's version and state as
/// the one probe read them (`None`: no such row in this tenant).
pub(super) fn judge<M: Versioned>(
    row: attempt::RowId,
    current: Option<Probe<M::State>>,
    expected: i64,
    from_state: Option<M::State>,
) -> VersionedError {
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
