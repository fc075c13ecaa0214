//! A database trigger that rejects any UPDATE which does not bump the version.
//!
//! The builders of [`Versioned`] make it impossible to write a versioned row
//! from Rust without the version check and the bump. They cannot stop psql, a
//! hand-written bulk `UPDATE`, a data-fix script or another service. For those,
//! [`install_version_guard`] puts a `BEFORE UPDATE FOR EACH ROW` trigger on the
//! model's table that refuses every UPDATE whose new version is not exactly the
//! old version + 1:
//!
//! ```sql
//! UPDATE documents SET body = '{}' WHERE document_id = 7;
//! -- ERROR:  idem_version_guard: UPDATE of public.documents changes version from 3 to 3;
//! --         every UPDATE must set it to exactly 4 (old version + 1)
//! -- SQLSTATE IDV01
//! ```
//!
//! The statement fails as a whole, so a bulk update changes no row at all.
//! An UPDATE that bumps the version but omits `AND version = $expected` still
//! passes: the trigger sees one row at a time and cannot know what the writer
//! read. It catches the forgotten bump, which is what turns a concurrent
//! versioned write into a silent lost update.
//!
//! # Errors it raises
//!
//! | SQLSTATE | when | fields set |
//! |---|---|---|
//! | [`IDV01`](VERSION_GUARD_SQLSTATE) | the new version is not old + 1 (or either is NULL) | message naming table and both versions, `DETAIL`, `HINT`, `SCHEMA`, `TABLE`, `COLUMN` |
//! | [`IDV02`](VERSION_GUARD_MISCONFIGURED_SQLSTATE) | the trigger is misconfigured: its argument names no column of the table, or it is not `BEFORE UPDATE FOR EACH ROW` | message, `SCHEMA`, `TABLE` |
//!
//! Class `ID` is not a PostgreSQL class, so nothing that retries on
//! serialization failures (class `40`) retries these: they are bugs in the
//! writer, not races. diesel does not expose the SQLSTATE; use
//! [`is_version_guard_violation`] on a `diesel::result::Error`.
//!
//! # What to know before installing it
//!
//! - The function `idem_version_guard()` comes from migration 1: run
//!   [`migrate`](crate::migrate::migrate) first.
//! - Triggers run in name order; a `BEFORE UPDATE` trigger of yours whose name
//!   sorts after `idem_version_guard` and that changes the version is not
//!   checked.
//! - Every UPDATE is checked, including `ON CONFLICT DO UPDATE` and
//!   `ON UPDATE CASCADE` from a foreign key: those must bump the version too.
//! - The version is read through `to_jsonb(NEW)` / `to_jsonb(OLD)`, which costs
//!   a serialisation of the row per updated row; noticeable only for very wide
//!   rows under heavy update load.
//! - Remove it with `DROP TRIGGER idem_version_guard ON <table>`.

use diesel::result::Error as DieselError;
use diesel_async::{AsyncPgConnection, SimpleAsyncConnection};

use super::Versioned;

/// The SQLSTATE of an UPDATE that does not set the version to old + 1.
pub const VERSION_GUARD_SQLSTATE: &str = "IDV01";

/// The SQLSTATE of a misconfigured guard trigger: its argument names no
/// column of the table, or it was attached to another event than
/// `BEFORE UPDATE FOR EACH ROW`.
pub const VERSION_GUARD_MISCONFIGURED_SQLSTATE: &str = "IDV02";

/// The name of both the trigger function (created by migration 1) and the
/// trigger [`install_version_guard`] creates on a table.
pub const VERSION_GUARD_TRIGGER: &str = "idem_version_guard";

/// Every IDV01 message starts with this.
const VIOLATION_PREFIX: &str = "idem_version_guard: UPDATE of ";

/// Install (or replace) the trigger `idem_version_guard` on the model's table
/// (as diesel names it, schema included when the `table!` has one), guarding
/// `M::VERSION_COLUMN`. Idempotent: `CREATE OR REPLACE TRIGGER` (PostgreSQL
/// 14 or later). Requires [`migrate`](crate::migrate::migrate) to have run on
/// the database.
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
    let sql = trigger_sql(&M::table_sql(), M::VERSION_COLUMN)?;
    conn.batch_execute(&sql).await
}

/// [`install_version_guard`] for a table that has no [`Versioned`] model, or
/// named by a string: `table` and `version_column` are
/// SQL names, used exactly as given (case and all) and quoted, so any name is
/// safe to pass.
///
/// ```no_run
/// # use diesel_async::{AsyncConnection, AsyncPgConnection};
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let mut conn = AsyncPgConnection::establish("postgres://localhost/app").await?;
/// idem_runtime::migrate::migrate(&mut conn).await?;
/// idem_runtime::versioned::backstop::install_version_guard_on(&mut conn, "Invoices", "row_version")
///     .await?;
/// # Ok(())
/// # }
/// ```
pub async fn install_version_guard_on(
    conn: &mut AsyncPgConnection,
    table: &str,
    version_column: &str,
) -> Result<(), DieselError> {
    let sql = create_trigger_sql(table, version_column)?;
    conn.batch_execute(&sql).await
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

/// The DDL, with `table` and `version_column` quoted the way PostgreSQL's
/// `quote_ident` and `quote_literal` quote them.
fn create_trigger_sql(table: &str, version_column: &str) -> Result<String, DieselError> {
    for name in [table, version_column] {
        if name.is_empty() || name.contains('\0') {
            return Err(DieselError::QueryBuilderError(
                format!("{name:?} cannot be an SQL identifier").into(),
            ));
        }
    }
    trigger_sql(&quote_ident(table), version_column)
}

/// The DDL for a table given as SQL already quoted (diesel's rendering of
/// the table, e.g. `"app"."documents"`).
fn trigger_sql(table_sql: &str, version_column: &str) -> Result<String, DieselError> {
    if version_column.is_empty() || version_column.contains('\0') {
        return Err(DieselError::QueryBuilderError(
            format!("{version_column:?} cannot be an SQL identifier").into(),
        ));
    }
    Ok(format!(
        "CREATE OR REPLACE TRIGGER {VERSION_GUARD_TRIGGER} BEFORE UPDATE ON {table_sql} \
         FOR EACH ROW EXECUTE FUNCTION {VERSION_GUARD_TRIGGER}({})",
        quote_literal(version_column),
    ))
}

/// Always quoted (PostgreSQL's `quote_ident` leaves some names bare, which
/// means the same thing): double quotes around, inner ones doubled.
fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Like PostgreSQL's `quote_literal`: single quotes doubled, and an `E''`
/// string with doubled backslashes when there is a backslash, so the result
/// means the same whatever `standard_conforming_strings` is.
fn quote_literal(value: &str) -> String {
    let quoted = value.replace('\'', "''");
    if quoted.contains('\\') {
        format!("E'{}'", quoted.replace('\\', "\\\\"))
    } else {
        format!("'{quoted}'")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_names() {
        assert_eq!(
            create_trigger_sql("documents", "version").unwrap(),
            "CREATE OR REPLACE TRIGGER idem_version_guard BEFORE UPDATE ON \"documents\" \
             FOR EACH ROW EXECUTE FUNCTION idem_version_guard('version')"
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
    }

    #[test]
    fn nul_and_empty_names_are_refused() {
        assert!(create_trigger_sql("a\0b", "version").is_err());
        assert!(create_trigger_sql("documents", "").is_err());
    }
}
