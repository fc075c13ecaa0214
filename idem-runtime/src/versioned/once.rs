//! Create-once on a model's own unique key: seed 003's first layer of
//! idempotency, where a repeated create is refused by the database's unique
//! index and the caller gets the row that is already there.
//!
//! `#[versioned(.., create_once(key = request_id, fingerprint(id, amount)))]`
//! declares the key columns (with the tenant, the unique index the database
//! must hold) and the fields a repeat must match; `row.create_once(conn)`
//! ([`Versioned::create_once`]) sends one statement when the key is new:
//!
//! ```sql
//! INSERT INTO orders (..) VALUES (..) ON CONFLICT DO NOTHING RETURNING ..
//! ```
//!
//! and only when it wrote nothing, a second one that reads the row under the
//! key and compares the declared fields in SQL (`IS NOT DISTINCT FROM`).
//!
//! Why `ON CONFLICT DO NOTHING` without a conflict target: with a target,
//! PostgreSQL treats the table's other unique indexes as ordinary ones, and
//! two racers inserting the same key and the same primary key can meet on the
//! primary key first, where the loser gets a unique violation (23505) and an
//! aborted transaction instead of the winner's row. Without a target every
//! unique index is an arbiter: the loser waits for the winner, writes
//! nothing, and reads the row. The price is that the database no longer
//! proves the key's index exists on every statement, so idem checks it
//! itself, once per model and process, before the first create
//! ([`check_create_once`]).
//!
//! Isolation: at READ COMMITTED the read after a conflict takes a new
//! snapshot and sees the winner. At REPEATABLE READ and SERIALIZABLE
//! PostgreSQL refuses the conflict with a serialization failure (40001) when
//! the winner is not visible to the transaction's snapshot; the retry loop
//! replays the transaction, whose new snapshot sees it.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};

use diesel::result::Error as DieselError;
use diesel::sql_types::{Array, Bool, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use super::Versioned;

/// What [`Versioned::create_once`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Creation<M> {
    /// This call inserted the row (at version 0), as returned by the database.
    Created(M),
    /// A row with this key was already there in this tenant, with the same
    /// declared fields: the request is a repeat, and this is that row as it
    /// is now (it may have been updated since it was created).
    Existing(M),
}

impl<M> Creation<M> {
    /// The row, created or found.
    pub fn row(&self) -> &M {
        match self {
            Creation::Created(row) | Creation::Existing(row) => row,
        }
    }

    /// The row, created or found.
    pub fn into_row(self) -> M {
        match self {
            Creation::Created(row) | Creation::Existing(row) => row,
        }
    }

    /// Whether this call inserted the row.
    pub fn is_created(&self) -> bool {
        matches!(self, Creation::Created(_))
    }
}

/// Why [`Versioned::create_once`] created nothing and found no repeat.
/// Nothing was written in every case.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CreateOnceError {
    /// The key is taken in this tenant by a row whose declared fields differ:
    /// the key was reused for another request (HTTP 422, as the IETF
    /// `Idempotency-Key` draft answers a key reused with another payload).
    #[error("the idempotency key is already used in this tenant by a row whose {} differ from this request's; a key names one request: send a new key for a new request", fields.join(", "))]
    Mismatch {
        /// The declared fields that differ (field names, not values).
        fields: Vec<&'static str>,
    },
    /// The row could not be inserted because another row holds one of its
    /// unique values (its primary key, another unique column), and no row
    /// holds its key in this tenant (HTTP 409).
    #[error("another row already holds one of this row's unique values (not its idempotency key); nothing was written")]
    Conflict,
    /// A column of the key (or the tenant) is NULL: NULLs never collide in a
    /// unique index, so such a row could be created any number of times.
    /// Give the key, or insert the row with `insert`.
    #[error("the idempotency key is missing (a key column or the tenant is NULL), and a row without a key cannot be created once; give the key, or use `insert`")]
    MissingKey,
    /// The table has no unique index on exactly the tenant and key columns,
    /// so the database would not stop a second row with the same key.
    #[error("{table} has no unique index on exactly ({}), so a repeated create would not be stopped; add `CREATE UNIQUE INDEX ON {table} ({})` (not partial, not deferrable)", columns.join(", "), columns.join(", "))]
    NoUniqueIndex {
        /// The table, as SQL names it.
        table: String,
        /// The columns the index must cover: the tenant (if any), then the key.
        columns: Vec<&'static str>,
    },
    /// The database refused a statement, or the connection failed. A
    /// serialization failure here (a concurrent create at REPEATABLE READ or
    /// SERIALIZABLE) is transient: `#[retryable]` replays it.
    #[error("database error: {0}")]
    Database(#[from] DieselError),
}

