//! The evidence behind [`Transitioned::Duplicate`](super::Transitioned): the
//! last transition each row made, kept in `idem_transitions`.
//!
//! A transition that matches no row is a duplicate only if the row really made
//! this transition from this version. The row alone cannot say so: in the
//! target state at the expected version + 1, it may have got there by another
//! declared edge into the same state, or by a plain update of a row that was
//! in the target state already. So every applied transition records, in the
//! same statement as its UPDATE (one round trip, and atomic with it), the
//! version it wrote and the edge it took, one row per model row (an upsert).
//! Only the write that made the row's current version matters for the
//! classification, so the last one is all that is kept.
//!
//! A record is bound to that very write, not only to a version (which repeats
//! when a key's versions start again: TRUNCATE, tombstones purged, a delete
//! and re-insert without the backstop), nor to the table's name (which two
//! schemas share):
//!
//! - the table is named by its oid, `'<table sql>'::regclass`, resolved by
//!   the transition's own statement under its `search_path` (a constant
//!   folded when the statement is planned; PostgreSQL plans a prepared
//!   statement again when the `search_path` changes);
//! - `row_xid` is the full id of the (sub)transaction that wrote the row
//!   version: the `xmin` the UPDATE returns, widened to 64 bits against the
//!   current snapshot. Inside a savepoint that is the subtransaction's id,
//!   which is what the row version keeps; `pg_current_xact_id()` would give
//!   the top-level one.
//!
//! The check reads the row and whether its record matches in one statement:
//! the record's edge and version, and its `row_xid` equal to the row's
//! current `xmin`, widened the same way.

use diesel::expression::{
    is_aggregate, AppearsOnTable, Expression, SelectableExpression, ValidGrouping,
};
use diesel::pg::Pg;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::sql_types::{BigInt, Bool, Text};
use diesel::{QueryResult, QuerySource};

use crate::sql::quote_literal;

/// What one applied transition records: the model's table (as the regclass
/// literal its statements resolve), the version the transition wrote, and
/// the edge it took (as the states' texts). Made by `Transition::execute`,
/// handed to the generated `__transition` and `__load_made`.
#[doc(hidden)]
#[derive(Debug)]
pub struct TransitionRecord {
    /// `'<table sql>'::regclass`.
    table: String,
    pub(super) version: i64,
    pub(super) from: &'static str,
    pub(super) to: &'static str,
}

impl TransitionRecord {
    /// The record of the transition `from -> to` of a row of `table_sql`
    /// (diesel's text of the table, `"orders"` or `"app"."orders"`) that
    /// writes `version`.
    pub(super) fn new(table_sql: &str, version: i64, from: &'static str, to: &'static str) -> Self {
        TransitionRecord {
            table: regclass_literal(table_sql),
            version,
            from,
            to,
        }
    }

    /// The RETURNING list of the transition's UPDATE: `returning`, then the
    /// new row version's `xmin` as `"idem_row_xmin"`, which the record's
    /// INSERT reads. diesel reads a row's columns by position up to the
    /// model's last, so the column after them is not read back.
    pub fn returning<R>(returning: R) -> WithRowXmin<R> {
        WithRowXmin(returning)
    }

    /// `EXISTS (..)`: whether the row of `table` with `identity` (the
    /// statement's own row: `<table>.xmin` is read from it) made this
    /// transition: its record has this version and edge, and was written by
    /// the (sub)transaction that wrote the row's current version. For the
    /// select list of the read that classifies a transition that matched
    /// no row.
    pub fn made<Tab: QuerySource, Id>(&self, table: Tab, identity: Id) -> Made<'_, Tab, Id> {
        Made {
            from: table.from_clause(),
            identity,
            record: self,
        }
    }
}

/// `'..'::regclass` for a table as diesel writes it, quoted so that it
/// reads the same whatever `standard_conforming_strings` says.
fn regclass_literal(table_sql: &str) -> String {
    format!("{}::regclass", quote_literal(table_sql))
}

