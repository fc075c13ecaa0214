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

use diesel::pg::Pg;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::result::Error as DieselError;
use diesel::sql_types::{BigInt, Text};
use diesel::QueryResult;
use diesel_async::{AsyncPgConnection, RunQueryDsl};

/// What one applied transition records: the model's table (as diesel writes
/// it), the version the transition wrote, and the edge it took (as the states'
/// texts). Made by `Transition::execute`, handed to the generated
/// `__transition`.
#[doc(hidden)]
#[derive(Debug)]
pub struct TransitionRecord {
    pub(super) table: String,
    pub(super) version: i64,
    pub(super) from: &'static str,
    pub(super) to: &'static str,
}

impl TransitionRecord {
    /// Whether `last`, the row's last recorded transition, is this one: the
    /// same version written, by the same edge. The row was read first and
    /// found at that version; a record and its row are written by one
    /// statement, so a record at the row's version is the record of the
    /// write that made it (a later transition would have moved both on).
    pub(super) fn made(&self, last: Option<LastTransition>) -> bool {
        last.is_some_and(|(version, from, to)| {
            version == self.version && from == self.from && to == self.to
        })
    }
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

const CTE: &str = "\"idem_transition\"";

/// `WITH "idem_transition" AS (<the transition's UPDATE .. RETURNING ..>),
/// .. (the upsert of its record, one row per row the UPDATE returned) SELECT *
/// FROM "idem_transition"`: the row as written, and its record, in one
/// statement. Built only by the code `#[derive(Versioned)]` generates.
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
             (\"table_name\", \"identity\", \"version\", \"from_state\", \"to_state\") SELECT ",
        );
        out.push_bind_param::<Text, _>(&self.record.table)?;
        out.push_sql(", ");
        self.identity.walk_ast(out.reborrow())?;
        out.push_sql(", ");
        out.push_bind_param::<BigInt, _>(&self.record.version)?;
        out.push_sql(", ");
        out.push_bind_param::<Text, _>(self.record.from)?;
        out.push_sql(", ");
        out.push_bind_param::<Text, _>(self.record.to)?;
        out.push_sql(" FROM ");
        out.push_sql(CTE);
        out.push_sql(
            " ON CONFLICT (\"table_name\", \"identity\") DO UPDATE SET \
             \"version\" = EXCLUDED.\"version\", \"from_state\" = EXCLUDED.\"from_state\", \
             \"to_state\" = EXCLUDED.\"to_state\", \"recorded_at\" = EXCLUDED.\"recorded_at\") \
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

/// The last transition recorded for a row: the version it wrote and the
/// edge it took (`from`, `to`, as the states' texts).
pub(super) type LastTransition = (i64, String, String);

/// `SELECT version, from_state, to_state FROM idem_transitions WHERE
/// table_name = $1 AND identity = <identity>`.
struct ReadRecord<'a, Id> {
    table: &'a str,
    identity: Id,
}

impl<Id: QueryFragment<Pg>> QueryFragment<Pg> for ReadRecord<'_, Id> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql(
            "SELECT \"version\", \"from_state\", \"to_state\" FROM \"idem_transitions\" \
             WHERE \"table_name\" = ",
        );
        out.push_bind_param::<Text, _>(self.table)?;
        out.push_sql(" AND \"identity\" = ");
        self.identity.walk_ast(out.reborrow())
    }
}

impl<Id> QueryId for ReadRecord<'_, Id> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl<Id> Query for ReadRecord<'_, Id> {
    type SqlType = (BigInt, Text, Text);
}

/// The last transition recorded for the row of `table` with `identity`, if
/// any.
pub(super) async fn last_transition<Id>(
    conn: &mut AsyncPgConnection,
    table: &str,
    identity: Id,
) -> Result<Option<LastTransition>, DieselError>
where
    Id: QueryFragment<Pg> + Send + Sync,
{
    use diesel::OptionalExtension as _;
    ReadRecord { table, identity }
        .get_result::<LastTransition>(conn)
        .await
        .optional()
}
