//! One call of an idempotent function, in both modes, as steps of the retry
//! loop: [`Call::enter`] at the start of every attempt, [`Call::leave`] with
//! the body's result, [`Call::end`] with the loop's. Each returns a typed
//! [`Step`] or answer; nothing is signalled through fake errors.
//!
//! * local mode: the attempt's transaction queues on the advisory lock of
//!   (scope, key) and reads the record in the round trip of its `BEGIN`
//!   (pipelined); a new request runs the body and inserts its completed
//!   record, its one write, in the round trip of its `COMMIT`. A replay
//!   answers from the read and ends its transaction in the background. A
//!   final error rolls the attempt back and the next attempt stores it,
//!   without the body's writes.
//! * external mode: the first attempt commits the claim, with this call's
//!   owner token; the next ones run the body and record its outcome in the
//!   body's transaction. A claim whose commit went unanswered is found again
//!   by its token and resumed. After a failure the claim is released (nothing
//!   was sent) or kept as outcome unknown, by a bounded statement.
//!
//! Every step runs inside the retry loop, so checkout, claim, record and the
//! storing of a final error share the body's budget and classification.

use std::time::{Duration, Instant};

use diesel_async::{AsyncPgConnection, RunQueryDsl};
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::local::{Completing, LockAndRead};
use super::request::{Claimed, Found, Request};
use super::store::{self, Outcome, Record};
use super::{Idempotent, IdempotentError};
use crate::error::Error;
use crate::pool::Pool;
use crate::retry::{Attempt, Begin, RetryLoop, Step};
use crate::tx::{Closing, CommitFailure, EndWatch};

#[cfg(feature = "redis")]
mod cache;
mod hold;

/// How often a duplicate that may wait looks at the first request again.
const WAIT_POLL: Duration = Duration::from_millis(20);

/// One call of an idempotent function.
#[doc(hidden)]
pub struct Call<E> {
    request: Request,
    /// External mode: this call holds the committed claim.
    claimed: bool,
    /// External mode: this call claimed the key at some attempt (its claim
    /// may commit late, after `claimed` was reset by an unanswered COMMIT).
    ever_claimed: bool,
    /// The body ran at least once (external mode: something may have been sent).
    body_ran: bool,
    /// A final error of the body, to store (without the body's writes) in
    /// the next attempt, with its stored form.
    pending_final: Option<(E, serde_json::Value)>,
    /// Until when a duplicate waits for an in-progress first request.
    wait_until: Instant,
    /// Local mode: this attempt's read found an expired record of the key,
    /// which its record takes over.
    takeover: bool,
    /// The replay cache this call reads first and fills after.
    #[cfg(feature = "redis")]
    cache: Option<super::ReplayCache>,
    /// The completed record this attempt read or wrote, as stored, for the
    /// cache (kept only when there is one).
    completed: Option<Completed>,
    /// The pool, for a key held after the call was dropped (see `Drop`).
    pool: Pool,
    /// Local mode, until [`Call::end`]: whether this attempt's body
    /// committed by hand, with the attempt's commit timeout.
    watch: Option<(EndWatch, Duration)>,
    /// While [`Call::end`] holds the key: a drop then holds it again (see
    /// `Drop`). The attempt's watch, kept to see a hand-off.
    holding: Option<(Option<EndWatch>, Duration)>,
}

/// A completed record as the database stores it, to copy to the cache.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
struct Completed {
    error: bool,
    response: serde_json::Value,
    /// What is left of its retention.
    remaining: Duration,
}

/// What an attempt of an idempotent call answers, before it becomes the
/// caller's `Result<Idempotent<V>, E>` in [`Call::end`].
#[derive(Debug)]
#[doc(hidden)]
pub enum Reply<V, F> {
    /// The body ran and its response was recorded.
    Fresh(V),
    /// The stored outcome of an earlier request with the key.
    Replayed(Result<V, F>),
    /// The pending final error was stored.
    FinalStored,
}

type StepOf<V, E> = Step<Reply<V, <E as IdempotentError>::Final>>;

// The bounds sit on the methods, not on the impl: a missing
// `IdempotentError` is then one E0277 at the function, not one per method.
impl<E> Call<E> {
    /// A call of `request`.
    pub fn new(request: Request, pool: &Pool) -> Self
    where
        E: IdempotentError,
    {
        let wait_until = Instant::now() + request.config.wait;
        Call {
            request,
            claimed: false,
            ever_claimed: false,
            body_ran: false,
            pending_final: None,
            wait_until,
            takeover: false,
            #[cfg(feature = "redis")]
            cache: None,
            completed: None,
            pool: pool.clone(),
            watch: None,
            holding: None,
        }
    }

