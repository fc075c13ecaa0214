//! Every way a body runs SQL through diesel and diesel-async.

use diesel::dsl::sql;
use diesel::sql_types::BigInt;
use diesel::ExpressionMethods;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use futures_util::future::try_join;

use super::classes::Class;
use idem::Versioned;

use super::{AppError, Counter, SetN};

diesel::table! {
    sink (v) {
        v -> Int8,
    }
}

#[derive(diesel::QueryableByName)]
struct N {
    #[diesel(sql_type = BigInt)]
    #[allow(dead_code)]
    n: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// The query builder's `execute` (an INSERT whose value fails).
    Execute,
    /// `sql_query(..).execute`.
    SqlQuery,
    /// `sql_query(..).get_result`: a statement that returns rows.
    GetResult,
    /// `sql_query(..).get_results`.
    GetResults,
    /// The query builder's `first`.
    First,
    /// The query builder's `load`.
    Load,
    /// `batch_execute`: a simple query.
    BatchExecute,
    /// Inside `conn.transaction(..)`: a savepoint.
    Nested,
    /// Two statements joined in one future (pipelined).
    Joined,
    /// A versioned update (`Model::update(..).execute`).
    Versioned,
}

impl Shape {
    pub const ALL: [Shape; 10] = [
        Shape::Execute,
        Shape::SqlQuery,
        Shape::GetResult,
        Shape::GetResults,
        Shape::First,
        Shape::Load,
        Shape::BatchExecute,
        Shape::Nested,
        Shape::Joined,
        Shape::Versioned,
    ];

    /// A versioned update fails only on what its row meets: locks and races.
    pub fn meets(self, class: Class) -> bool {
        self != Shape::Versioned || class.on_the_row()
    }

    /// Run `expr` (a bigint SQL expression that may fail) the shape's way;
    /// the versioned update writes `row` instead.
    pub async fn run(
        self,
        conn: &mut AsyncPgConnection,
        expr: &str,
        row: i64,
    ) -> Result<(), AppError> {
        let select = format!("SELECT {expr} AS n");
        match self {
            Shape::Execute => {
                diesel::insert_into(sink::table)
                    .values(sink::v.eq(sql::<BigInt>(expr)))
                    .execute(conn)
                    .await?;
            }
            Shape::SqlQuery => {
                diesel::sql_query(select).execute(conn).await?;
            }
            Shape::GetResult => {
                diesel::sql_query(select).get_result::<N>(conn).await?;
            }
            Shape::GetResults => {
                diesel::sql_query(select).get_results::<N>(conn).await?;
            }
            Shape::First => {
                diesel::select(sql::<BigInt>(expr))
                    .first::<i64>(conn)
                    .await?;
            }
            Shape::Load => {
                diesel::select(sql::<BigInt>(expr))
                    .load::<i64>(conn)
                    .await?;
            }
            Shape::BatchExecute => conn.batch_execute(&select).await?,
            Shape::Nested => {
                conn.transaction(async |c| diesel::sql_query(select).execute(c).await)
                    .await?;
            }
            Shape::Joined => {
                let shared: &AsyncPgConnection = conn;
                let (mut first, mut second) = (shared, shared);
                try_join(
                    diesel::insert_into(sink::table)
                        .values(sink::v.eq(0))
                        .execute(&mut first),
                    diesel::sql_query(select).execute(&mut second),
                )
                .await?;
            }
            Shape::Versioned => {
                let c = Counter::find(row).load(conn).await?;
                Counter::update(row)
                    .expect_version(c.version)
                    .set(&SetN { n: c.n + 1 })
                    .execute(conn)
                    .await?;
            }
        }
        Ok(())
    }
}
