//! The one UPDATE a versioned row accepts, as a query diesel can cache.
//!
//! diesel's own `UpdateStatement` calls `unsafe_to_cache_prepared()` because an
//! `AsChangeset` with `Option` fields may skip columns and so change the SQL from
//! call to call. A versioned changeset assigns every one of its fields, so its SQL
//! has one fixed shape per changeset type and the prepared statement can be reused:
//! that is the whole reason this type exists instead of `diesel::update`.

use diesel::pg::Pg;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::{Expression, QueryResult, QuerySource};

/// `UPDATE <table> SET <changes>, <version> = <version> + 1 WHERE <filter> RETURNING <returning>`.
///
/// Built only by code that `#[derive(Versioned)]` generates; the filter it receives
/// always holds the tenant, key and expected-version predicates.
#[doc(hidden)]
pub struct CasUpdate<Tab: QuerySource, Set, Filter, Ret> {
    from: Tab::FromClause,
    set: Set,
    version_column: &'static str,
    filter: Filter,
    returning: Ret,
}

impl<Tab: QuerySource, Set, Filter, Ret> CasUpdate<Tab, Set, Filter, Ret> {
    /// Assemble the statement; `version_column` is bumped by one, unconditionally.
    pub fn new(
        table: Tab,
        set: Set,
        version_column: &'static str,
        filter: Filter,
        returning: Ret,
    ) -> Self {
        CasUpdate {
            from: table.from_clause(),
            set,
            version_column,
            filter,
            returning,
        }
    }
}

impl<Tab, Set, Filter, Ret> QueryFragment<Pg> for CasUpdate<Tab, Set, Filter, Ret>
where
    Tab: QuerySource,
    Tab::FromClause: QueryFragment<Pg>,
    Set: QueryFragment<Pg>,
    Filter: QueryFragment<Pg>,
    Ret: QueryFragment<Pg>,
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("UPDATE ");
        self.from.walk_ast(out.reborrow())?;
        out.push_sql(" SET ");
        self.set.walk_ast(out.reborrow())?;
        out.push_sql(", ");
        out.push_identifier(self.version_column)?;
        out.push_sql(" = ");
        out.push_identifier(self.version_column)?;
        out.push_sql(" + 1 WHERE ");
        self.filter.walk_ast(out.reborrow())?;
        out.push_sql(" RETURNING ");
        self.returning.walk_ast(out.reborrow())
    }
}

// No static query id: bind values borrow from the caller, so the type is not
// 'static. diesel then keys its statement cache by the SQL text, which is fixed
// per changeset type, so the statement is still prepared once per connection.
impl<Tab: QuerySource, Set, Filter, Ret> QueryId for CasUpdate<Tab, Set, Filter, Ret> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl<Tab, Set, Filter, Ret> Query for CasUpdate<Tab, Set, Filter, Ret>
where
    Tab: QuerySource,
    Ret: Expression,
{
    type SqlType = Ret::SqlType;
}
