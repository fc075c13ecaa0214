//! The SQL of the jobs queue: every statement that reads or writes
//! `idem_jobs`. Nothing here opens or ends a transaction; the caller decides
//! which statements share one. Times are the database's (`now()`), so
//! workers on machines whose clocks disagree still agree on what is due.

use std::time::Duration;

use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel::sql_types::{Array, BigInt, Double, Integer, Jsonb, Nullable, Text};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};

#[derive(QueryableByName)]
struct IdRow {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

/// Write a job unless an unfinished one of its (kind, key) exists. The
/// unique partial index arbitrates: an insert meeting an uncommitted row of
/// the same (kind, key) waits for its transaction, so two enqueuers never
/// both write, and an enqueue meeting a running job (whose handler's
/// transaction deleted the row) waits for that run's outcome.
pub(crate) async fn insert(
    conn: &mut AsyncPgConnection,
    kind: &str,
    key: &str,
    payload: &serde_json::Value,
    delay: Duration,
) -> Result<Option<i64>, DieselError> {
    let rows: Vec<IdRow> = diesel::sql_query(
        "INSERT INTO idem_jobs (kind, key, payload, run_at)
         VALUES ($1, $2, $3, now() + $4 * interval '1 millisecond')
         ON CONFLICT (kind, key) WHERE state <> 'dead' DO NOTHING
         RETURNING id",
    )
    .bind::<Text, _>(kind)
    .bind::<Text, _>(key)
    .bind::<Jsonb, _>(payload)
    .bind::<BigInt, _>(millis(delay))
    .load(conn)
    .await?;
    Ok(rows.into_iter().next().map(|row| row.id))
}

/// The unfinished job of (kind, key), if any. A statement of its own: under
/// read committed it sees the row the insert above waited for, which the
/// insert's snapshot did not.
pub(crate) async fn unfinished(
    conn: &mut AsyncPgConnection,
    kind: &str,
    key: &str,
) -> Result<Option<i64>, DieselError> {
    let rows: Vec<IdRow> = diesel::sql_query(
        "SELECT id FROM idem_jobs WHERE kind = $1 AND key = $2 AND state <> 'dead'",
    )
    .bind::<Text, _>(kind)
    .bind::<Text, _>(key)
    .load(conn)
    .await?;
    Ok(rows.into_iter().next().map(|row| row.id))
}

/// A job a worker claimed: its run number is the token of this run.
#[derive(Debug, QueryableByName)]
pub(crate) struct Claimed {
    #[diesel(sql_type = BigInt)]
    pub(crate) id: i64,
    #[diesel(sql_type = Text)]
    pub(crate) kind: String,
    #[diesel(sql_type = Text)]
    pub(crate) key: String,
    #[diesel(sql_type = Jsonb)]
    pub(crate) payload: serde_json::Value,
    #[diesel(sql_type = Integer)]
    pub(crate) attempts: i32,
}

/// Claims up to `$2` jobs of the kinds `$1` that are due, or running with a
/// lease that ran out (their worker died), for `$3` milliseconds, naming
/// the worker `$4`, and counts the run.
///
/// `FOR UPDATE SKIP LOCKED` lets workers claim side by side, and skips a job
/// whose handler's transaction is open (it deleted the row): a job is never
/// run twice at once, even past its lease. A row another worker claimed
/// after this statement's snapshot is re-checked against its newest version
/// before it is locked, and is then no longer due.
const CLAIM_SQL: &str = "
WITH due AS (
    SELECT id FROM idem_jobs
    WHERE kind = ANY($1)
      AND ((state = 'due' AND run_at <= now())
        OR (state = 'running' AND locked_until <= now()))
    ORDER BY run_at, id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
UPDATE idem_jobs j
SET state = 'running',
    attempts = j.attempts + 1,
    locked_until = now() + $3 * interval '1 millisecond',
    locked_by = $4,
    updated_at = now()
FROM due WHERE j.id = due.id
RETURNING j.id, j.kind, j.key, j.payload, j.attempts";

/// Claim up to `batch` jobs of `kinds` for `lease`.
pub(crate) async fn claim(
    conn: &mut AsyncPgConnection,
    kinds: &[&str],
    batch: i64,
    lease: Duration,
    worker: &str,
) -> Result<Vec<Claimed>, DieselError> {
    diesel::sql_query(CLAIM_SQL)
        .bind::<Array<Text>, _>(kinds)
        .bind::<BigInt, _>(batch)
        .bind::<BigInt, _>(millis(lease))
        .bind::<Text, _>(worker)
        .load(conn)
        .await
}

/// In the handler's transaction, before the handler: delete the job if run
/// `attempts` still holds it. The row lock this takes keeps every other
/// claim off the job until the transaction ends; false means a newer run
/// took over (this one outlived its lease) and the handler must not run.
pub(crate) async fn complete(
    conn: &mut AsyncPgConnection,
    id: i64,
    attempts: i32,
) -> Result<bool, DieselError> {
    let deleted = diesel::sql_query(
        "DELETE FROM idem_jobs WHERE id = $1 AND state = 'running' AND attempts = $2",
    )
    .bind::<BigInt, _>(id)
    .bind::<Integer, _>(attempts)
    .execute(conn)
    .await?;
    Ok(deleted == 1)
}

/// Record a failed run, if it is still the job's newest: due again after
/// `retry_after`, or dead when that is `None`. False when a newer run took
/// over. `run_at - failed_at` is exactly the step waited.
pub(crate) async fn fail(
    conn: &mut AsyncPgConnection,
    id: i64,
    attempts: i32,
    error: &str,
    retry_after: Option<Duration>,
) -> Result<bool, DieselError> {
    let updated = diesel::sql_query(
        "UPDATE idem_jobs SET
             last_error = $3,
             failed_at = now(),
             locked_until = NULL,
             locked_by = NULL,
             updated_at = now(),
             state = CASE WHEN $4::bigint IS NULL THEN 'dead' ELSE 'due' END,
             run_at = CASE WHEN $4::bigint IS NULL THEN run_at
                           ELSE now() + $4::bigint * interval '1 millisecond' END
         WHERE id = $1 AND state = 'running' AND attempts = $2",
    )
    .bind::<BigInt, _>(id)
    .bind::<Integer, _>(attempts)
    .bind::<Text, _>(error)
    .bind::<Nullable<BigInt>, _>(retry_after.map(millis))
    .execute(conn)
    .await?;
    Ok(updated == 1)
}

/// What a requeue found.
pub(crate) enum Revived {
    /// The dead job is due now.
    Due,
    /// An unfinished job of the same (kind, key) exists; the dead one stays.
    LiveExists,
    /// No dead job has this id.
    NotDead,
}

/// Make a dead job due now with its run count reset, unless an unfinished
/// job of its (kind, key) exists (the unique index allows one).
pub(crate) async fn requeue(conn: &mut AsyncPgConnection, id: i64) -> Result<Revived, DieselError> {
    let updated = diesel::sql_query(
        "UPDATE idem_jobs j SET state = 'due', attempts = 0, run_at = now(), updated_at = now()
         WHERE id = $1 AND state = 'dead' AND NOT EXISTS (
             SELECT FROM idem_jobs l WHERE l.kind = j.kind AND l.key = j.key AND l.state <> 'dead'
         )",
    )
    .bind::<BigInt, _>(id)
    .execute(conn)
    .await;
    match updated {
        Ok(1) => return Ok(Revived::Due),
        Ok(_) => {}
        // A live job committed after this statement's snapshot.
        Err(DieselError::DatabaseError(DatabaseErrorKind::UniqueViolation, _)) => {
            return Ok(Revived::LiveExists)
        }
        Err(e) => return Err(e),
    }
    let still_dead: Vec<IdRow> =
        diesel::sql_query("SELECT id FROM idem_jobs WHERE id = $1 AND state = 'dead'")
            .bind::<BigInt, _>(id)
            .load(conn)
            .await?;
    Ok(if still_dead.is_empty() {
        Revived::NotDead
    } else {
        Revived::LiveExists
    })
}

/// A dead job, as [`dead`](super::dead) lists it: the columns a claim
/// reads, and why and since when it is dead.
#[derive(QueryableByName)]
pub(crate) struct DeadRow {
    #[diesel(embed)]
    pub(crate) job: Claimed,
    #[diesel(sql_type = Text)]
    pub(crate) last_error: String,
    #[diesel(sql_type = Double)]
    pub(crate) dead_for_secs: f64,
}

/// Dead jobs, of `kind` or of every kind, oldest failure first.
pub(crate) async fn dead(
    conn: &mut AsyncPgConnection,
    kind: Option<&str>,
    limit: i64,
) -> Result<Vec<DeadRow>, DieselError> {
    diesel::sql_query(
        "SELECT id, kind, key, payload, attempts, last_error,
                extract(epoch FROM now() - failed_at)::float8 AS dead_for_secs
         FROM idem_jobs WHERE state = 'dead' AND ($1::text IS NULL OR kind = $1)
         ORDER BY failed_at, id LIMIT $2",
    )
    .bind::<Nullable<Text>, _>(kind)
    .bind::<BigInt, _>(limit)
    .load(conn)
    .await
}

#[derive(QueryableByName)]
pub(crate) struct StatsRow {
    #[diesel(sql_type = BigInt)]
    pub(crate) due: i64,
    #[diesel(sql_type = BigInt)]
    pub(crate) running: i64,
    #[diesel(sql_type = BigInt)]
    pub(crate) dead: i64,
    #[diesel(sql_type = Nullable<Double>)]
    pub(crate) oldest_due_secs: Option<f64>,
}

/// Counts by state, and how long the longest-waiting due job is overdue.
pub(crate) async fn stats(conn: &mut AsyncPgConnection) -> Result<StatsRow, DieselError> {
    diesel::sql_query(
        "SELECT count(*) FILTER (WHERE state = 'due') AS due,
                count(*) FILTER (WHERE state = 'running') AS running,
                count(*) FILTER (WHERE state = 'dead') AS dead,
                extract(epoch FROM now() - min(run_at) FILTER (WHERE state = 'due' AND run_at <= now()))::float8
                    AS oldest_due_secs
         FROM idem_jobs",
    )
    .get_result(conn)
    .await
}

/// A duration in whole milliseconds, for `interval` arithmetic in SQL.
fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}
