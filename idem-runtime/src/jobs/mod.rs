//! The delayed compensation queue: when a write loses a race and the caller
//! would rather not fail, it writes a job that makes the change later, and a
//! worker runs it after a delay, again after longer ones if it fails, and
//! parks it as dead past the last step.
//!
//! * **Enqueue with the decision.** [`enqueue()`] inside an attempt of a
//!   `#[retryable]` or `#[idempotent]` function writes the job to
//!   `idem_jobs` in the attempt's transaction: the job exists exactly when
//!   the decision to compensate committed. Outside an attempt it is refused
//!   at run time ([`EnqueueError::OutsideAttempt`]), as
//!   [`outbox::emit`](crate::outbox::emit) is.
//! * **One unfinished job per (kind, key).** A unique partial index makes an
//!   enqueue of a (kind, key) that is already due or running collapse into
//!   that job ([`Enqueued::Collapsed`]; the first payload wins), counted on
//!   its row (`collapsed`). A collapsed enqueue is always followed by a run
//!   that starts after its decision committed, whatever the worker was
//!   doing: the count's row lock keeps claims off a due job until the
//!   deciding transaction ends; a run reads the count when it starts and
//!   at its end locks the row, waiting for a deciding transaction still
//!   open on it, and if the count moved it leaves the job due again (at
//!   once, its ladder anew) instead of deleting it; a failure past the
//!   ladder does the same instead of parking the job. A decision that
//!   rolls back leaves the count as it was and is owed nothing. An
//!   enqueue never waits for a handler: it waits at most for a claim
//!   statement, a run's last statements and `COMMIT`, or another open
//!   enqueue of the same (kind, key).
//! * **Effect and completion commit together.** A [`Worker`] claims due jobs
//!   of the kinds it handles in one short statement (`FOR UPDATE SKIP
//!   LOCKED`, a lease, the run counted), then runs each handler under the
//!   retry loop ([`crate::retry`]): the attempt's first statement holds the
//!   job (`FOR KEY SHARE`, which no claim passes) and its last deletes it
//!   (or makes it due again), so the handler's writes and the job's end
//!   commit or roll back as one. Serialization failures and deadlocks are
//!   replayed. A handler may run once more than strictly needed (a
//!   decision that committed while it ran, which it may have seen, still
//!   gets a run of its own), so it should be idempotent.
//! * **The ladder.** A handler that fails (after the retry loop gave up)
//!   makes its job due again after the next step of the worker's
//!   [`Ladder`] (default 5 s, 30 s, 2 min, counted in database time);
//!   after the last step the next failure parks it as `dead` with its last
//!   error. [`requeue`] makes a dead job due again; [`dead`] lists them.
//! * **Crashes.** A worker killed mid-job leaves its transaction to the
//!   server, which rolls it back; the job stays `running` until its lease
//!   ends and is then claimed again, by any worker of any process. A run
//!   completes or fails only while it is still the job's newest (the claim
//!   count is its token, never reset), so a worker that outlived its lease
//!   cannot undo the next one's run.
//!
//! # The table
//!
//! `idem_jobs` (migrations 8 and 10, applied by [`crate::migrate()`]),
//! every column described with `COMMENT ON`:
//!
//! | column | meaning |
//! |---|---|
//! | `id` | the [`JobId`] |
//! | `kind`, `key` | [`Job::KIND`] and [`Job::key`]; unique among unfinished jobs |
//! | `payload` | the job as JSON |
//! | `state` | `due`, `running` (leased) or `dead` |
//! | `attempts` | runs started (claims); each run's token, never reset |
//! | `ladder_from` | `attempts` when the ladder last started afresh (requeue, or a run owed to a collapsed enqueue) |
//! | `collapsed` | enqueues collapsed into the job so far |
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

/// A typed compensation job that [`enqueue()`] writes and a [`Worker`] runs.
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
