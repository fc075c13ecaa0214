//! The delayed compensation queue: when a write loses a race and the caller
//! would rather not fail, it writes a job that makes the change later, and a
//! worker runs it after a delay, again after longer ones if it fails, and
//! parks it as dead past the last step.
//!
//! * **Enqueue with the decision.** [`enqueue`] inside an attempt of a
//!   `#[retryable]` or `#[idempotent]` function writes the job to
//!   `idem_jobs` in the attempt's transaction: the job exists exactly when
//!   the decision to compensate committed. Outside an attempt it is refused
//!   at run time ([`EnqueueError::OutsideAttempt`]), as
//!   [`outbox::emit`](crate::outbox::emit) is.
//! * **One unfinished job per (kind, key).** A unique partial index makes an
//!   enqueue of a (kind, key) that is already due or running collapse into
//!   that job ([`Enqueued::Collapsed`]; the first payload wins). An enqueue
//!   never collapses into a run that already committed: a running job's
//!   transaction holds its row, so the enqueue waits for it and then either
//!   finds the job gone (a new one is written) or due again (it failed, and
//!   will run again after the enqueue).
//! * **Effect and completion commit together.** A [`Worker`] claims due jobs
//!   of the kinds it handles in one short statement (`FOR UPDATE SKIP
//!   LOCKED`, a lease, the run counted), then runs each handler under the
//!   retry loop ([`crate::retry`]); the attempt's first statement deletes
//!   the job, so the handler's writes and the job's end commit or roll back
//!   as one. Serialization failures and deadlocks are replayed.
//! * **The ladder.** A handler that fails (after the retry loop gave up)
//!   makes its job due again after the next step of the worker's
//!   [`Ladder`] (default 5 s, 30 s, 2 min, counted in database time);
//!   after the last step the next failure parks it as `dead` with its last
//!   error. [`requeue`] makes a dead job due again; [`dead`] lists them.
//! * **Crashes.** A worker killed mid-job leaves its transaction to the
//!   server, which rolls it back; the job stays `running` until its lease
//!   ends and is then claimed again, by any worker of any process. A run
//!   completes or fails only while it is still the job's newest (the claim
//!   count is its token), so a worker that outlived its lease cannot undo
//!   the next one's run.
//!
//! # The table
//!
//! `idem_jobs` (migration 8, applied by [`crate::migrate()`]), every column
//! described with `COMMENT ON`:
//!
//! | column | meaning |
//! |---|---|
//! | `id` | the [`JobId`] |
//! | `kind`, `key` | [`Job::KIND`] and [`Job::key`]; unique among unfinished jobs |
//! | `payload` | the job as JSON |
//! | `state` | `due`, `running` (leased) or `dead` |
//! | `attempts` | runs started (claims) |
//! | `run_at` | due time, in database time |
//! | `locked_until`, `locked_by` | a running job's lease and its worker |
//! | `last_error`, `failed_at` | the last failure, and when |
//! | `created_at`, `updated_at` | when it was enqueued, and last changed |

mod admin;
mod enqueue;
mod ladder;
mod run;
mod store;
mod worker;

use std::fmt;

use serde::de::DeserializeOwned;
use serde::Serialize;

pub use admin::{dead, requeue, stats, DeadJob, JobStats, Requeued};
pub use enqueue::{enqueue, enqueue_after, EnqueueError, Enqueued, InvalidJob};
pub use ladder::Ladder;
pub use worker::{Round, Worker, WorkerError};

/// A typed compensation job that [`enqueue`] writes and a [`Worker`] runs.
///
/// ```
/// use idem_runtime::jobs::Job;
///
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct MarkPaid { order: i64, payment: String }
///
/// impl Job for MarkPaid {
///     const KIND: &'static str = "order.mark_paid";
///     fn key(&self) -> String { format!("order-{}", self.order) }
/// }
/// ```
pub trait Job: Serialize + DeserializeOwned + Send + Sync + 'static {
    /// The job type: a worker runs the jobs of the kinds it has handlers
    /// for. 1 to 255 bytes, no control characters.
    const KIND: &'static str;
    /// What the job is about (an order, an account): one unfinished job per
    /// (kind, key), later enqueues collapse into it. 1 to 255 bytes, no
    /// control characters.
    fn key(&self) -> String;
}

/// The id of an enqueued job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct JobId(pub(crate) i64);

impl JobId {
    /// The id as stored in `idem_jobs.id`.
    pub fn as_i64(&self) -> i64 {
        self.0
    }
}

impl From<i64> for JobId {
    fn from(id: i64) -> Self {
        JobId(id)
    }
}

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}
