//! A database trigger that keeps every write to a versioned table honest:
//! UPDATEs bump the version and keep the row's identity, and a version never
//! repeats for the same identity.
//!
//! The builders of [`Versioned`] make it impossible to write a versioned row
//! from Rust without the version check and the bump. They cannot stop psql, a
//! hand-written bulk `UPDATE`, a data-fix script or another service. For those,
//! [`install_version_guard`] puts a `BEFORE INSERT OR UPDATE OR DELETE FOR EACH
//! ROW` trigger on the model's table. It refuses every UPDATE whose new version
//! is not exactly the old version + 1:
//!
//! ```sql
//! UPDATE documents SET body = '{}' WHERE document_id = 7;
//! -- ERROR:  idem_version_guard: UPDATE of public.documents changes version from 3 to 3;
//! --         every UPDATE must set it to exactly 4 (old version + 1)
//! -- SQLSTATE IDV01
//! ```
//!
//! and every UPDATE that changes an identity column ([`Versioned::IDENTITY_COLUMNS`]:
//! the tenant and the key), however it treats the version, since a writer
//! holding the old row's version would then reach a row of another key or
//! tenant:
//!
//! ```sql
//! UPDATE documents SET tenant_id = 2, version = version + 1 WHERE document_id = 7;
//! -- ERROR:  idem_version_guard: UPDATE moves a row of public.documents by changing its
//! --         identity column tenant_id from 1 to 2; the key and tenant of a versioned row never change
//! -- SQLSTATE IDV03
//! ```
//!
//! The statement fails as a whole, so a bulk update changes no row at all.
//! An UPDATE that bumps the version but omits `AND version = $expected` still
//! passes: the trigger sees one row at a time and cannot know what the writer
//! read. It catches the forgotten bump, which is what turns a concurrent
//! versioned write into a silent lost update.
//!
//! # Versions never repeat
//!
//! A version is what an `ETag` names (`If-Match: "v3"` becomes `AND version =
//! 3`), so a row deleted and inserted again must not start over at 0: the old
//! tag would match the new, different row once it got back to version 3. On
//! DELETE the trigger records the row's last version in the table
//! `idem_version_tombstones` (keyed by schema, table and the identity as a
//! jsonb object); on INSERT of an identity that has a tombstone it raises the
//! new row's version to the tombstone's + 1 (a higher version given by the
//! INSERT is kept). [`Versioned::insert`] returns the row as stored, so the
//! caller sees that version.
//!
//! A DELETE racing an INSERT of the same identity: the INSERT first locks the
//! row it replaces (`SELECT .. FOR KEY SHARE`), which waits for an uncommitted
//! DELETE of it, and reads the tombstone after that. Under `READ COMMITTED` it
//! then sees the tombstone; under `REPEATABLE READ` and `SERIALIZABLE` the lock
//! fails with 40001 (which [`retry`](crate::retry) retries) when the DELETE
//! committed after the transaction's snapshot. Not covered: a row inserted and
//! deleted entirely after the snapshot of a `REPEATABLE READ` transaction that
//! then inserts the same identity.
//!
//! **Retention**: a tombstone stays until [`purge_version_tombstones`] (or the
//! SQL function `idem_purge_version_tombstones(interval)`) removes it; there
//! is at most one per distinct deleted identity. Once a tombstone is purged, a
//! new row with that identity starts at 0 again, so purge only tombstones
//! older than any version a client may still hold (an `ETag` in a browser, a
//! stored idempotent response).
//!
//! # Errors it raises
//!
//! | SQLSTATE | when | fields set |
//! |---|---|---|
//! | [`IDV01`](VERSION_GUARD_SQLSTATE) | the new version is not old + 1 (or either is NULL) | message naming table and both versions, `DETAIL`, `HINT`, `SCHEMA`, `TABLE`, `COLUMN` |
//! | [`IDV02`](VERSION_GUARD_MISCONFIGURED_SQLSTATE) | the trigger is misconfigured: an argument names no column of the table, or it is not `BEFORE .. FOR EACH ROW` | message, `SCHEMA`, `TABLE` |
//! | [`IDV03`](VERSION_GUARD_IDENTITY_SQLSTATE) | the UPDATE changes an identity column (checked before the version) | message naming table, column and both values, `DETAIL`, `HINT`, `SCHEMA`, `TABLE`, `COLUMN` |
//!
//! Class `ID` is not a PostgreSQL class, so nothing that retries on
//! serialization failures (class `40`) retries these: they are bugs in the
//! writer, not races. diesel does not expose the SQLSTATE; use
//! [`is_version_guard_violation`] and [`is_identity_guard_violation`] on a
//! `diesel::result::Error`.
//!
//! # What it costs
//!
//! Measured on PostgreSQL 15 (2 shared cores), per row, server side:
//!
//! - UPDATE: the trigger compares the identity columns of `OLD` and `NEW`
//!   (jsonb lookups, no table access), about 3 µs more than the version check
//!   alone (about 10 µs). Nothing about tombstones happens on UPDATE.
//! - DELETE: one upsert into `idem_version_tombstones`, about 25 µs.
//! - INSERT: one primary-key lookup on the table, planned for every row (the
//!   table is only known at run time), and one on `idem_version_tombstones`,
//!   about 30 µs; a bulk load of a guarded table is that much slower per row.
//!
//! # What to know before installing it
//!
//! - The function `idem_version_guard()` and the table
//!   `idem_version_tombstones` come from idem's migrations: run
//!   [`migrate`](crate::migrate::migrate) first.
//! - Roles that INSERT or DELETE rows of a guarded table need `SELECT`,
//!   `INSERT` and `UPDATE` on `idem_version_tombstones`, and the inserting
//!   role needs `UPDATE` on the table itself (for the `FOR KEY SHARE` lock).
//!   With them a role can read every guarded table's tombstones and raise
//!   them, never lower or move one: a trigger refuses that (SQLSTATE
//!   `IDV04`, migration 18), since a lowered tombstone lets a deleted row's
//!   versions repeat.
//! - Triggers run in name order; a `BEFORE` trigger of yours whose name sorts
//!   after `idem_version_guard` and that changes the version or an identity
//!   column is not checked.
//! - Every UPDATE is checked, including `ON CONFLICT DO UPDATE` and
//!   `ON UPDATE CASCADE` from a foreign key: those must bump the version, and
//!   a cascade that changes an identity column (a renumbered tenant) is refused.
//! - Identity values are compared and stored as jsonb. Keep identity columns
//!   to types whose jsonb form does not depend on session settings (integers,
//!   text, uuid, date, numeric): a `timestamptz` key is rendered in the
//!   session's time zone, so a tombstone written in one zone is not found from
//!   another.
//! - Tombstones are keyed by schema and table name (for a partitioned table,
//!   by partition: a row deleted from one partition and inserted into
//!   another starts over). A renamed table starts without tombstones; a
//!   table dropped and created again under its name keeps them (its rows
//!   then start higher, which is harmless). Identity columns under a
//!   nondeterministic collation have a tombstone per spelling: `abc`
//!   deleted and inserted again as `ABC` starts over.
//! - `TRUNCATE`, `ALTER TABLE .. DISABLE TRIGGER` and
//!   `session_replication_role = replica` bypass the trigger: truncated rows
//!   leave no tombstones.
//! - The trigger runs as the writing role, with a search path of its own
//!   (migration 18): `pg_catalog`, the schema idem's tables were migrated
//!   into, `pg_temp` last. A role's own functions, operators or
//!   `idem_version_tombstones` (in its schema, first on its search path, or
//!   temporary) do not change what it checks; a role that may create
//!   objects in idem's schema is trusted, as its owner is. Identity columns
//!   are compared with the operators of those two schemas: keep them to
//!   built-in types (as above). The rest of idem's SQL, this module's
//!   [`purge_version_tombstones`] among it, names idem's tables and
//!   functions unqualified: sessions that call it need idem's schema on
//!   their search path.
//! - The columns are read through `to_jsonb(NEW)` / `to_jsonb(OLD)`, which
//!   costs a serialisation of the row per written row; noticeable only for
//!   very wide rows under heavy write load.
//! - Remove it with `DROP TRIGGER idem_version_guard ON <table>`.

