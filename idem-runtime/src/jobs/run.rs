//! One run of one claimed job: its handler under the retry loop, between
//! the job's hold (the attempt's first statement) and its end (the last:
//! deleted, or due again when an enqueue collapsed into it meanwhile), then
//! the failure (if any) recorded against the ladder.

use std::any::Any;
use std::fmt::Display;
use std::future::Future;
use std::ops::ControlFlow;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use diesel_async::AsyncPgConnection;
use futures_util::FutureExt as _;
use scoped_futures::ScopedBoxFuture;

use super::store::{self, Claimed, Completed, Failed};
use super::{Job, Ladder};
use crate::error::Error;
use crate::pool::{self, Pool};
use crate::retry::{RetryLoop, RetryPolicy, Step};

type BoxFuture<'c, T> = Pin<Box<dyn Future<Output = T> + Send + 'c>>;

/// A handler with its job type erased: it decodes the payload itself, so a
/// worker holds the handlers of many kinds in one map.
pub(crate) type Handler = Arc<
    dyn for<'c> Fn(
            &'c mut AsyncPgConnection,
            &'c serde_json::Value,
        ) -> BoxFuture<'c, Result<(), Failure>>
        + Send
        + Sync,
>;

/// Why a run did not complete.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The retry loop's own failure (budget spent, no connection, ..).
    Idem(Error),
    /// The handler's error, as its `Display` wrote it.
    Handler(String),
    /// The payload does not decode as the kind's job type: no later run
    /// can do better, so the job dies at once.
    Payload(serde_json::Error),
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure::Idem(e)
    }
}

impl Failure {
    fn text(&self) -> String {
        match self {
            Failure::Idem(e) => e.to_string(),
            Failure::Handler(e) => e.clone(),
            Failure::Payload(e) => format!("the payload does not decode: {e}"),
        }
    }
}

/// Erase a typed handler.
pub(crate) fn erase<J, E, F>(handler: F) -> Handler
where
    J: Job,
    E: Display + Send + 'static,
    F: for<'c> Fn(&'c mut AsyncPgConnection, &'c J) -> ScopedBoxFuture<'static, 'c, Result<(), E>>
        + Send
        + Sync
        + 'static,
{
    let handler = Arc::new(handler);
    Arc::new(move |conn, payload| {
        let handler = Arc::clone(&handler);
        // Decoded on every attempt: a replayed attempt starts from the
        // stored payload, like any replayed body from its arguments.
        let job = J::deserialize(payload);
        Box::pin(async move {
            let job = job.map_err(Failure::Payload)?;
            // A panic is the handler's failure like an error: it would
            // otherwise leave the job running until its lease ran out, run
            // it past the ladder, and take the other runs of the worker's
            // round down with it. What the handler left on the connection
            // is the retry loop's to clean up, as for any body that
            // returned early.
            match AssertUnwindSafe(handler(conn, &job)).catch_unwind().await {
                Ok(done) => done.map_err(|e| Failure::Handler(e.to_string())),
                Err(panic) => Err(Failure::Handler(format!(
                    "the handler panicked: {}",
                    panic_text(panic.as_ref())
                ))),
            }
        })
    })
}

/// A panic's message, when it is text.
fn panic_text(panic: &(dyn Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(a value that is not text)")
}

/// How one run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ended {
    /// The handler's effect and the job's end committed: deleted, or due
    /// again when an enqueue collapsed into it during the run.
    Done,
    /// Failed; due again after the ladder's next step.
    Retry,
    /// Failed past the ladder, undecodable, committed part of its writes
    /// by hand, or swapped its connection: parked as dead.
    Dead,
    /// A newer run of the job took over (this one outlived its lease), or
    /// the failure could not be recorded: the lease decides what is next.
    Lost,
}

