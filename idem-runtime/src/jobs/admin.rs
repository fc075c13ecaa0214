//! The operator's side of the queue: dead jobs, requeue, counts.

use std::time::Duration;

use diesel_async::AsyncPgConnection;

use super::{store, JobId};

/// What [`requeue`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Requeued {
    /// The dead job is due now, its ladder started afresh.
    Due,
    /// An unfinished job of the same kind and key exists (the queue holds
    /// one per kind and key): the dead job was left dead.
    LiveExists,
    /// No dead job has this id (never dead, requeued already, or done).
    NotDead,
}

/// Make a dead job due again now, with the whole [`Ladder`](super::Ladder)
/// ahead of it anew; its `last_error` is kept. Its run count (`attempts`)
/// is not reset: it names each run, and the ladder counts from where the
/// requeue left it (`ladder_from`).
///
/// ```no_run
/// # async fn f(conn: &mut diesel_async::AsyncPgConnection) -> Result<(), diesel::result::Error> {
/// use idem_runtime::jobs::{dead, requeue};
/// for job in dead(conn, Some("order.mark_paid"), 100).await? {
///     requeue(conn, job.id).await?;
/// }
/// # Ok(()) }
/// ```
///
/// # Errors
///
/// What PostgreSQL said.
pub async fn requeue(
    conn: &mut AsyncPgConnection,
    id: JobId,
) -> Result<Requeued, diesel::result::Error> {
    Ok(match store::requeue(conn, id.0).await? {
        store::Revived::Due => Requeued::Due,
        store::Revived::LiveExists => Requeued::LiveExists,
        store::Revived::NotDead => Requeued::NotDead,
    })
}

/// A dead job, as [`dead`] lists it.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct DeadJob {
    /// Its id, for [`requeue`].
    pub id: JobId,
    /// [`Job::KIND`](super::Job::KIND).
    pub kind: String,
    /// [`Job::key`](super::Job::key).
    pub key: String,
    /// The job as JSON; its stored text as a JSON string when serde_json
    /// cannot read it back (nested past 128 levels, a number beyond `f64`,
    /// written by hand), the job then dead for that reason (`last_error`).
    pub payload: serde_json::Value,
    /// Whether `payload` is the stored text because it could not be read
    /// back: what tells it from a payload that is a JSON string.
    pub payload_unreadable: bool,
    /// Runs started before it died, over its whole life (a requeue does
    /// not reset the count).
    pub attempts: i32,
    /// What its last run said.
    pub last_error: String,
    /// How long ago it died.
    pub dead_for: Duration,
}

/// Dead jobs of `kind` (or of every kind), oldest first, at most `limit`.
///
/// # Errors
///
/// What PostgreSQL said.
pub async fn dead(
    conn: &mut AsyncPgConnection,
    kind: Option<&str>,
    limit: i64,
) -> Result<Vec<DeadJob>, diesel::result::Error> {
    let rows = store::dead(conn, kind, limit).await?;
    Ok(rows
        .into_iter()
        .map(|mut r| {
            let (payload, payload_unreadable) = match r.job.payload() {
                Ok(payload) => (payload, false),
                Err(_) => (std::mem::take(&mut r.job.payload).into(), true),
            };
            DeadJob {
                payload,
                payload_unreadable,
                id: JobId(r.job.id),
                kind: r.job.kind,
                key: r.job.key,
                attempts: r.job.attempts,
                last_error: r.last_error,
                dead_for: Duration::from_secs_f64(r.dead_for_secs.max(0.0)),
            }
        })
        .collect())
}

/// The queue's counts, for gauges and health checks.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct JobStats {
    /// Jobs waiting for their due time or for a worker.
    pub due: i64,
    /// Jobs a worker holds (or held, until their lease runs out).
    pub running: i64,
    /// Jobs parked after failing past the ladder, waiting for a requeue.
    pub dead: i64,
    /// How long the job that has been due longest has waited past its due
    /// time; `None` when no job is overdue. Growing means too few workers.
    pub oldest_due: Option<Duration>,
}

impl JobStats {
    /// The gauges `record_gauges` (feature `metrics`) sets, by name, with
    /// the values it sets them to: `idem_jobs_due`, `idem_jobs_running`,
    /// `idem_jobs_dead` and `idem_jobs_oldest_due_seconds` (0 when no job
    /// is overdue). Needs no feature: the admin page shows them.
    ///
    /// ```
    /// # fn f(stats: idem_runtime::jobs::JobStats) {
    /// for (name, value) in stats.gauges() {
    ///     println!("{name} {value}");
    /// }
    /// # }
    /// ```
    pub fn gauges(&self) -> [(&'static str, f64); 4] {
        [
            ("idem_jobs_due", self.due as f64),
            ("idem_jobs_running", self.running as f64),
            ("idem_jobs_dead", self.dead as f64),
            (
                "idem_jobs_oldest_due_seconds",
                self.oldest_due.map_or(0.0, |age| age.as_secs_f64()),
            ),
        ]
    }

    /// Set the gauges `idem_jobs_due`, `idem_jobs_running`, `idem_jobs_dead`
    /// and `idem_jobs_oldest_due_seconds` (feature `metrics`) to
    /// [`gauges`](Self::gauges). [`Worker::run`](super::Worker::run) does
    /// this every [`gauge_interval`](super::Worker::gauge_interval).
    #[cfg(feature = "metrics")]
    pub fn record_gauges(&self) {
        for (name, value) in self.gauges() {
            metrics::gauge!(name).set(value);
        }
    }
}

/// Count the queue's jobs by state.
///
/// ```no_run
/// # async fn f(conn: &mut diesel_async::AsyncPgConnection) -> Result<(), diesel::result::Error> {
/// let stats = idem_runtime::jobs::stats(conn).await?;
/// assert_eq!(stats.dead, 0, "a compensation gave up");
/// # Ok(()) }
/// ```
///
/// # Errors
///
/// What PostgreSQL said.
pub async fn stats(conn: &mut AsyncPgConnection) -> Result<JobStats, diesel::result::Error> {
    let row = store::stats(conn).await?;
    Ok(JobStats {
        due: row.due,
        running: row.running,
        dead: row.dead,
        oldest_due: row
            .oldest_due_secs
            .map(|secs| Duration::from_secs_f64(secs.max(0.0))),
    })
}