use std::time::Duration;

use diesel::result::Error as DieselError;
use diesel::sql_types::BigInt;
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};

use super::Versioned;
use crate::sql::quote_literal;

/// The SQLSTATE of an UPDATE that does not set the version to old + 1.
pub const VERSION_GUARD_SQLSTATE: &str = "IDV01";

/// The SQLSTATE of a misconfigured guard trigger: an argument names no
/// column of the table, or it was attached to another event than
/// `BEFORE .. FOR EACH ROW`.
pub const VERSION_GUARD_MISCONFIGURED_SQLSTATE: &str = "IDV02";

/// The SQLSTATE of an UPDATE that changes an identity column (the tenant or a
/// key column) of a guarded row.
pub const VERSION_GUARD_IDENTITY_SQLSTATE: &str = "IDV03";

/// The name of both the trigger function (created by migration 1) and the
/// trigger [`install_version_guard`] creates on a table.
pub const VERSION_GUARD_TRIGGER: &str = "idem_version_guard";

/// The table that keeps the last version of deleted rows (created by
/// [`migrate`](crate::migrate::migrate)); see
/// [the module documentation](self#versions-never-repeat).
pub const TOMBSTONES_TABLE: &str = "idem_version_tombstones";

/// Every IDV01 message starts with this.
const VIOLATION_PREFIX: &str = "idem_version_guard: UPDATE of ";

