//! The SQL of the jobs queue: every statement that reads or writes
//! `idem_jobs`. Nothing here opens or ends a transaction; the caller decides
//! which statements share one. Times are the database's (`now()`), so
//! workers on machines whose clocks disagree still agree on what is due.

use std::time::Duration;

use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel::sql_types::{Array, BigInt, Bool, Double, Integer, Jsonb, Nullable, Text};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::sql::millis;

#[derive(QueryableByName)]
struct IdRow {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

/// Write a job unless an unfinished one of its (kind, key) exists. The
/// unique partial index arbitrates: an insert meeting an uncommitted row of
/// the same (kind, key) waits for its transaction, so two enqueuers never
/// both write; a run deletes its job only in its last statement, so an
/// insert waits for a run at most for that run's `COMMIT`.
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

/// Collapse an enqueue into the unfinished job of (kind, key), if any:
/// count it in `collapsed`. A statement of its own: under read committed it
/// sees the row the insert above waited for, which the insert's snapshot
/// did not.
///
/// The update's row lock (`FOR NO KEY UPDATE`) is what makes the count
/// safe until the deciding transaction ends: a claim (`FOR UPDATE SKIP
/// LOCKED`) passes the job by, and a run's end ([`complete`], [`fail`])
/// waits for it, then sees the count it left. A run in its handler holds
/// the row only `FOR KEY SHARE`, which this does not wait for. Two
/// enqueuers of one (kind, key) queue here, as two first enqueues queue on
/// the unique index.
pub(crate) async fn collapse(
    conn: &mut AsyncPgConnection,
    kind: &str,
    key: &str,
) -> Result<Option<i64>, DieselError> {
    let rows: Vec<IdRow> = diesel::sql_query(
        "UPDATE idem_jobs SET collapsed = collapsed + 1
         WHERE kind = $1 AND key = $2 AND state <> 'dead'
         RETURNING id",
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
    /// The stored payload as text, read back by [`Claimed::payload`]: one
    /// serde_json cannot read (nested past its limit, a number beyond
    /// `f64`, written by hand) must not fail the whole claim.
    #[diesel(sql_type = Text)]
    pub(crate) payload: String,
    /// Runs started, this one included: the run's token, never reused.
    #[diesel(sql_type = Integer)]
    pub(crate) attempts: i32,
    /// `attempts` when the ladder last started afresh.
    #[diesel(sql_type = Integer)]
    pub(crate) ladder_from: i32,
    /// Enqueues collapsed into the job when it was read.
    #[diesel(sql_type = BigInt)]
    pub(crate) collapsed: i64,
}

impl Claimed {
    /// The payload as JSON, or why serde_json cannot read it back.
    pub(crate) fn payload(&self) -> Result<serde_json::Value, serde_json::Error> {
        serde_json::from_str(&self.payload)
    }

    /// Failed runs on the current ladder if this one fails (1 for the first).
    pub(crate) fn failures(&self) -> u32 {
        u32::try_from(self.attempts.saturating_sub(self.ladder_from)).unwrap_or(0)
    }
}

/// Claims up to `$2` jobs of the kinds `$1` that are due, or running with a
/// lease that ran out (their worker died), for `$3` milliseconds, naming
/// the worker `$4`, and counts the run.
///
/// `FOR UPDATE SKIP LOCKED` lets workers claim side by side, and skips a job
/// whose handler's transaction is open (it holds the row, see [`hold`]): a
/// job is never run twice at once, even past its lease. It also skips a job
/// an open enqueue collapsed into ([`collapse`]): that job runs once the
/// decision has committed, and sees it. A row another worker claimed after
/// this statement's snapshot is re-checked against its newest version
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
RETURNING j.id, j.kind, j.key, j.payload::text AS payload, j.attempts, j.ladder_from, j.collapsed";

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

/// In the handler's transaction, before the handler: hold the job if run
/// `attempts` still owns it, and read how many enqueues had collapsed into
/// it. `FOR KEY SHARE` keeps every claim (`FOR UPDATE`) off the job until
/// the transaction ends, and no other run can pass this with the same
/// token; an enqueue's [`collapse`] does not wait for it, so a long handler
/// never holds up the transaction that decides to compensate again. `None`
/// means a newer run took over (this one outlived its lease) and the
/// handler must not run.
pub(crate) async fn hold(
    conn: &mut AsyncPgConnection,
    id: i64,
    attempts: i32,
) -> Result<Option<i64>, DieselError> {
    let rows: Vec<CollapsedRow> = diesel::sql_query(
        "SELECT collapsed FROM idem_jobs
         WHERE id = $1 AND state = 'running' AND attempts = $2
         FOR KEY SHARE",
    )
    .bind::<BigInt, _>(id)
    .bind::<Integer, _>(attempts)
    .load(conn)
    .await?;
    Ok(rows.into_iter().next().map(|row| row.collapsed))
}

#[derive(QueryableByName)]
struct CollapsedRow {
    #[diesel(sql_type = BigInt)]
    collapsed: i64,
}

/// How a run's end left its job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Completed {
    /// Deleted: no enqueue collapsed into it since the run began.
    Deleted,
    /// Due again at once, its ladder started afresh: an enqueue collapsed
    /// into it after the run began, so the handler may not have seen that
    /// decision, and a run that starts after it is owed.
    Rearmed,
    /// The run no longer owns the job (only if someone edited the row by
    /// hand): the caller rolls back.
    Gone,
}

/// In the handler's transaction, after the handler: end the job of run
/// `attempts`, which started having seen `seen` collapsed enqueues.
///
/// The row is locked `FOR UPDATE` first, which waits for any deciding
/// transaction still open on it ([`collapse`]) and then reads its newest
/// version (under read committed; under repeatable read or serializable a
/// count moved by a decision that committed after the run's snapshot is a
/// serialization failure, and the retry loop runs the handler again, now
/// seeing it). From then on a new enqueue waits for this transaction, then
/// finds the job gone (it writes a new one) or due (it collapses into it).
pub(crate) async fn complete(
    conn: &mut AsyncPgConnection,
    id: i64,
    attempts: i32,
    seen: i64,
) -> Result<Completed, DieselError> {
    let rows: Vec<CollapsedRow> = diesel::sql_query(
        "SELECT collapsed FROM idem_jobs
         WHERE id = $1 AND state = 'running' AND attempts = $2
         FOR UPDATE",
    )
    .bind::<BigInt, _>(id)
    .bind::<Integer, _>(attempts)
    .load(conn)
    .await?;
    let Some(now) = rows.into_iter().next().map(|row| row.collapsed) else {
        return Ok(Completed::Gone);
    };
    if now == seen {
        diesel::sql_query("DELETE FROM idem_jobs WHERE id = $1")
            .bind::<BigInt, _>(id)
            .execute(conn)
            .await?;
        return Ok(Completed::Deleted);
    }
    diesel::sql_query(
        "UPDATE idem_jobs SET
             state = 'due',
             run_at = now(),
             locked_until = NULL,
             locked_by = NULL,
             ladder_from = attempts,
             updated_at = now()
         WHERE id = $1",
    )
    .bind::<BigInt, _>(id)
    .execute(conn)
    .await?;
    Ok(Completed::Rearmed)
}

/// How a failed run left its job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Failed {
    /// Due again after the ladder's next step.
    Retry,
    /// Parked as dead.
    Dead,
    /// It would have died, but an enqueue collapsed into it after the run
    /// began: due again at once, its ladder started afresh.
    Revived,
}