    /// Whether a cache will keep this call's completed record.
    fn caching(&self) -> bool {
        #[cfg(feature = "redis")]
        return self.cache.is_some();
        #[cfg(not(feature = "redis"))]
        return false;
    }

    /// The request.
    pub fn request(&self) -> &Request {
        &self.request
    }

    /// How the next attempt begins: an external call's body attempt holds
    /// no transaction (and no connection) until it needs one; a local one
    /// begins in [`Call::enter`], its first statements sent with its
    /// `BEGIN`; an external claim begins at once.
    pub fn begin(&self) -> Begin {
        if !self.request.external() || (self.claimed && self.pending_final.is_none()) {
            Begin::OnFirstUse
        } else {
            Begin::Now
        }
    }

    /// The first step of every attempt. `None`: run the body now.
    pub async fn enter<V: DeserializeOwned>(
        &mut self,
        attempt: &mut Attempt,
    ) -> Option<Result<StepOf<V, E>, E>>
    where
        E: IdempotentError,
    {
        // The outbox derives deterministic event ids from the call.
        crate::attempt::note_call(|| crate::attempt::CallId {
            scope: self.request.scope().to_owned(),
            key: self.request.key().to_owned(),
            token: *self.request.token(),
        });
        // What an earlier attempt wrote did not commit.
        self.completed = None;
        let external = self.request.external();
        if self.claimed && attempt.follows_unknown_commit() {
            // The claim's COMMIT went unanswered (and was cancelled): it may
            // not have committed. Claim again, which finds this call's own
            // claim by its token if it did.
            self.claimed = false;
        }
        if self.claimed && self.pending_final.is_none() {
            // External phase 2: the body runs with nothing open.
            self.body_ran = true;
            return None;
        }
        if !external {
            // Local: queue behind a duplicate in flight, then read, both sent
            // with the attempt's BEGIN.
            let stored = match attempt.open_with(&LockAndRead::new(&self.request)).await {
                Ok(Ok(stored)) => stored,
                // Prepared again by the next attempt.
                Ok(Err(_)) if attempt.statement_lost() => {
                    return Some(Ok(Step::Again(Duration::ZERO)))
                }
                Ok(Err(e)) => return Some(Err(db(e))),
                Err(e) => return Some(Err(E::from(e))),
            };
            self.watch = attempt.watch_end();
            if let Some((_, timeout)) = self.watch.as_ref() {
                let hold =
                    hold::after_body_commit(self.pool.clone(), *timeout, self.request.clone());
                attempt.after_body_commit(hold);
            }
            // An expired record is new to this request, and taken over.
            self.takeover = stored.is_some();
            match stored.map_or(Found::New, |s| self.request.judge(s)) {
                Found::New => {}
                found => return Some(self.replayable(attempt, found).await),
            }
            let synchronous = attempt.synchronous();
            return match &self.pending_final {
                // The final error, stored without the body's writes.
                Some((_, stored)) => {
                    let written = self.complete(attempt, Outcome::Error, stored).await;
                    Some(written.map(|(step, kept)| {
                        self.completed = kept;
                        match step {
                            // Nothing but the record was in the transaction,
                            // and the decline is the answer whether it was
                            // stored or not (a retry with the key then replays
                            // it, or runs again and declines again): a COMMIT
                            // that keeps going unanswered must not hold the
                            // answer past `commit_timeout`.
                            Step::Committed(Err(CommitFailure::Unknown)) if !synchronous => {
                                tracing::warn!(key = %self.request.key(), "storing a final error got no answer to COMMIT; answered, maybe unrecorded");
                                Step::Committed(Ok(Reply::FinalStored))
                            }
                            // With a synchronous standby, not: the decline
                            // would be reported before the standby holds it,
                            // and a failover would leave the key new. The
                            // caller gets CommitUnknown instead.
                            Step::Committed(Err(CommitFailure::Unknown)) => {
                                self.pending_final = None;
                                Step::Committed(Err(CommitFailure::Unknown))
                            }
                            step => answer(step, Reply::FinalStored),
                        }
                    }))
                }
                None => {
                    self.body_ran = true;
                    None
                }
            };
        }
        // Begun at once, unless this attempt was to run the body (above).
        let conn = match attempt.open().await {
            Ok(conn) => conn,
            Err(e) => return Some(Err(E::from(e))),
        };
        if let Some((_, stored)) = &self.pending_final {
            // External: the claim is this call's.
            let written = self.record(conn, Outcome::Error, stored).await;
            return Some(written.map(|kept| {
                self.completed = kept;
                Step::Commit(Reply::FinalStored)
            }));
        }
        match self.request.claim(conn).await {
            Ok(Claimed::Owned) => {
                (self.claimed, self.ever_claimed) = (true, true);
                Some(Ok(Step::CommitAndContinue))
            }
            // External: this call's own claim, whose commit went unanswered.
            // With a synchronous standby, resumed only once the standby holds
            // it: a claim made visible by a cancelled wait, and lost in a
            // failover, would let the outside call run twice.
            Ok(Claimed::Found(Found::Mine)) => {
                if attempt.synchronous() {
                    if let Err(e) = crate::standby::wait_held(attempt.conn()).await {
                        return Some(Err(db(e)));
                    }
                }
                (self.claimed, self.ever_claimed) = (true, true);
                Some(Ok(Step::Again(Duration::ZERO)))
            }
            Ok(Claimed::Found(found)) => Some(self.replayable(attempt, found).await),
            Err(e) => Some(Err(db(e))),
        }
    }