/// Every IDV03 message starts with this.
const IDENTITY_VIOLATION_PREFIX: &str = "idem_version_guard: UPDATE moves a row of ";

/// Install (or replace) the trigger `idem_version_guard` on the model's table
/// (as diesel names it, schema included when the `table!` has one), guarding
/// `M::VERSION_COLUMN` and the identity `M::IDENTITY_COLUMNS` (tenant, then
/// key). Idempotent: `CREATE OR REPLACE TRIGGER` (PostgreSQL 14 or later), so
/// calling it at every start-up also upgrades a trigger installed by an older
/// idem. Requires [`migrate`](crate::migrate::migrate) to have run on the
/// database.
///
/// ```no_run
/// use diesel_async::{AsyncConnection, AsyncPgConnection};
/// use idem_runtime::versioned::backstop::install_version_guard;
/// # use idem_runtime::Versioned;
/// # async fn run<Document: Versioned>() -> Result<(), Box<dyn std::error::Error>> {
///
/// // `Document` is a `#[derive(Versioned)]` model of the table `documents`.
/// let mut conn = AsyncPgConnection::establish("postgres://localhost/app").await?;
/// idem_runtime::migrate::migrate(&mut conn).await?;
/// install_version_guard::<Document>(&mut conn).await?;
/// # Ok(())
/// # }
/// ```
pub async fn install_version_guard<M: Versioned>(
    conn: &mut AsyncPgConnection,
) -> Result<(), DieselError> {
    let sql = trigger_sql(&M::table_sql(), M::VERSION_COLUMN, M::IDENTITY_COLUMNS)?;
    conn.batch_execute(&sql).await
}

/// [`install_version_guard`] for a table that has no [`Versioned`] model, or
/// named by a string. `identity_columns` are the columns that say which row
/// this is (the tenant column, if any, and the key columns): an UPDATE may not
/// change them, and a deleted row's last version is remembered under them.
/// `table` and every column are SQL names, used exactly as given (case and
/// all) and quoted, so any name is safe to pass.
///
/// ```no_run
/// # use diesel_async::{AsyncConnection, AsyncPgConnection};
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let mut conn = AsyncPgConnection::establish("postgres://localhost/app").await?;
/// idem_runtime::migrate::migrate(&mut conn).await?;
/// idem_runtime::versioned::backstop::install_version_guard_on(
///     &mut conn,
///     "Invoices",
///     "row_version",
///     &["tenant_id", "invoice_no"],
/// )
/// .await?;
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// A `QueryBuilderError` when a name is empty or holds a NUL, when
/// `identity_columns` is empty, or when it names the version column; the
/// database's error when the table or the function `idem_version_guard()` is
/// missing.
pub async fn install_version_guard_on(
    conn: &mut AsyncPgConnection,
    table: &str,
    version_column: &str,
    identity_columns: &[&str],
) -> Result<(), DieselError> {
    let sql = create_trigger_sql(table, version_column, identity_columns)?;
    conn.batch_execute(&sql).await
}

