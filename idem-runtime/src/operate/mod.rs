//! The operator's API: one set of calls that answer the same questions for
//! idempotency records, outbox events, compensation jobs and inbox records,
//! and check that a database is fit for idem. The `idem` command line
//! (`idem-cli`) is built on it, and so is the admin page (`idem::admin`,
//! the facade's feature `admin`).
//!
//! Every call but `check_stream` (which asks NATS, not the database) takes
//! an idem [`Pool`](crate::Pool) and returns typed values
//! (which also serialize to JSON, durations as seconds) or an
//! [`OperateError`]. They reuse the functions the library already offers
//! ([`outbox::requeue`](crate::outbox::requeue),
//! [`jobs::dead`](crate::jobs::dead), [`idempotency::settle`](crate::idempotency::settle),
//! ...) rather than SQL of their own, except where none existed (a key's
//! record, discarding a dead event or job, the checks of [`doctor()`]).
//!
//! | concern | calls |
//! |---|---|
//! | records (`idem_requests`) | [`record_stats`], [`show_key`], [`settle`], [`settle_forced`], [`purge_expired`] |
//! | outbox (`idem_outbox`) | [`outbox_stats`], [`dead_events`], [`requeue_event`], [`requeue_dead_events`], [`discard_event`] |
//! | jobs (`idem_jobs`) | [`job_stats`], [`dead_jobs`], [`requeue_job`], [`requeue_dead_jobs`], [`discard_job`] |
//! | inbox (`idem_inbox`) | [`inbox_stats`], [`inbox_dead`], [`inbox_purge`] |
//! | schema and server | [`migration_status`], [`migrate`], [`doctor()`] |
//! | the NATS stream (feature `nats`) | `check_stream`: its duplicate window against the relay's horizon |

mod doctor;
mod inbox;
mod jobs;
mod outbox;
mod records;
#[cfg(feature = "nats")]
mod stream;

use std::time::Duration;

pub use doctor::{
    doctor, migrate, migration_status, AppliedMigration, Check, CheckState, DoctorOptions,
    MigrationStatus,
};
pub use inbox::{inbox_dead, inbox_purge, inbox_stats, ConsumerStats, InboxDead};
pub use jobs::{
    dead_jobs, discard_job, job_stats, requeue_dead_jobs, requeue_job, DeadJobRow, JobRequeue,
    JobStatsView,
};
pub use outbox::{
    dead_events, discard_event, outbox_stats, requeue_dead_events, requeue_event, DeadEvent,
    OutboxStatsView,
};
pub use records::{
    purge_expired, record_stats, settle, settle_forced, show_key, Forced, KeyRecord, PurgeView,
    RecordStats,
};
#[cfg(feature = "nats")]
pub use stream::{check_stream, StreamCheck, StreamChoice};

/// Why an operator call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OperateError {
    /// No connection could be had (the server is down, the URL or the
    /// credentials are wrong), or idem's own handling failed.
    #[error(transparent)]
    Idem(#[from] crate::Error),
    /// A statement failed.
    #[error("database error: {0}")]
    Database(#[from] diesel::result::Error),
    /// Applying or reading idem's migrations failed.
    #[error(transparent)]
    Migrate(#[from] crate::MigrateError),
    /// The inbox refused the consumer name.
    #[error(transparent)]
    Inbox(#[from] crate::inbox::InboxError),
    /// An argument is out of range.
    #[error("{0}")]
    Invalid(String),
}

impl From<crate::pool::PoolError> for OperateError {
    fn from(e: crate::pool::PoolError) -> Self {
        OperateError::Idem(crate::Error::from(e))
    }
}

/// Which slice of a list to return: at most `limit` rows after skipping
/// `offset`, oldest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Page {
    /// How many rows at most (at least 1 is asked for).
    pub limit: i64,
    /// How many rows to skip first.
    pub offset: i64,
}

impl Default for Page {
    fn default() -> Self {
        Page {
            limit: 50,
            offset: 0,
        }
    }
}

impl Page {
    /// The rows the existing listing calls must fetch to cover this page.
    fn through(&self) -> i64 {
        self.limit.max(0).saturating_add(self.offset.max(0))
    }

    /// This page's rows out of the first [`through`](Page::through) rows.
    fn cut<T>(&self, rows: Vec<T>) -> Vec<T> {
        rows.into_iter()
            .skip(usize::try_from(self.offset.max(0)).unwrap_or(usize::MAX))
            .take(usize::try_from(self.limit.max(0)).unwrap_or(usize::MAX))
            .collect()
    }
}

/// Seconds from PostgreSQL (`extract(epoch ..)`) as a duration; negative is 0.
fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(if s.is_finite() { s.max(0.0) } else { 0.0 })
}

/// Serializes a duration as seconds (a float), for scripts.
fn ser_secs<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

/// Serializes an optional duration as seconds or null.
fn ser_opt_secs<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_some(&d.as_secs_f64()),
        None => s.serialize_none(),
    }
}