    /// [`Self::found`], once a stored outcome about to be replayed is known
    /// to be on the synchronous standby, when the pool says there is one
    /// (see `crate::standby`): a replay must not show what a failover could
    /// erase. The wait is bounded by the call's deadline.
    async fn replayable<V: DeserializeOwned>(
        &mut self,
        attempt: &mut Attempt,
        found: Found,
    ) -> Result<StepOf<V, E>, E>
    where
        E: IdempotentError,
    {
        if matches!(found, Found::Replay(..)) && attempt.synchronous() {
            crate::standby::wait_held(attempt.conn())
                .await
                .map_err(db::<E>)?;
        }
        self.found(found)
    }

    /// What a record found by the claim answers.
    fn found<V: DeserializeOwned>(&mut self, found: Found) -> Result<StepOf<V, E>, E>
    where
        E: IdempotentError,
    {
        match found {
            Found::Replay(outcome, response, remaining_ms) => {
                if self.caching() {
                    self.completed = Some(Completed {
                        error: outcome == Outcome::Error,
                        response: response.clone(),
                        remaining: Duration::from_millis(remaining_ms.max(0) as u64),
                    });
                }
                replay::<V, E>(outcome, response).map(|r| Step::Answer(Reply::Replayed(r)))
            }
            Found::Refused(Error::InProgress) if Instant::now() < self.wait_until => {
                Ok(Step::Again(WAIT_POLL.min(self.wait_until - Instant::now())))
            }
            Found::Refused(err) => Err(E::from(err)),
            // The record the claim met is gone (expired and purged) or was
            // this call's own: claim again in a fresh attempt.
            Found::New | Found::Mine => Ok(Step::Again(Duration::ZERO)),
        }
    }

    /// The step after the body: record a success with the attempt's writes,
    /// set a final error aside to store in the next attempt, hand any other
    /// error to the loop.
    pub async fn leave<V: Serialize>(
        &mut self,
        attempt: &mut Attempt,
        outcome: Result<V, E>,
    ) -> Result<StepOf<V, E>, E>
    where
        E: IdempotentError,
    {
        match outcome {
            Ok(value) => {
                let response = self.request.response(&value).map_err(E::from)?;
                if self.request.external() {
                    // External phase 3: the outcome's transaction, begun now
                    // if the body wrote nothing of its own.
                    attempt.open().await.map_err(E::from)?;
                    // The record must not go to a connection the body
                    // swapped in, where it might commit on its own: the
                    // outside call may have run, and the key stays held.
                    if !attempt.holds_its_session() {
                        return Err(E::from(Error::ConnectionReplaced));
                    }
                    // Nor behind an end of the transaction the body sent
                    // (a `COMMIT` still running, which it would wait for
                    // unbounded): not recorded, the key stays held, and the
                    // commit refuses what the body ended.
                    if attempt.ended_by_body_settled().await.is_some() {
                        return Ok(Step::Commit(Reply::Fresh(value)));
                    }
                    self.completed = self.record(attempt.conn(), Outcome::Ok, &response).await?;
                    return Ok(Step::Commit(Reply::Fresh(value)));
                }
                let (step, kept) = self.complete(attempt, Outcome::Ok, &response).await?;
                self.completed = kept;
                Ok(answer(step, Reply::Fresh(value)))
            }
            // A decline is stored as the key's outcome only when nothing
            // the body wrote can have committed: not after it ended the
            // transaction itself, nor swapped its connection (the loop
            // answers those; in external mode the key stays held).
            Err(err) if !attempt.holds_its_session() => Err(err),
            Err(err) if attempt.ended_by_body_settled().await.is_some() => Err(err),
            Err(err) => match err.to_final() {
                Some(stored) => match self.request.response(&stored) {
                    Ok(stored) => {
                        self.pending_final = Some((err, stored));
                        Ok(Step::Again(Duration::ZERO))
                    }
                    // The decline is still the answer; only its replay is
                    // lost. Refusing it (as a response is refused) would turn
                    // a legitimate 4xx into an error of idem's.
                    Err(why) => {
                        tracing::warn!(key = %self.request.key(), error = %why, "a final error cannot be stored under its key: returned unrecorded, and the key stays free");
                        Err(err)
                    }
                },
                None => Err(err),
            },
        }
    }