/// Delete the tombstones of identities deleted longer than `older_than` ago,
/// and return how many went. A row later inserted with a purged identity
/// starts at the version it is inserted with (0 through idem), so make
/// `older_than` longer than any client may keep a version (`ETag`) it read.
///
/// ```no_run
/// # use diesel_async::{AsyncConnection, AsyncPgConnection};
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// let mut conn = AsyncPgConnection::establish("postgres://localhost/app").await?;
/// let purged = idem_runtime::versioned::backstop::purge_version_tombstones(
///     &mut conn,
///     Duration::from_secs(90 * 24 * 3600),
/// )
/// .await?;
/// # Ok(())
/// # }
/// ```
pub async fn purge_version_tombstones(
    conn: &mut AsyncPgConnection,
    older_than: Duration,
) -> Result<u64, DieselError> {
    #[derive(diesel::QueryableByName)]
    struct Purged {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    // The SQL function caps the interval at 1000 years (no tombstone is
    // that old), as `micros` does, which keeps the multiplication in range.
    let micros = crate::sql::micros(older_than);
    let purged = diesel::sql_query(
        "SELECT idem_purge_version_tombstones($1 * interval '1 microsecond') AS n",
    )
    .bind::<BigInt, _>(micros)
    .get_result::<Purged>(conn)
    .await?;
    Ok(u64::try_from(purged.n).unwrap_or(0))
}

/// True when `err` is the guard refusing an UPDATE that does not bump the
/// version (SQLSTATE [`IDV01`](VERSION_GUARD_SQLSTATE)).
///
/// ```
/// use diesel::result::Error;
/// use idem_runtime::versioned::backstop::is_version_guard_violation;
/// assert!(!is_version_guard_violation(&Error::NotFound));
/// ```
pub fn is_version_guard_violation(err: &DieselError) -> bool {
    // diesel keeps the message but drops the SQLSTATE; the message is ours.
    matches!(err, DieselError::DatabaseError(_, info) if info.message().starts_with(VIOLATION_PREFIX))
}

/// True when `err` is the guard refusing an UPDATE that changes the tenant
/// or a key column of a row (SQLSTATE [`IDV03`](VERSION_GUARD_IDENTITY_SQLSTATE)).
///
/// ```
/// use diesel::result::Error;
/// use idem_runtime::versioned::backstop::is_identity_guard_violation;
/// assert!(!is_identity_guard_violation(&Error::NotFound));
/// ```
pub fn is_identity_guard_violation(err: &DieselError) -> bool {
    matches!(err, DieselError::DatabaseError(_, info) if info.message().starts_with(IDENTITY_VIOLATION_PREFIX))
}

/// The DDL, with `table` quoted the way PostgreSQL's `quote_ident` quotes it.
fn create_trigger_sql(
    table: &str,
    version_column: &str,
    identity_columns: &[&str],
) -> Result<String, DieselError> {
    check_name(table)?;
    trigger_sql(&quote_ident(table), version_column, identity_columns)
}

fn check_name(name: &str) -> Result<(), DieselError> {
    if name.is_empty() || name.contains('\0') {
        return Err(DieselError::QueryBuilderError(
            format!("{name:?} cannot be an SQL identifier").into(),
        ));
    }
    Ok(())
}

/// The DDL for a table given as SQL already quoted (diesel's rendering of
/// the table, e.g. `"app"."documents"`); the columns become the trigger's
/// arguments, version first, as string literals.
fn trigger_sql(
    table_sql: &str,
    version_column: &str,
    identity_columns: &[&str],
) -> Result<String, DieselError> {
    check_name(version_column)?;
    if identity_columns.is_empty() {
        return Err(DieselError::QueryBuilderError(
            "the version guard needs the identity columns (tenant and key) of the table".into(),
        ));
    }
    let mut args = quote_literal(version_column);
    for column in identity_columns {
        check_name(column)?;
        if *column == version_column {
            return Err(DieselError::QueryBuilderError(
                format!("the version column {column:?} cannot be an identity column too").into(),
            ));
        }
        args.push_str(", ");
        args.push_str(&quote_literal(column));
    }
    Ok(format!(
        "CREATE OR REPLACE TRIGGER {VERSION_GUARD_TRIGGER} BEFORE INSERT OR UPDATE OR DELETE ON {table_sql} \
         FOR EACH ROW EXECUTE FUNCTION {VERSION_GUARD_TRIGGER}({args})"
    ))
}

/// Always quoted (PostgreSQL's `quote_ident` leaves some names bare, which
/// means the same thing): double quotes around, inner ones doubled.
fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_names() {
        assert_eq!(
            create_trigger_sql("documents", "version", &["tenant_id", "document_id"]).unwrap(),
            "CREATE OR REPLACE TRIGGER idem_version_guard BEFORE INSERT OR UPDATE OR DELETE ON \"documents\" \
             FOR EACH ROW EXECUTE FUNCTION idem_version_guard('version', 'tenant_id', 'document_id')"
        );
    }

    #[test]
    fn hostile_names_stay_one_token() {
        assert_eq!(
            quote_ident(r#"a"; DROP TABLE x; --"#),
            r#""a""; DROP TABLE x; --""#
        );
        assert_eq!(quote_literal("it's"), "'it''s'");
        assert_eq!(quote_literal(r"a\'b"), r"E'a\\''b'");
        assert!(create_trigger_sql("t", "v", &["it's"])
            .unwrap()
            .ends_with("idem_version_guard('v', 'it''s')"));
    }

    #[test]
    fn nul_and_empty_names_are_refused() {
        assert!(create_trigger_sql("a\0b", "version", &["id"]).is_err());
        assert!(create_trigger_sql("documents", "", &["id"]).is_err());
        assert!(create_trigger_sql("documents", "version", &["id", ""]).is_err());
        assert!(create_trigger_sql("documents", "version", &["i\0d"]).is_err());
    }

    #[test]
    fn an_identity_is_required_and_excludes_the_version() {
        assert!(create_trigger_sql("documents", "version", &[]).is_err());
        assert!(create_trigger_sql("documents", "version", &["id", "version"]).is_err());
    }
}