#[derive(QueryableByName)]
struct StateRow {
    #[diesel(sql_type = Text)]
    state: String,
    #[diesel(sql_type = Bool)]
    revived: bool,
}

/// Record a failed run, if it is still the job's newest: due again after
/// `retry_after`, or dead when that is `None`, unless an enqueue collapsed
/// into the job since the run began having seen `seen` of them (the count
/// moved): that decision is owed a run that starts after it, so the job is
/// due again at once with its ladder started afresh. The update waits for
/// a deciding transaction still open on the row and then sees its count.
/// `None` when a newer run took over. `run_at - failed_at` is exactly the
/// step waited.
pub(crate) async fn fail(
    conn: &mut AsyncPgConnection,
    id: i64,
    attempts: i32,
    seen: i64,
    error: &str,
    retry_after: Option<Duration>,
) -> Result<Option<Failed>, DieselError> {
    let rows: Vec<StateRow> = diesel::sql_query(
        "UPDATE idem_jobs SET
             last_error = $3,
             failed_at = now(),
             locked_until = NULL,
             locked_by = NULL,
             updated_at = now(),
             state = CASE WHEN $4::bigint IS NULL AND collapsed = $5 THEN 'dead' ELSE 'due' END,
             run_at = CASE WHEN $4::bigint IS NOT NULL THEN now() + $4::bigint * interval '1 millisecond'
                           WHEN collapsed = $5 THEN run_at
                           ELSE now() END,
             ladder_from = CASE WHEN $4::bigint IS NULL AND collapsed <> $5 THEN attempts
                                ELSE ladder_from END
         WHERE id = $1 AND state = 'running' AND attempts = $2
         RETURNING state, ($4::bigint IS NULL AND state = 'due') AS revived",
    )
    .bind::<BigInt, _>(id)
    .bind::<Integer, _>(attempts)
    .bind::<Text, _>(error)
    .bind::<Nullable<BigInt>, _>(retry_after.map(millis))
    .bind::<BigInt, _>(seen)
    .load(conn)
    .await?;
    Ok(rows.into_iter().next().map(|row| match row.state.as_str() {
        "dead" => Failed::Dead,
        _ if row.revived => Failed::Revived,
        _ => Failed::Retry,
    }))
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

/// Make a dead job due now with its ladder started afresh, unless an
/// unfinished job of its (kind, key) exists (the unique index allows one).
/// The run count stays: it is the token of every run, and must not repeat.
pub(crate) async fn requeue(conn: &mut AsyncPgConnection, id: i64) -> Result<Revived, DieselError> {
    let updated = diesel::sql_query(
        "UPDATE idem_jobs j SET state = 'due', ladder_from = attempts, run_at = now(), updated_at = now()
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
        "SELECT id, kind, key, payload::text AS payload, attempts, ladder_from, collapsed, last_error,
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
