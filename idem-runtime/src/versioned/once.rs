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
//! nothing, and reads the row. The price is that PostgreSQL no longer proves
//! that the key has a unique index, so the INSERT proves it itself: it
//! writes the new row's version as `idem_create_once_guard('<table>'::regclass,
//! ARRAY[<tenant and key columns>])` (migrations 16 and 17), an IMMUTABLE
//! function of constants that PostgreSQL evaluates when it plans the
//! statement and again whenever the table's indexes or the search_path
//! change, and that raises unless the planner, planning `ON CONFLICT
//! (<tenant and key>)` with the catalog the INSERT is planned with (not an
//! older snapshot's), finds the index. So the check costs nothing per call
//! and follows every database, schema and index the statement meets.
//!
//! Isolation: at READ COMMITTED the read after a conflict takes a new
//! snapshot and sees the winner. At REPEATABLE READ and SERIALIZABLE
//! PostgreSQL refuses the conflict with a serialization failure (40001) when
//! the winner is not visible to the transaction's snapshot; the retry loop
//! replays the transaction, whose new snapshot sees it.

use std::future::Future;

use diesel::expression::{AppearsOnTable, Expression, SelectableExpression, ValidGrouping};
use diesel::pg::Pg;
use diesel::query_builder::{AstPass, QueryFragment, QueryId};
use diesel::result::Error as DieselError;
use diesel::result::QueryResult;
use diesel::sql_types::SingleValue;
use diesel::sql_types::{Array, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use super::Versioned;
use crate::sql::quote_literal;

/// What [`Versioned::create_once`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Creation<M> {
    /// This call inserted the row, as returned by the database (at version
    /// 0, or where the version guard's record of a deleted row with this
    /// identity leaves it).
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
    /// holds its key in this tenant (HTTP 409). Found by a second try: when
    /// the first found no row under the key (it may have been deleted
    /// between the INSERT and the read), the INSERT is sent once more. A
    /// `BEFORE INSERT` trigger that drops the row (`RETURN NULL`) is
    /// answered this way too: PostgreSQL reports a dropped row as it
    /// reports a conflict, with no row.
    #[error("another row already holds one of this row's unique values (not its idempotency key); nothing was written")]
    Conflict,
    /// A column of the key (or the tenant) is NULL: NULLs never collide in a
    /// unique index, so such a row could be created any number of times.
    /// Give the key, or insert the row with `insert`.
    #[error("the idempotency key is missing (a key column or the tenant is NULL), and a row without a key cannot be created once; give the key, or use `insert`")]
    MissingKey,
    /// The table has no unique index on exactly the tenant and key columns,
    /// so the database would not stop a second row with the same key; or it
    /// has a deferrable unique or exclusion constraint, which `ON CONFLICT`
    /// refuses. Found when PostgreSQL plans the INSERT (migration 17's
    /// guard), or, for a deferrable constraint the guard could not see (one
    /// added after the statement's snapshot, or behind a view), when the
    /// INSERT meets it; before anything is written either way, and the
    /// transaction is aborted.
    #[error("create_once cannot be used on {table}: {reason}")]
    NoUniqueIndex {
        /// The table, as SQL names it.
        table: String,
        /// The columns the index must cover: the tenant (if any), then the key.
        columns: Vec<&'static str>,
        /// What the database found, with the fix.
        reason: String,
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
/// ```text
/// // CREATE TABLE orders (.., CONSTRAINT uk_idempotent_key UNIQUE (tenant_id, request_id));
/// #[derive(Debug, Clone, diesel::Queryable, diesel::Selectable, idem::Versioned)]
/// #[diesel(table_name = orders)]
/// #[versioned(tenant = tenant_id, key = id,
///             create_once(key = request_id, fingerprint(id, amount)))]
/// struct Order { tenant_id: i64, id: i64, request_id: String, amount: i64, version: i64 }
///
/// // ONCE_COLUMNS == ["tenant_id", "request_id"], ONCE_FIELDS == ["id", "amount"]
/// ```
///
/// (The guide's "Create once on the business key", `docs/versioned.md`,
/// has this example compiled, with the calls and their answers.)
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
    /// Whether a key column or the tenant is `None`.
    fn __once_key_missing(&self) -> bool;

    #[doc(hidden)]
    /// `INSERT .. ON CONFLICT DO NOTHING RETURNING ..`, the version written
    /// by [`create_once_guard`]: the row if inserted.
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
    // A second try only when the first found neither a free key nor a row
    // under it: the row it met may have been deleted between the INSERT and
    // the read (READ COMMITTED; both statements see the table anew), and
    // then the key is free. A second miss is answered as a conflict.
    let mut tries = 2;
    loop {
        tries -= 1;
        let inserted = row.__once_insert(conn).await.map_err(refused::<M>)?;
        if let Some(created) = inserted {
            return Ok(Creation::Created(created));
        }
        // Nothing written: some unique index already holds one of the row's
        // values. This statement's fresh snapshot (READ COMMITTED) sees a
        // winner the INSERT waited for.
        match row.__once_read(conn).await? {
            Some((existing, same)) => return repeat::<M>(existing, same),
            None if tries == 0 => return Err(CreateOnceError::Conflict),
            None => {}
        }
    }
}

/// The row under the key, as the answer to a repeat: `Existing` when every
/// declared field is the same (`same`, in `ONCE_FIELDS` order).
fn repeat<M: CreateOnceModel>(
    existing: M,
    same: Vec<bool>,
) -> Result<Creation<M>, CreateOnceError> {
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

/// The message prefix of migration 16's guard (SQLSTATE IDR03; diesel
/// reports no SQLSTATE of its own).
const GUARD: &str = "idem: create_once: ";

/// How PostgreSQL's executor refuses an `ON CONFLICT` that meets a
/// deferrable unique or exclusion constraint (55000): one the guard could
/// not see, added after the statement's snapshot or behind a view (the
/// pool reads messages in English, `lc_messages = C`).
const DEFERRABLE_ARBITER: &str = "ON CONFLICT does not support deferrable";

/// The guard's refusal, or the executor's over a deferrable constraint, as
/// [`CreateOnceError::NoUniqueIndex`]; any other error as it is.
fn refused<M: CreateOnceModel>(err: DieselError) -> CreateOnceError {
    let DieselError::DatabaseError(_, info) = &err else {
        return CreateOnceError::Database(err);
    };
    let reason = if let Some(reason) = info.message().strip_prefix(GUARD) {
        reason.to_owned()
    } else if info.message().starts_with(DEFERRABLE_ARBITER) {
        format!("deferrable: {}", info.message())
    } else {
        return CreateOnceError::Database(err);
    };
    let reason = [info.details(), info.hint()]
        .into_iter()
        .flatten()
        .fold(reason, |reason, more| format!("{reason}; {more}"));
    CreateOnceError::NoUniqueIndex {
        table: M::table_sql(),
        columns: M::ONCE_COLUMNS.to_vec(),
        reason,
    }
}

/// The SQL of migration 16's guard for a table and its tenant and key
/// columns; generated code computes it once per model.
#[doc(hidden)]
pub fn create_once_guard_sql(table_sql: &str, columns: &[&str]) -> String {
    let columns: Vec<String> = columns.iter().map(|c| quote_literal(c)).collect();
    format!(
        "idem_create_once_guard({}::regclass, ARRAY[{}]::text[])",
        quote_literal(table_sql),
        columns.join(", ")
    )
}

/// The version a create-once writes: 0, through migration 16's guard
/// ([`create_once_guard_sql`]), which PostgreSQL evaluates when it plans the
/// INSERT and which refuses a table whose key has no unique index. `M` is
/// the model, `ST` the version column's type.
///
/// Unlike `diesel::dsl::sql`, which marks its statement unsafe to prepare,
/// it lets diesel prepare the INSERT once per connection: preparing is what
/// makes PostgreSQL keep the plan, and with it the guard's answer, between
/// calls. Its text is fixed per model, so its query id is the model's: diesel
/// finds the prepared statement by type, without rendering the SQL again.
#[doc(hidden)]
pub struct OnceGuard<M, ST> {
    sql: &'static str,
    _types: std::marker::PhantomData<fn() -> (M, ST)>,
}

impl<M, ST> OnceGuard<M, ST> {
    /// The guard written as `sql`, [`create_once_guard_sql`] of `M`.
    pub fn new(sql: &'static str) -> Self {
        OnceGuard {
            sql,
            _types: std::marker::PhantomData,
        }
    }
}

impl<M, ST: SingleValue> Expression for OnceGuard<M, ST> {
    type SqlType = ST;
}

impl<M, ST> QueryFragment<Pg> for OnceGuard<M, ST> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql(self.sql);
        Ok(())
    }
}