/// `xid` (SQL, 32 bits) as the full transaction id (64 bits, with its
/// epoch): the one within 2^31 of the snapshot's next transaction id. Exact
/// for every id a live row version or this transaction can carry, unless it
/// is 2^31 or more transactions old (a row version frozen that long; it then
/// widens to another id, and its record no longer matches: `Stale`, never a
/// false duplicate). `pg_current_snapshot()` assigns no transaction id,
/// unlike `pg_current_xact_id()`.
fn push_full_xid<'b>(
    out: &mut AstPass<'_, 'b, Pg>,
    xid: impl FnOnce(&mut AstPass<'_, 'b, Pg>) -> QueryResult<()>,
) -> QueryResult<()> {
    const NEXT: &str = "pg_snapshot_xmax(pg_current_snapshot())::text::bigint";
    out.push_sql("(");
    out.push_sql(NEXT);
    out.push_sql(" + ((");
    xid(out)?;
    out.push_sql("::text::bigint - ");
    out.push_sql(NEXT);
    out.push_sql(" % 4294967296 + 6442450944) % 4294967296) - 2147483648)");
    Ok(())
}

/// `jsonb_build_array(<binds>)`: a row's identity (tenant, then key columns),
/// each value bound with its column's SQL type, so that the transition that
/// writes a record and the read that looks for it build the same jsonb.
#[doc(hidden)]
pub struct JsonbArray<T>(pub T);

impl<T: QueryFragment<Pg>> QueryFragment<Pg> for JsonbArray<T> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("jsonb_build_array(");
        self.0.walk_ast(out.reborrow())?;
        out.push_sql(")");
        Ok(())
    }
}

/// `<returning>, xmin AS "idem_row_xmin"`: see
/// [`TransitionRecord::returning`]. Its SQL type is the model's: the extra
/// column is for the record, not for the caller.
#[doc(hidden)]
pub struct WithRowXmin<R>(R);

const ROW_XMIN: &str = "\"idem_row_xmin\"";

impl<R: Expression> Expression for WithRowXmin<R> {
    type SqlType = R::SqlType;
}

impl<R: QueryFragment<Pg>> QueryFragment<Pg> for WithRowXmin<R> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        self.0.walk_ast(out.reborrow())?;
        // The UPDATE's target is the only relation in scope (no FROM).
        out.push_sql(", xmin AS ");
        out.push_sql(ROW_XMIN);
        Ok(())
    }
}

const CTE: &str = "\"idem_transition\"";

/// `WITH "idem_transition" AS (<the transition's UPDATE .. RETURNING ..,
/// xmin>), .. (the upsert of its record, one row per row the UPDATE
/// returned) SELECT * FROM "idem_transition"`: the row as written, and its
/// record, in one statement. Built only by the code `#[derive(Versioned)]`
/// generates, around an UPDATE whose RETURNING list is
/// [`TransitionRecord::returning`].
#[doc(hidden)]
pub struct RecordedTransition<'r, Cas, Id> {
    update: Cas,
    identity: Id,
    record: &'r TransitionRecord,
}

impl<'r, Cas, Id> RecordedTransition<'r, Cas, Id> {
    /// Wrap the transition's `update`; `identity` is the row's
    /// [`JsonbArray`].
    pub fn new(update: Cas, identity: Id, record: &'r TransitionRecord) -> Self {
        RecordedTransition {
            update,
            identity,
            record,
        }
    }
}