/// Run `job` with `handler` under `policy`.
pub(crate) async fn run(
    pool: &Pool,
    policy: RetryPolicy,
    ladder: &Ladder,
    handler: &Handler,
    job: &Claimed,
) -> Ended {
    // The collapsed enqueues the last attempt started having seen; a
    // failure recorded against a higher count owes the job another run.
    let seen = AtomicI64::new(job.collapsed);
    let mut retry_loop = RetryLoop::new(pool, policy, "idem.jobs");
    // Read back apart from the claim (see `Claimed::payload`): one that
    // cannot be is dead at once, as one that does not decode.
    let result = match job.payload() {
        Ok(payload) => attempts(&mut retry_loop, handler, job, &payload, &seen).await,
        Err(e) => Err(Failure::Payload(e)),
    };
    let failure = match result {
        Ok(Some(Completed::Rearmed)) => {
            tracing::debug!(job_id = job.id, kind = %job.kind, key = %job.key, run = job.attempts, "job done; an enqueue collapsed into it during the run, so it is due again");
            return Ended::Done;
        }
        Ok(Some(_)) => {
            tracing::debug!(job_id = job.id, kind = %job.kind, key = %job.key, run = job.attempts, "job done");
            return Ended::Done;
        }
        Ok(None) => {
            tracing::info!(job_id = job.id, kind = %job.kind, key = %job.key, run = job.attempts, "job taken over by a newer run; this run did nothing");
            return Ended::Lost;
        }
        Err(failure) => failure,
    };
    // The handler ended the transaction itself and some of its writes
    // committed without the job's end (`TransactionEnded { committed:
    // true }`): another run would write them again, as a replay would, so
    // the job is dead at once, for an operator to look at.
    let committed_by_hand = retry_loop.body_committed();
    if committed_by_hand {
        // Its attempt, kept for a write that must come first, holds a
        // connection the failure's record may need (a pool of one).
        drop(retry_loop.take_ended());
    }
    // So does a handler that swapped its connection: what it wrote outside
    // the job's transaction may have committed.
    let retry_after = match failure {
        Failure::Payload(_) => None,
        _ if committed_by_hand || retry_loop.connection_replaced() => None,
        _ => ladder.after_failure(job.failures()),
    };
    let error = failure.text();
    let seen = seen.load(Ordering::SeqCst);
    let recorded = match pool.get().await {
        Ok(mut conn) => {
            store::fail(&mut conn, job.id, job.attempts, seen, &error, retry_after).await
        }
        Err(e) => {
            tracing::warn!(job_id = job.id, error = %e, "could not record a failed job run; its lease will bring it back");
            return Ended::Lost;
        }
    };
    match recorded {
        Ok(Some(Failed::Retry)) => {
            tracing::warn!(job_id = job.id, kind = %job.kind, key = %job.key, run = job.attempts, after = ?retry_after, error, "job failed; due again after the ladder's next step");
            Ended::Retry
        }
        Ok(Some(Failed::Revived)) => {
            tracing::warn!(job_id = job.id, kind = %job.kind, key = %job.key, run = job.attempts, error, "job failed past the ladder, but an enqueue collapsed into it during the run: due again with a fresh ladder");
            Ended::Retry
        }
        Ok(Some(Failed::Dead)) => {
            tracing::error!(job_id = job.id, kind = %job.kind, key = %job.key, run = job.attempts, error, "job parked as dead; requeue it once fixed");
            Ended::Dead
        }
        Ok(None) => Ended::Lost,
        Err(e) => {
            tracing::warn!(job_id = job.id, error = %e, "could not record a failed job run; its lease will bring it back");
            Ended::Lost
        }
    }
}

/// The attempts of one run: the handler's effect and the job's end, under
/// the retry loop.
async fn attempts(
    retry_loop: &mut RetryLoop<'_>,
    handler: &Handler,
    job: &Claimed,
    payload: &serde_json::Value,
    seen: &AtomicI64,
) -> Result<Option<Completed>, Failure> {
    loop {
        let mut attempt = match retry_loop.begin().await {
            Ok(attempt) => attempt,
            Err(err) => return Err(Failure::Idem(err)),
        };
        let conn = attempt.conn();
        let step = retry_loop
            .scope(async move {
                let db = |e| Failure::Idem(Error::Database(e));
                // First, so that no claim takes the job while the handler's
                // transaction is open.
                let Some(collapsed) = store::hold(conn, job.id, job.attempts).await.map_err(db)?
                else {
                    return Ok(Step::Answer(None));
                };
                seen.store(collapsed, Ordering::SeqCst);
                let session = pool::session_of(conn);
                handler(conn, payload).await?;
                // A handler that swapped its connection and returned `Ok`:
                // the job's end must not go through the one it swapped in,
                // outside the job's transaction (deleted for good while the
                // run reads as lost). Answered as when it fails: dead.
                if pool::session_of(conn) != session {
                    return Err(Failure::Idem(Error::ConnectionReplaced));
                }
                // Last, so that an enqueue still open on the job is waited
                // for, and one that comes later waits for this commit.
                match store::complete(conn, job.id, job.attempts, collapsed)
                    .await
                    .map_err(db)?
                {
                    // The handler's effect goes with the run it belongs to.
                    Completed::Gone => Ok(Step::Answer(None)),
                    ended => Ok(Step::Commit(Some(ended))),
                }
            })
            .await;
        if let ControlFlow::Break(result) = retry_loop.finish(attempt, step).await {
            return result;
        }
    }
}