    /// Local mode: the one write of a new request, sent with the attempt's
    /// `COMMIT`. A record that appeared meanwhile (an external claim of the
    /// same key, or, under a snapshot isolation, a duplicate's) makes it fail
    /// and the transaction roll back; the attempt goes round again to read it.
    async fn complete(
        &self,
        attempt: &mut Attempt,
        outcome: Outcome,
        response: &serde_json::Value,
    ) -> Result<(Step<()>, Option<Completed>), E>
    where
        E: IdempotentError,
    {
        let last = Completing::new(
            &self.request,
            outcome,
            response,
            self.takeover,
            self.caching(),
        );
        match attempt.commit_with(&last).await {
            Ok(stored) => Ok((Step::Committed(Ok(())), self.kept(outcome, stored))),
            Err(Closing::Failed(e)) if store::record_taken(&e) => {
                Ok((Step::Again(Duration::ZERO), None))
            }
            // Prepared again by the next attempt.
            Err(Closing::Failed(_)) if attempt.statement_lost() => {
                Ok((Step::Again(Duration::ZERO), None))
            }
            Err(Closing::Failed(e)) => Err(db(e)),
            Err(Closing::Commit(failure)) => Ok((Step::Committed(Err(failure)), None)),
            Err(Closing::Unwritten) => Err(E::from(Error::RecordNotWritten)),
        }
    }

    /// The response a write returned as stored, for the cache, with the
    /// whole retention ahead of it.
    fn kept(&self, outcome: Outcome, stored: Option<serde_json::Value>) -> Option<Completed> {
        stored.map(|response| Completed {
            error: outcome == Outcome::Error,
            response,
            remaining: self.request.config.ttl,
        })
    }

    /// Complete this call's claim with `response`, bound as a parameter.
    async fn record(
        &self,
        conn: &mut AsyncPgConnection,
        outcome: Outcome,
        response: &serde_json::Value,
    ) -> Result<Option<Completed>, E>
    where
        E: IdempotentError,
    {
        let statement = Record {
            scope: self.request.scope(),
            key: self.request.key(),
            outcome,
            response,
            owner: self.request.owner(),
            returning: self.caching(),
        };
        let (written, kept) = if statement.returning {
            let mut stored: Vec<serde_json::Value> =
                statement.get_results(conn).await.map_err(db::<E>)?;
            (stored.len(), self.kept(outcome, stored.pop()))
        } else {
            (statement.execute(conn).await.map_err(db::<E>)?, None)
        };
        match written {
            1 => Ok(kept),
            // The claim was settled by hand, or its lease ran out and another
            // request took the key: an effect whose record cannot be kept
            // must not commit.
            _ => Err(E::from(Error::ClaimLost)),
        }
    }

