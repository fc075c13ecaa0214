//! Writing a job, in the caller's transaction.

use std::time::Duration;

use diesel_async::AsyncPgConnection;

use super::{store, Job, JobId};
use crate::error::Unstorable;
use crate::retry::{RetryCause, Transient};

/// What [`enqueue`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Enqueued {
    /// A new job was written.
    New(JobId),
    /// An unfinished job of the same kind and key exists (due, or running):
    /// no job was written; the enqueue is counted on that job, which keeps
    /// its own payload, and a run of it that starts after this enqueue's
    /// transaction committed follows (see the [module documentation](super)).
    Collapsed(JobId),
}

impl Enqueued {
    /// The job's id, new or existing.
    pub fn id(&self) -> JobId {
        match *self {
            Enqueued::New(id) | Enqueued::Collapsed(id) => id,
        }
    }

    /// Whether a new job was written.
    pub fn is_new(&self) -> bool {
        matches!(self, Enqueued::New(_))
    }
}

/// Why a job's kind or key was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid job {what} {value:?}: {reason}")]
pub struct InvalidJob {
    /// `"kind"` or `"key"`.
    pub what: &'static str,
    /// The value as given.
    pub value: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

/// Why [`enqueue`] wrote nothing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EnqueueError {
    /// Called outside an attempt of a `#[retryable]` or `#[idempotent]`
    /// function (or [`retry`](crate::retry::retry), or a job's handler):
    /// there is no transaction for the job to commit with.
    #[error("jobs::enqueue called outside an attempt of a retry loop: a job is written only in the transaction that decides it")]
    OutsideAttempt,
    /// Called inside an attempt, but with a connection in no transaction:
    /// not the one the attempt lent the body (a connection the body opened
    /// itself, say). The job would commit at once, whatever became of the
    /// decision. Enqueue on the attempt's connection.
    #[error("jobs::enqueue was given a connection in no transaction, not the attempt's: the job would commit on its own, whatever became of the decision; enqueue on the connection the attempt lent")]
    NoTransaction,
    /// The job's kind or key breaks the rules of [`Job`].
    #[error(transparent)]
    Invalid(#[from] InvalidJob),
    /// The job did not serialize to JSON.
    #[error("job {kind} did not serialize to JSON: {source}")]
    Serialize {
        /// [`Job::KIND`].
        kind: &'static str,
        /// What serde said.
        #[source]
        source: serde_json::Error,
    },
    /// The job's JSON could not be stored and read back by the worker: a
    /// string or key with U+0000 (`jsonb` refuses it), or arrays and objects
    /// nested deeper than [`MAX_STORED_DEPTH`](crate::idempotency::MAX_STORED_DEPTH).
    #[error("job {kind} cannot be stored: {source}")]
    Unstorable {
        /// [`Job::KIND`].
        kind: &'static str,
        /// What is wrong with its JSON.
        #[source]
        source: Unstorable,
    },
    /// Jobs of this kind and key kept finishing between the insert that met
    /// them and the update that should have collapsed into them. Reported
    /// to the retry loop as a lost race, so the attempt is replayed.
    #[error("jobs of this kind and key kept finishing while the enqueue looked for them")]
    Raced,
    /// A statement failed. A serialization failure or a deadlock here is
    /// replayed by the retry loop like any other statement of the attempt.
    #[error("writing the job failed: {0}")]
    Database(#[from] diesel::result::Error),
}

impl Transient for EnqueueError {
    fn transient(&self) -> Option<RetryCause> {
        match self {
            EnqueueError::Database(e) => e.transient(),
            _ => None,
        }
    }
}

/// Write `job` in the transaction of the current attempt, due at once, or
/// collapse it into the unfinished job of the same kind and key.
///
/// Refused with [`EnqueueError::OutsideAttempt`], writing nothing, when the
/// calling task does not run an attempt of a retry loop: a run-time check,
/// since `conn` is a plain connection; and with
/// [`EnqueueError::NoTransaction`] when `conn` is in no transaction (a
/// connection the body opened itself). If the attempt rolls back, the job
/// goes with it.
///
/// ```no_run
/// use diesel_async::AsyncPgConnection;
/// use idem_runtime::jobs::{enqueue, EnqueueError, Job};
///
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct MarkPaid { order: i64 }
/// impl Job for MarkPaid {
///     const KIND: &'static str = "order.mark_paid";
///     fn key(&self) -> String { format!("order-{}", self.order) }
/// }
///
/// // Called from the body of a #[retryable] or #[idempotent] function that
/// // lost a version race and compensates later instead of failing.
/// async fn compensate(conn: &mut AsyncPgConnection, order: i64) -> Result<bool, EnqueueError> {
///     let enqueued = enqueue(conn, &MarkPaid { order }).await?;
///     Ok(enqueued.is_new())
/// }
/// ```
///
/// # Errors
///
/// [`EnqueueError`]; a database error aborts the attempt's transaction, as
/// any failed statement does. Under repeatable read or serializable,
/// collapsing into a job that changed since the attempt's snapshot (a
/// worker claimed it) is a serialization failure, which the loop replays.
pub async fn enqueue<J: Job>(
    conn: &mut AsyncPgConnection,
    job: &J,
) -> Result<Enqueued, EnqueueError> {
    enqueue_after(conn, job, Duration::ZERO).await
}

/// [`enqueue`], due `delay` after now (database time): the first run of a
/// compensation usually waits for the race it lost to settle. A collapsed
/// enqueue leaves the existing job's due time as it was; when it collapsed
/// into a running job, the run it is owed is due at once, `delay` is not
/// kept. A delay past a thousand years counts as a thousand.
///
/// ```no_run
/// # use idem_runtime::jobs::{enqueue_after, EnqueueError, Job};
/// # #[derive(serde::Serialize, serde::Deserialize)]
/// # struct MarkPaid { order: i64 }
/// # impl Job for MarkPaid {
/// #     const KIND: &'static str = "order.mark_paid";
/// #     fn key(&self) -> String { format!("order-{}", self.order) }
/// # }
/// # async fn f(conn: &mut diesel_async::AsyncPgConnection) -> Result<(), EnqueueError> {
/// use std::time::Duration;
/// enqueue_after(conn, &MarkPaid { order: 7 }, Duration::from_secs(5)).await?;
/// # Ok(()) }
/// ```
///
/// # Errors
///
/// As [`enqueue`].
pub async fn enqueue_after<J: Job>(
    conn: &mut AsyncPgConnection,
    job: &J,
    delay: Duration,
) -> Result<Enqueued, EnqueueError> {
    if !crate::attempt::inside_attempt() {
        return Err(EnqueueError::OutsideAttempt);
    }
    if !crate::attempt::in_transaction(conn) {
        return Err(EnqueueError::NoTransaction);
    }
    validate("kind", J::KIND)?;
    let key = job.key();
    validate("key", &key)?;
    let payload = serde_json::to_value(job).map_err(|source| EnqueueError::Serialize {
        kind: J::KIND,
        source,
    })?;
    crate::idempotency::storable_tree(&payload).map_err(|source| EnqueueError::Unstorable {
        kind: J::KIND,
        source,
    })?;
    // The unfinished job the insert met may finish (its run commits) before
    // the collapse: then a new one can be written, so go round again. Each
    // round needs a job to finish between two statements; a few suffice.
    for _ in 0..4 {
        if let Some(id) = store::insert(conn, J::KIND, &key, &payload, delay).await? {
            tracing::debug!(job_id = id, kind = J::KIND, key = %key, "job enqueued");
            return Ok(Enqueued::New(JobId(id)));
        }
        if let Some(id) = store::collapse(conn, J::KIND, &key).await? {
            tracing::debug!(job_id = id, kind = J::KIND, key = %key, "job collapsed into an unfinished one");
            return Ok(Enqueued::Collapsed(JobId(id)));
        }
    }
    // Runs of this key keep committing under us; a replayed attempt will
    // most likely find one way or the other at once.
    crate::attempt::lost_race();
    Err(EnqueueError::Raced)
}

/// Check a kind or key: the rules of an outbox event's key.
pub(crate) fn validate(what: &'static str, value: &str) -> Result<(), InvalidJob> {
    match crate::outbox::event::key_problem(value) {
        None => Ok(()),
        Some(reason) => Err(InvalidJob {
            what,
            value: value.to_owned(),
            reason,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_and_keys_are_checked() {
        assert!(validate("key", "order-1").is_ok());
        assert!(validate("key", "").is_err());
        assert!(validate("key", &"k".repeat(256)).is_err());
        assert!(validate("kind", "a\nb").is_err());
    }
}
