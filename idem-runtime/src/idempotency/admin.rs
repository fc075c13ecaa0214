//! What operators and reapers do with idempotency records outside any
//! request: purge expired records, settle an outcome-unknown one.

use diesel::sql_types::{BigInt, Binary, Jsonb, Nullable, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use serde::Serialize;

use std::time::Duration;

use super::request::{storable, Scope};
use super::store;
use crate::error::Error;
use crate::pool::Pool;
use crate::retry::{retry, RetryPolicy};
use scoped_futures::ScopedFutureExt;

/// [`settle`]'s deadline, and how long its `COMMIT` may go unanswered before
/// it is reported as [`Error::CommitUnknown`].
const SETTLE_TIMEOUT: Duration = Duration::from_secs(10);

/// What [`purge_expired`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PurgeReport {
    /// Completed records past their retention, deleted.
    pub deleted: u64,
    /// In-progress records whose lease ran out, now marked outcome unknown.
    pub marked_unknown: u64,
    /// Records in outcome unknown, kept until settled.
    pub unknown: u64,
}

#[derive(diesel::QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// Delete completed records past their retention, `batch` rows per
/// statement; mark in-progress records whose lease ran out as outcome
/// unknown. In-progress and unknown records are never deleted.
///
/// Each batch is a statement of its own (autocommit), so a long purge holds
/// no lock for long. Give it a direct connection: behind a transaction
/// pooler (PgBouncer) with prepared statements, run it inside a transaction
/// instead, since a bare statement's Parse and Bind may reach different
/// server connections there.
pub async fn purge_expired(
    conn: &mut AsyncPgConnection,
    batch: i64,
) -> diesel::QueryResult<PurgeReport> {
    let mut report = PurgeReport::default();
    loop {
        let deleted = diesel::sql_query(store::PURGE_BATCH)
            .bind::<BigInt, _>(batch.max(1))
            .execute(conn)
            .await? as u64;
        report.deleted += deleted;
        if deleted == 0 {
            break;
        }
    }
    report.marked_unknown = diesel::sql_query(store::EXPIRE_LEASES)
        .execute(conn)
        .await? as u64;
    report.unknown = diesel::sql_query(store::COUNT_UNKNOWN)
        .get_result::<Count>(conn)
        .await?
        .n as u64;
    Ok(report)
}

/// How [`settle`] decides a record whose outcome was unknown.
#[derive(Debug, Clone)]
pub enum Settlement {
    /// The target system did it: store this response and replay it from now on.
    Completed(serde_json::Value),
    /// The target system did not: release the key, so a retry runs again.
    Released,
}

/// Decide an outcome-unknown (or stuck in-progress) record after checking
/// with the target system. `scope` is the scope value, as the function's
/// `scope = ..` gives it (`&()` for none). Returns false when there was no
/// such record.
///
/// ```no_run
/// use idem_runtime::idempotency::{settle, Settlement};
/// # async fn demo(pool: &idem_runtime::Pool) -> Result<(), Box<dyn std::error::Error>> {
/// let tenant = 7_i64;
/// let released = settle(pool, &(tenant,), "refund-1001", Settlement::Released).await?;
/// # let _ = released; Ok(()) }
/// ```
pub async fn settle<S: Serialize + ?Sized>(
    pool: &Pool,
    scope: &S,
    key: &str,
    settlement: Settlement,
) -> Result<bool, Error> {
    let scope = Scope::of(scope)?.hash;
    if let Settlement::Completed(response) = &settlement {
        // Stored, it must read back like any response; its size is the
        // operator's call.
        storable(response, usize::MAX).map_err(Error::Unstorable)?;
    }
    // In a transaction of its own, like every statement idem runs on a
    // pooled connection (behind a transaction pooler a bare statement's
    // Parse and Bind may reach different server connections), through the
    // retry loop like every transaction idem runs: a race replays it, and a
    // COMMIT that goes unanswered is `CommitUnknown`.
    let policy = RetryPolicy::new()
        .deadline(SETTLE_TIMEOUT)
        .commit_timeout(SETTLE_TIMEOUT);
    let (scope, settlement) = (&scope, &settlement);
    let n: usize = retry(pool, policy, "idem.settle", |conn| {
        async move {
            let written = match settlement {
                Settlement::Completed(response) => {
                    diesel::sql_query(store::SETTLE_COMPLETED)
                        .bind::<Text, _>(scope)
                        .bind::<Text, _>(key)
                        .bind::<Jsonb, _>(response)
                        .execute(conn)
                        .await
                }
                Settlement::Released => {
                    diesel::sql_query(store::RELEASE)
                        .bind::<Text, _>(scope)
                        .bind::<Text, _>(key)
                        .bind::<Nullable<Binary>, _>(None::<&[u8]>)
                        .execute(conn)
                        .await
                }
            };
            written.map_err(Error::Database)
        }
        .scope_boxed()
    })
    .await?;
    Ok(n == 1)
}