    /// The caller's answer from the loop's, and, in external mode after a
    /// failure, the claim released or kept as outcome unknown. `timeout`
    /// bounds that last statement, row-lock waits included.
    pub async fn end<V>(
        #[cfg_attr(not(feature = "redis"), allow(unused_mut))] mut self,
        pool: &Pool,
        retry_loop: &mut RetryLoop<'_>,
        outcome: Result<Reply<V, E::Final>, E>,
    ) -> Result<Idempotent<V>, E>
    where
        E: IdempotentError,
    {
        // Whatever happens from here is this call's own answer (see `Drop`).
        let watch = self.watch.take().map(|(w, _)| w);
        let timeout = retry_loop.policy().commit_timeout;
        #[cfg(feature = "redis")]
        if outcome.is_ok() {
            self.fill_cache(pool).await;
        }
        let err = match outcome {
            Ok(Reply::Fresh(value)) => {
                return Ok(Idempotent {
                    value,
                    replayed: false,
                })
            }
            Ok(Reply::Replayed(Ok(value))) => {
                return Ok(Idempotent {
                    value,
                    replayed: true,
                })
            }
            Ok(Reply::Replayed(Err(stored))) => return Err(E::from_final(stored)),
            Ok(Reply::FinalStored) => match self.pending_final.take() {
                Some((err, _)) => return Err(err),
                None => unreachable!("FinalStored only follows a pending final error"),
            },
            Err(err) => err,
        };
        let request = &self.request;
        // A final error whose storing failed still is the answer: the body's
        // writes were rolled back, and the next request runs again. Unless
        // the body had ended the transaction itself (a `COMMIT` or
        // `ROLLBACK` it queued, written before idem's `ROLLBACK`): then the
        // loop's answer stands, and, what it wrote committed, whatever the
        // error says, the key stays held.
        let committed = retry_loop.body_committed();
        let (err, nothing_happened) = match self.pending_final.take() {
            Some((final_err, _)) if retry_loop.body_ended().is_none() => (final_err, true),
            _ => {
                let nothing = !committed && (!self.body_ran || err.nothing_sent());
                (err, nothing)
            }
        };
        if self.ever_claimed {
            let within = timeout.max(hold::SETTLE_AT_LEAST);
            let settled = match (self.body_ran, nothing_happened) {
                // The claim's own COMMIT may have gone unanswered, and may
                // still commit: released once it has ended.
                (false, _) => hold::release_claim(pool, within, request).await,
                (true, true) => hold::settle(pool, within, request, store::RELEASE).await,
                (true, false) => hold::settle(pool, within, request, store::MARK_UNKNOWN).await,
            };
            if let Err(e) = settled {
                hold::unsettled(pool, within, request, self.body_ran, e);
            }
            self.ever_claimed = false;
        } else if !request.external() && retry_loop.body_committed() {
            // Dropped before the hold is known written (its checkout or its
            // statement cancelled with the call), the call holds the key
            // again from a task of its own; a second hold finds the first by
            // its owner (this call's token) and writes it again.
            self.holding = Some((watch, timeout));
            let ended = retry_loop.take_ended().and_then(Attempt::into_tx);
            hold::hold_unknown(pool, timeout, &self.request, ended).await;
            self.holding = None;
        }
        Err(err)
    }
}

impl<E> Drop for Call<E> {
    /// A local call dropped (its caller gave up, or its body panicked)
    /// after its body committed by hand, before [`Call::end`] held its key:
    /// held now, in a task of its own.
    fn drop(&mut self) {
        // External: dropped after its claim, before its body ran (a caller's
        // timeout, during the claim's `COMMIT` say): released all the same.
        if self.ever_claimed && !self.body_ran {
            let (pool, request) = (self.pool.clone(), self.request.clone());
            return hold::release_in_background(pool, hold::SETTLE_AT_LEAST, request);
        }
        let (watch, timeout) = match (&self.holding, &self.watch) {
            (Some((watch, timeout)), _) => (watch.as_ref(), *timeout),
            (None, Some((watch, timeout))) if watch.committed() => (Some(watch), *timeout),
            _ => return,
        };
        // Not when its transaction was handed on with its connection, to
        // hold the key there (see `hold::after_body_commit`).
        if !watch.is_some_and(EndWatch::handed_off) {
            hold::hold_in_background(self.pool.clone(), timeout, self.request.clone());
        }
    }
}

/// `step`, answering `value` where it answers at all.
fn answer<V>(step: Step<()>, value: V) -> Step<V> {
    match step {
        Step::Commit(()) => Step::Commit(value),
        Step::Answer(()) => Step::Answer(value),
        Step::Committed(committed) => Step::Committed(committed.map(|()| value)),
        Step::CommitAndContinue => Step::CommitAndContinue,
        Step::Again(delay) => Step::Again(delay),
    }
}

fn db<E: IdempotentError>(e: diesel::result::Error) -> E {
    E::from(Error::Database(e))
}

fn replay<V: DeserializeOwned, E: IdempotentError>(
    outcome: Outcome,
    response: serde_json::Value,
) -> Result<Result<V, E::Final>, E> {
    let read = match outcome {
        Outcome::Error => serde_json::from_value::<E::Final>(response).map(Err),
        Outcome::Ok => serde_json::from_value::<V>(response).map(Ok),
    };
    read.map_err(|e| E::from(Error::UnreadableResponse(e)))
}
