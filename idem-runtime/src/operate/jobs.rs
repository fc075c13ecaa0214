//! Compensation jobs (`idem_jobs`): counts, dead jobs, requeue, discard.

use std::time::Duration;

use diesel::sql_types::BigInt;
use diesel_async::RunQueryDsl;
use serde::Serialize;

use super::{ser_opt_secs, ser_secs, OperateError, Page};
use crate::jobs::{self, JobId, Requeued};
use crate::pool::Pool;

/// [`jobs::JobStats`], serializable.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[non_exhaustive]
pub struct JobStatsView {
    /// Jobs waiting for their due time or a worker.
    pub due: i64,
    /// Jobs a worker holds.
    pub running: i64,
    /// Jobs parked after failing past the ladder.
    pub dead: i64,
    /// How long the longest-overdue job has waited past its due time (in
    /// JSON, seconds or null).
    #[serde(serialize_with = "ser_opt_secs")]
    pub oldest_due: Option<Duration>,
}

impl JobStatsView {
    /// The `metrics` gauges a [`Worker`](crate::jobs::Worker) sets from
    /// these counts, with their values ([`jobs::JobStats::gauges`]): what a
    /// dashboard of them shows after the worker's next refresh.
    pub fn gauges(&self) -> [(&'static str, f64); 4] {
        jobs::JobStats {
            due: self.due,
            running: self.running,
            dead: self.dead,
            oldest_due: self.oldest_due,
        }
        .gauges()
    }
}

/// The queue's counts ([`jobs::stats`]).
///
/// # Errors
///
/// No connection, or what PostgreSQL said.
pub async fn job_stats(pool: &Pool) -> Result<JobStatsView, OperateError> {
    let mut conn = pool.get().await?;
    let s = jobs::stats(&mut conn).await?;
    Ok(JobStatsView {
        due: s.due,
        running: s.running,
        dead: s.dead,
        oldest_due: s.oldest_due,
    })
}

/// A dead job ([`jobs::DeadJob`]), serializable.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct DeadJobRow {
    /// Its id, for [`requeue_job`] and [`discard_job`].
    pub id: i64,
    /// The job's kind.
    pub kind: String,
    /// The job's key.
    pub key: String,
    /// The job as JSON; its stored text as a JSON string when it could not
    /// be read back ([`jobs::DeadJob::payload`]).
    pub payload: serde_json::Value,
    /// Whether `payload` is the stored text, unreadable as JSON.
    pub payload_unreadable: bool,
    /// Runs started over its life.
    pub attempts: i32,
    /// What its last run said.
    pub last_error: String,
    /// How long ago it died (in JSON, seconds).
    #[serde(serialize_with = "ser_secs")]
    pub dead_for: Duration,
}

impl DeadJobRow {
    /// The payload's size as compact JSON (as stored, when unreadable),
    /// shown where the payload itself is hidden (it may hold personal data).
    pub fn payload_bytes(&self) -> usize {
        match (&self.payload, self.payload_unreadable) {
            (serde_json::Value::String(text), true) => text.len(),
            (payload, _) => payload.to_string().len(),
        }
    }
}

/// Dead jobs of `kind` (or of every kind), oldest failure first, one page
/// ([`jobs::dead`]).
///
/// # Errors
///
/// No connection, or what PostgreSQL said.
pub async fn dead_jobs(
    pool: &Pool,
    kind: Option<&str>,
    page: Page,
) -> Result<Vec<DeadJobRow>, OperateError> {
    let mut conn = pool.get().await?;
    let rows = jobs::dead(&mut conn, kind, page.through()).await?;
    Ok(page
        .cut(rows)
        .into_iter()
        .map(|j| DeadJobRow {
            id: j.id.as_i64(),
            kind: j.kind,
            key: j.key,
            payload: j.payload,
            payload_unreadable: j.payload_unreadable,
            attempts: j.attempts,
            last_error: j.last_error,
            dead_for: j.dead_for,
        })
        .collect())
}

/// What a requeue of one job did ([`jobs::Requeued`], as a word).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum JobRequeue {
    /// Due now, its ladder started afresh.
    Due,
    /// A live job of the same kind and key exists: left dead.
    LiveExists,
    /// No dead job has this id.
    NotDead,
}

impl From<Requeued> for JobRequeue {
    fn from(r: Requeued) -> Self {
        match r {
            Requeued::Due => JobRequeue::Due,
            Requeued::LiveExists => JobRequeue::LiveExists,
            Requeued::NotDead => JobRequeue::NotDead,
        }
    }
}

/// Make one dead job due again ([`jobs::requeue`]).
///
/// # Errors
///
/// No connection, or what PostgreSQL said.
pub async fn requeue_job(pool: &Pool, id: i64) -> Result<JobRequeue, OperateError> {
    let mut conn = pool.get().await?;
    Ok(jobs::requeue(&mut conn, JobId::from(id)).await?.into())
}

/// Requeue at most `limit` dead jobs of `kind` (or of every kind), oldest
/// failure first; returns each id with what its requeue did.
///
/// # Errors
///
/// No connection, or what PostgreSQL said; the jobs requeued before stay so.
pub async fn requeue_dead_jobs(
    pool: &Pool,
    kind: Option<&str>,
    limit: i64,
) -> Result<Vec<(i64, JobRequeue)>, OperateError> {
    // At most `limit`: none for 0 (or less), never one more than asked.
    if limit <= 0 {
        return Ok(Vec::new());
    }
    let mut conn = pool.get().await?;
    let dead = jobs::dead(&mut conn, kind, limit).await?;
    let mut done = Vec::with_capacity(dead.len());
    for job in dead {
        done.push((
            job.id.as_i64(),
            jobs::requeue(&mut conn, job.id).await?.into(),
        ));
    }
    Ok(done)
}

/// Delete one dead job: its compensation will not run. Returns whether a
/// dead job had this id (due and running jobs are never discarded).
///
/// # Errors
///
/// No connection, or what PostgreSQL said.
pub async fn discard_job(pool: &Pool, id: i64) -> Result<bool, OperateError> {
    let mut conn = pool.get().await?;
    let n = diesel::sql_query("DELETE FROM idem_jobs WHERE id = $1 AND state = 'dead'")
        .bind::<BigInt, _>(id)
        .execute(&mut conn)
        .await?;
    Ok(n > 0)
}