impl<Cas: QueryFragment<Pg>, Id: QueryFragment<Pg>> QueryFragment<Pg>
    for RecordedTransition<'_, Cas, Id>
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("WITH ");
        out.push_sql(CTE);
        out.push_sql(" AS (");
        self.update.walk_ast(out.reborrow())?;
        out.push_sql(
            "), \"idem_recorded\" AS (INSERT INTO \"idem_transitions\" \
             (\"table_oid\", \"identity\", \"version\", \"from_state\", \"to_state\", \"row_xid\") \
             SELECT ",
        );
        out.push_sql(&self.record.table);
        out.push_sql(", ");
        self.identity.walk_ast(out.reborrow())?;
        out.push_sql(", ");
        out.push_bind_param::<BigInt, _>(&self.record.version)?;
        out.push_sql(", ");
        out.push_bind_param::<Text, _>(self.record.from)?;
        out.push_sql(", ");
        out.push_bind_param::<Text, _>(self.record.to)?;
        out.push_sql(", ");
        push_full_xid(&mut out, |out| {
            out.push_sql(CTE);
            out.push_sql(".");
            out.push_sql(ROW_XMIN);
            Ok(())
        })?;
        out.push_sql(" FROM ");
        out.push_sql(CTE);
        out.push_sql(
            " ON CONFLICT (\"table_oid\", \"identity\") DO UPDATE SET \
             \"version\" = EXCLUDED.\"version\", \"from_state\" = EXCLUDED.\"from_state\", \
             \"to_state\" = EXCLUDED.\"to_state\", \"row_xid\" = EXCLUDED.\"row_xid\", \
             \"recorded_at\" = EXCLUDED.\"recorded_at\") \
             SELECT * FROM ",
        );
        out.push_sql(CTE);
        Ok(())
    }
}

// Not static, for the same reason as `CasUpdate`: diesel keys the prepared
// statement by the SQL text, which is fixed per changeset type.
impl<Cas, Id> QueryId for RecordedTransition<'_, Cas, Id> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl<Cas: Query, Id> Query for RecordedTransition<'_, Cas, Id> {
    type SqlType = Cas::SqlType;
}

/// `EXISTS (SELECT 1 FROM "idem_transitions" WHERE <this table, this
/// identity, this version and edge, written by the row's xmin>)`: see
/// [`TransitionRecord::made`]. A boolean column of a read of the row, so
/// that the record is judged against the very row version that read
/// returns.
#[doc(hidden)]
pub struct Made<'r, Tab: QuerySource, Id> {
    from: Tab::FromClause,
    identity: Id,
    record: &'r TransitionRecord,
}

impl<Tab: QuerySource, Id> Expression for Made<'_, Tab, Id> {
    type SqlType = Bool;
}

impl<Tab: QuerySource, Id, QS> AppearsOnTable<QS> for Made<'_, Tab, Id> {}

impl<Tab: QuerySource, Id, QS> SelectableExpression<QS> for Made<'_, Tab, Id> {}

impl<Tab: QuerySource, Id, GroupBy> ValidGrouping<GroupBy> for Made<'_, Tab, Id> {
    type IsAggregate = is_aggregate::Never;
}

impl<Tab: QuerySource, Id> QueryId for Made<'_, Tab, Id> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl<Tab, Id> QueryFragment<Pg> for Made<'_, Tab, Id>
where
    Tab: QuerySource,
    Tab::FromClause: QueryFragment<Pg>,
    Id: QueryFragment<Pg>,
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("EXISTS (SELECT 1 FROM \"idem_transitions\" WHERE \"table_oid\" = ");
        out.push_sql(&self.record.table);
        out.push_sql(" AND \"identity\" = ");
        self.identity.walk_ast(out.reborrow())?;
        out.push_sql(" AND \"version\" = ");
        out.push_bind_param::<BigInt, _>(&self.record.version)?;
        out.push_sql(" AND \"from_state\" = ");
        out.push_bind_param::<Text, _>(self.record.from)?;
        out.push_sql(" AND \"to_state\" = ");
        out.push_bind_param::<Text, _>(self.record.to)?;
        out.push_sql(" AND \"row_xid\" = ");
        // The row's own xmin: `<table>` is the read's FROM item.
        push_full_xid(&mut out, |out| {
            self.from.walk_ast(out.reborrow())?;
            out.push_sql(".xmin");
            Ok(())
        })?;
        out.push_sql(")");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::regclass_literal;

    #[test]
    fn the_table_is_a_quoted_literal() {
        assert_eq!(regclass_literal("\"orders\""), "'\"orders\"'::regclass");
        assert_eq!(
            regclass_literal("\"app\".\"o'd\\rs\""),
            "E'\"app\".\"o''d\\\\rs\"'::regclass"
        );
    }
}