impl<M: 'static, ST: 'static> QueryId for OnceGuard<M, ST> {
    type QueryId = std::marker::PhantomData<(M, ST)>;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl<QS, M, ST: SingleValue> AppearsOnTable<QS> for OnceGuard<M, ST> {}

impl<QS, M, ST: SingleValue> SelectableExpression<QS> for OnceGuard<M, ST> {}

impl<M, ST, GB> ValidGrouping<GB> for OnceGuard<M, ST> {
    type IsAggregate = diesel::expression::is_aggregate::Never;
}

/// Checks that `M`'s table, as this connection's `search_path` resolves
/// it, has a unique index on exactly its tenant and key columns (valid, not
/// partial, not on expressions, not deferrable) and no deferrable unique or
/// exclusion constraint. [`Versioned::create_once`] does not need it (its
/// INSERT checks the same when PostgreSQL plans it); call it at start-up to
/// learn of a missing index before the first request.
///
/// # Errors
///
/// [`CreateOnceError::NoUniqueIndex`] when the table does not qualify,
/// [`CreateOnceError::Database`] when it does not exist or the check could
/// not run (migration 16 missing).
pub async fn check_create_once<M: CreateOnceModel>(
    conn: &mut AsyncPgConnection,
) -> Result<(), CreateOnceError> {
    let columns: Vec<String> = M::ONCE_COLUMNS.iter().map(|c| (*c).to_owned()).collect();
    diesel::sql_query("SELECT idem_create_once_guard($1::regclass, $2)")
        .bind::<Text, _>(M::table_sql())
        .bind::<Array<Text>, _>(&columns)
        .execute(conn)
        .await
        .map_err(refused::<M>)?;
    Ok(())
}

/// A SQL type PostgreSQL can compare with `=` (and so with `IS NOT DISTINCT
/// FROM`), as a `create_once` fingerprint field's column must be. Implemented
/// for diesel's types that have one; not for `Json`, which has none (use
/// `Jsonb`). For a SQL type of your own whose PostgreSQL type has `=` (an
/// enum, a domain), implement it: `impl idem::versioned::SqlEquality for MyType {}`.
#[diagnostic::on_unimplemented(
    message = "a create_once fingerprint field's column of SQL type `{Self}` cannot be compared",
    label = "PostgreSQL needs `=` for this column's type to tell a repeat from another request",
    note = "`json` has no `=` in PostgreSQL: make the column `jsonb`, or leave the field out of the fingerprint; a SQL type of your own that has `=` (an enum, a domain) needs `impl idem::versioned::SqlEquality for <that type> {{}}`"
)]
pub trait SqlEquality {}

macro_rules! sql_equality {
    ($($t:ident),* $(,)?) => {$(
        impl SqlEquality for diesel::sql_types::$t {}
    )*};
}
sql_equality!(
    Bool,
    SmallInt,
    Integer,
    BigInt,
    Float,
    Double,
    Numeric,
    Text,
    Binary,
    Date,
    Time,
    Timestamp,
    Timestamptz,
    Interval,
    Jsonb,
    Uuid,
    Money,
    Inet,
    Cidr,
    MacAddr,
    MacAddr8,
    CChar,
    Citext,
    Oid,
    PgLsn,
);
impl<T: SqlEquality> SqlEquality for diesel::sql_types::Nullable<T> {}
impl<T: SqlEquality> SqlEquality for diesel::sql_types::Array<T> {}
impl<T: SqlEquality> SqlEquality for diesel::sql_types::Range<T> {}

/// Asks the compiler whether a fingerprint column's SQL type has `=`.
#[doc(hidden)]
pub fn assert_sql_equality<ST: SqlEquality>() {}

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