impl crate::cause::Transient for CreateOnceError {
    fn transient(&self) -> Option<crate::cause::RetryCause> {
        match self {
            CreateOnceError::Database(e) => crate::cause::Transient::transient(e),
            CreateOnceError::Mismatch { .. }
            | CreateOnceError::Conflict
            | CreateOnceError::MissingKey
            | CreateOnceError::NoUniqueIndex { .. } => None,
        }
    }
}

/// A model that can be created once per idempotency key: what
/// `create_once(..)` in `#[versioned(..)]` implements (never by hand). Its
/// methods are the generated statements that [`Versioned::create_once`]
/// calls.
///
/// ```
/// use idem::Versioned;
///
/// diesel::table! {
///     orders (tenant_id, id) {
///         tenant_id -> Int8,
///         id -> Int8,
///         request_id -> Text,
///         amount -> Int8,
///         version -> Int8,
///     }
/// }
///
/// // The table needs `UNIQUE (tenant_id, request_id)`: the tenant, then the key.
/// #[derive(Debug, Clone, diesel::Queryable, diesel::Selectable, Versioned)]
/// #[diesel(table_name = orders)]
/// #[versioned(tenant = tenant_id, key = id,
///             create_once(key = request_id, fingerprint(id, amount)))]
/// struct Order {
///     tenant_id: i64,
///     id: i64,
///     request_id: String,
///     amount: i64,
///     version: i64,
/// }
///
/// assert_eq!(<Order as idem::versioned::CreateOnceModel>::ONCE_COLUMNS, ["tenant_id", "request_id"]);
/// assert_eq!(<Order as idem::versioned::CreateOnceModel>::ONCE_FIELDS, ["id", "amount"]);
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` declares no create-once key",
    label = "`create_once` needs the model's idempotency key",
    note = "declare it on the model: #[versioned(.., create_once(key = <field>, fingerprint(<fields a repeat must match>)))], with a unique index on the tenant and key columns"
)]
pub trait CreateOnceModel: Versioned {
    /// The SQL names of the tenant column (unless `tenant = none`) and the
    /// key columns: what the unique index must cover.
    const ONCE_COLUMNS: &'static [&'static str];
    /// The names of the `fingerprint(..)` fields, in order.
    const ONCE_FIELDS: &'static [&'static str];

    #[doc(hidden)]
    /// Set once this model's unique index was found in this process.
    fn __once_checked() -> &'static AtomicBool;

    #[doc(hidden)]
    /// Whether a key column or the tenant is `None`.
    fn __once_key_missing(&self) -> bool;

    #[doc(hidden)]
    /// `INSERT .. ON CONFLICT DO NOTHING RETURNING ..`: the row if inserted.
    fn __once_insert<'c>(
        &'c self,
        conn: &'c mut AsyncPgConnection,
    ) -> impl Future<Output = Result<Option<Self>, DieselError>> + Send + 'c;

    #[doc(hidden)]
    /// The row under this row's tenant and key, with one flag per
    /// `fingerprint(..)` field: whether it equals this row's value.
    fn __once_read<'c>(
        &'c self,
        conn: &'c mut AsyncPgConnection,
    ) -> impl Future<Output = Result<Option<(Self, Vec<bool>)>, DieselError>> + Send + 'c;
}

/// What a create-once answers.
type Answer<M> = Result<Creation<M>, CreateOnceError>;
type Run<'c, M> = std::pin::Pin<Box<dyn Future<Output = Answer<M>> + Send + 'c>>;

/// A create-once of one row on one connection, from
/// [`Versioned::create_once`]; `.await` it.
#[must_use = "a create_once does nothing until it is awaited"]
pub struct CreateOnce<'c, M> {
    row: &'c M,
    conn: &'c mut AsyncPgConnection,
    // Chosen where `M: CreateOnceModel` is known, so that awaiting needs no
    // bound: a model without `create_once(..)` gets one error, at the call,
    // naming the declaration (not a second one saying it is no future).
    run: fn(&'c M, &'c mut AsyncPgConnection) -> Run<'c, M>,
}

impl<'c, M: CreateOnceModel> CreateOnce<'c, M> {
    pub(super) fn new(row: &'c M, conn: &'c mut AsyncPgConnection) -> Self {
        CreateOnce {
            row,
            conn,
            run: |row, conn| Box::pin(create_once(row, conn)),
        }
    }
}

impl<'c, M> std::future::IntoFuture for CreateOnce<'c, M> {
    type Output = Answer<M>;
    type IntoFuture = Run<'c, M>;

    fn into_future(self) -> Self::IntoFuture {
        (self.run)(self.row, self.conn)
    }
}

/// The body of [`Versioned::create_once`].
async fn create_once<M: CreateOnceModel>(
    row: &M,
    conn: &mut AsyncPgConnection,
) -> Result<Creation<M>, CreateOnceError> {
    if row.__once_key_missing() {
        return Err(CreateOnceError::MissingKey);
    }
    if !M::__once_checked().load(Ordering::Acquire) {
        check_create_once::<M>(conn).await?;
    }
    if let Some(created) = row.__once_insert(conn).await? {
        return Ok(Creation::Created(created));
    }
    // Nothing written: some unique index already holds one of the row's
    // values. This statement's fresh snapshot (READ COMMITTED) sees a winner
    // the INSERT waited for.
    match row.__once_read(conn).await? {
        Some((existing, same)) => {
            let fields: Vec<&'static str> = M::ONCE_FIELDS
                .iter()
                .zip(&same)
                .filter(|(_, same)| !**same)
                .map(|(name, _)| *name)
                .collect();
            if fields.is_empty() {
                Ok(Creation::Existing(existing))
            } else {
                tracing::debug!(table = %M::table_sql(), ?fields, "create_once: key reused for another request");
                Err(CreateOnceError::Mismatch { fields })
            }
        }
        None => Err(CreateOnceError::Conflict),
    }
}

#[derive(diesel::QueryableByName)]
struct Found {
    #[diesel(sql_type = Bool)]
    found: bool,
}

/// Checks that `M`'s table has a unique index on exactly its tenant and key
/// columns (valid, not partial, not on expressions, not deferrable), and
/// remembers it for the process. [`Versioned::create_once`] calls this
/// before the model's first create; call it at start-up to learn of a
/// missing index before the first request (and for each database, when one
/// process serves several).
///
/// # Errors
///
/// [`CreateOnceError::NoUniqueIndex`] when there is none (or the table does
/// not exist), [`CreateOnceError::Database`] when the catalog could not be
/// read.
pub async fn check_create_once<M: CreateOnceModel>(
    conn: &mut AsyncPgConnection,
) -> Result<(), CreateOnceError> {
    let table = M::table_sql();
    let columns: Vec<String> = M::ONCE_COLUMNS.iter().map(|c| (*c).to_owned()).collect();
    let found: Found = diesel::sql_query(
        "SELECT EXISTS (
             SELECT FROM pg_index i
             WHERE i.indrelid = to_regclass($1)
               AND i.indisunique AND i.indisvalid AND i.indimmediate
               AND i.indpred IS NULL AND i.indexprs IS NULL
               AND i.indnkeyatts = cardinality($2::text[])
               AND NOT EXISTS (
                   SELECT FROM generate_series(0, i.indnkeyatts - 1) AS k
                   JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[k]
                   WHERE NOT (a.attname::text = ANY ($2::text[])))
         ) AS found",
    )
    .bind::<Text, _>(&table)
    .bind::<Array<Text>, _>(&columns)
    .get_result(conn)
    .await?;
    if !found.found {
        return Err(CreateOnceError::NoUniqueIndex {
            table,
            columns: M::ONCE_COLUMNS.to_vec(),
        });
    }
    M::__once_checked().store(true, Ordering::Release);
    Ok(())
}

/// Tells a NULL key part (`Option::None`) from a value, for any field type:
/// generated code calls `(&&OnceKeyProbe(&field)).__idem_is_null()`, which
/// method resolution answers with [`OnceKeyNull`] for an `Option` and with
/// [`OnceKeyValue`] (never null) for anything else.
#[doc(hidden)]
pub struct OnceKeyProbe<'a, T: ?Sized>(pub &'a T);

/// See [`OnceKeyProbe`].
#[doc(hidden)]
pub trait OnceKeyNull {
    fn __idem_is_null(&self) -> bool;
}

impl<T> OnceKeyNull for &OnceKeyProbe<'_, Option<T>> {
    fn __idem_is_null(&self) -> bool {
        self.0.is_none()
    }
}

/// See [`OnceKeyProbe`].
#[doc(hidden)]
pub trait OnceKeyValue {
    fn __idem_is_null(&self) -> bool;
}

impl<T: ?Sized> OnceKeyValue for OnceKeyProbe<'_, T> {
    fn __idem_is_null(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The double borrow is the point: it is what generated code writes.
    #[allow(clippy::needless_borrow)]
    #[test]
    fn a_none_key_part_is_null_and_anything_else_is_not() {
        let none: Option<String> = None;
        let some = Some("k".to_owned());
        let plain = "k".to_owned();
        assert!((&&OnceKeyProbe(&none)).__idem_is_null());
        assert!(!(&&OnceKeyProbe(&some)).__idem_is_null());
        assert!(!(&&OnceKeyProbe(&plain)).__idem_is_null());
        assert!(!(&&OnceKeyProbe(&7_i64)).__idem_is_null());
    }

    #[test]
    fn creation_gives_its_row() {
        assert!(Creation::Created(1).is_created());
        assert!(!Creation::Existing(1).is_created());
        assert_eq!(*Creation::Existing(2).row(), 2);
        assert_eq!(Creation::Created(3).into_row(), 3);
    }
}
