//! One delivery, from the broker's point of view: run the effect and record
//! the message in one transaction, or skip it, or say when to try again, or
//! park it. Also the operator's side of the records: dead letters, requeue,
//! purge. Nothing here knows a broker; `Inbox::run` does (with the `nats` feature).

use std::fmt::Display;
use std::ops::ControlFlow;
use std::time::Duration;

use diesel_async::AsyncPgConnection;
use scoped_futures::ScopedBoxFuture;

use super::store::{self, DeadLetter, Recorded};
use super::{check_id, Inbox, InboxError, Outcome};
use crate::error::{Error, FromIdemError};
use crate::retry::{RetryLoop, Step};

/// What an attempt found, before the outcome is decided.
enum Handled<T> {
    Ran(T),
    Duplicate,
    Dead,
}

impl Inbox {
    /// Handle one delivery of the message `msg_id` with body `payload`, the
    /// `delivered`-th delivery of it (the broker's count, from 1).
    ///
    /// The effect is called once per attempt of the retry loop, with the
    /// attempt's connection inside an open transaction and the payload; it
    /// returns a boxed future (`scope_boxed()`), as with
    /// [`retry`](crate::retry::retry). Its writes commit together with the
    /// message's record, or not at all. The [`Outcome`] says what to tell
    /// the broker; an [`InboxError`] means nothing was recorded (nak it).
    ///
    /// ```no_run
    /// use diesel_async::RunQueryDsl;
    /// use idem_runtime::inbox::{Inbox, InboxConfig, Outcome};
    /// use scoped_futures::ScopedFutureExt;
    ///
    /// #[derive(Debug, thiserror::Error)]
    /// enum AppError {
    ///     #[error(transparent)] Idem(#[from] idem_runtime::Error),
    ///     #[error(transparent)] Db(#[from] diesel::result::Error),
    /// }
    ///
    /// # async fn demo(inbox: &Inbox) -> Result<(), idem_runtime::inbox::InboxError> {
    /// let outcome = inbox
    ///     .handle("order-17", b"{\"qty\":2}", 1, |conn, payload| {
    ///         async move {
    ///             diesel::sql_query("INSERT INTO shipments (body) VALUES ($1)")
    ///                 .bind::<diesel::sql_types::Binary, _>(payload)
    ///                 .execute(conn)
    ///                 .await
    ///                 .map_err(AppError::Db)
    ///         }
    ///         .scope_boxed()
    ///     })
    ///     .await?;
    /// assert!(outcome.is_settled());
    /// # Ok(()) }
    /// ```
    pub async fn handle<'a, T, E, F>(
        &self,
        msg_id: &str,
        payload: &[u8],
        delivered: u64,
        mut effect: F,
    ) -> Result<Outcome<T, E>, InboxError>
    where
        F: for<'c> FnMut(
                &'c mut AsyncPgConnection,
                &'c [u8],
            ) -> ScopedBoxFuture<'a, 'c, Result<T, E>>
            + Send,
        E: FromIdemError + Display,
    {
        check_id("message id", msg_id)?;
        let consumer = self.consumer.as_str();
        let mut retry_loop = RetryLoop::new(&self.pool, self.config.policy, "idem.inbox");
        let result: Result<Handled<T>, E> = loop {
            let mut attempt = match retry_loop.begin().await {
                Ok(attempt) => attempt,
                Err(err) => break Err(E::from(err)),
            };
            let conn = attempt.conn();
            let effect = &mut effect;
            let step = retry_loop
                .scope(async move {
                    let recorded = store::claim(conn, consumer, msg_id, delivered)
                        .await
                        .map_err(|e| E::from(Error::Database(e)))?;
                    match recorded {
                        Recorded::Claimed => {}
                        // Nothing written: the transaction ends unseen.
                        Recorded::Done => return Ok(Step::Answer(Handled::Duplicate)),
                        Recorded::Dead => return Ok(Step::Answer(Handled::Dead)),
                    }
                    let value = effect(conn, payload).await?;
                    Ok(Step::Commit(Handled::Ran(value)))
                })
                .await;
            if let ControlFlow::Break(result) = retry_loop.finish(attempt, step).await {
                break result;
            }
        };
        match result {
            Ok(Handled::Ran(value)) => Ok(Outcome::Done(value)),
            Ok(Handled::Duplicate) => Ok(Outcome::Duplicate),
            Ok(Handled::Dead) => Ok(Outcome::Dead),
            // The effect ended the transaction itself and some of its
            // writes committed without the record (a `ROLLBACK` then a
            // write, say): a redelivery would apply them again, as a replay
            // would (`TransactionEnded { committed: true }` is never
            // replayed). Parked at once, for an operator to look at.
            // So is an effect that swapped its connection: what it wrote
            // outside the record's transaction may have committed.
            Err(error) if retry_loop.body_committed() || retry_loop.connection_replaced() => {
                // An attempt whose body committed by hand, kept for a write
                // that must come first, holds a connection the park may
                // need (a pool of one).
                drop(retry_loop.take_ended());
                self.park(msg_id, payload, delivered, error).await
            }
            Err(error) if delivered >= self.config.max_deliveries => {
                self.park(msg_id, payload, delivered, error).await
            }
            Err(error) => {
                let after = self.config.backoff_after(delivered);
                tracing::debug!(consumer, msg_id, delivered, ?after, %error, "idem.inbox: effect failed; the message will be redelivered");
                Ok(Outcome::Retry { error, after })
            }
        }
    }

    /// Record a message as dead, in a transaction of its own (the effect's
    /// was rolled back): its last allowed delivery failed, or its effect
    /// committed part of its writes by hand, without the record.
    async fn park<T, E: Display>(
        &self,
        msg_id: &str,
        payload: &[u8],
        delivered: u64,
        error: E,
    ) -> Result<Outcome<T, E>, InboxError> {
        let mut conn = self.pool.get().await.map_err(Error::from)?;
        let text = error.to_string();
        let recorded =
            store::park(&mut conn, &self.consumer, msg_id, delivered, &text, payload).await?;
        Ok(match recorded {
            Recorded::Claimed => {
                tracing::warn!(consumer = %self.consumer, msg_id, delivered, error = %text, "idem.inbox: message parked as dead");
                Outcome::Parked { error }
            }
            // A commit whose answer was lost had recorded it after all, or
            // the effect's own `COMMIT` did.
            Recorded::Done => Outcome::Duplicate,
            Recorded::Dead => Outcome::Dead,
        })
    }

    /// Run a dead letter's effect again, on its stored body. In one
    /// transaction the letter becomes a `done` record and the effect's
    /// writes commit, or neither (a failure leaves it dead and returns the
    /// error). `Ok(None)` when no dead letter has this id (never parked, or
    /// already requeued).
    ///
    /// ```no_run
    /// # use idem_runtime::inbox::Inbox;
    /// # use scoped_futures::ScopedFutureExt;
    /// # async fn demo(inbox: &Inbox) -> Result<(), idem_runtime::Error> {
    /// for letter in inbox.dead_letters(100).await.expect("listed") {
    ///     let _ran: Option<usize> = inbox
    ///         .requeue(&letter.msg_id, |_conn, payload| {
    ///             async move { Ok::<_, idem_runtime::Error>(payload.len()) }.scope_boxed()
    ///         })
    ///         .await?;
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn requeue<'a, T, E, F>(&self, msg_id: &str, mut effect: F) -> Result<Option<T>, E>
    where
        F: for<'c> FnMut(
                &'c mut AsyncPgConnection,
                &'c [u8],
            ) -> ScopedBoxFuture<'a, 'c, Result<T, E>>
            + Send,
        E: FromIdemError,
    {
        let consumer = self.consumer.as_str();
        let mut retry_loop = RetryLoop::new(&self.pool, self.config.policy, "idem.inbox.requeue");
        loop {
            let mut attempt = retry_loop.begin().await.map_err(E::from)?;
            let conn = attempt.conn();
            let effect = &mut effect;
            let step = retry_loop
                .scope(async move {
                    let revived = store::revive(conn, consumer, msg_id)
                        .await
                        .map_err(|e| E::from(Error::Database(e)))?;
                    let Some(payload) = revived else {
                        return Ok(Step::Answer(None));
                    };
                    let value = effect(conn, &payload).await?;
                    Ok(Step::Commit(Some(value)))
                })
                .await;
            if let ControlFlow::Break(result) = retry_loop.finish(attempt, step).await {
                return result;
            }
        }
    }

    /// This consumer's dead letters, oldest first, at most `limit`.
    pub async fn dead_letters(&self, limit: i64) -> Result<Vec<DeadLetter>, InboxError> {
        let mut conn = self.pool.get().await.map_err(Error::from)?;
        Ok(store::dead_letters(&mut conn, &self.consumer, limit).await?)
    }

    /// Delete this consumer's `done` records settled more than `older_than`
    /// ago, `batch` rows per statement (each its own short transaction),
    /// until none is left; returns how many were deleted. Dead letters are
    /// kept. Keep `older_than` longer than any message can still be
    /// redelivered (see the [module docs](super)); one past a thousand
    /// years counts as a thousand (no record is older, and a time before
    /// PostgreSQL's calendar would fail the statement).
    pub async fn purge(&self, older_than: Duration, batch: i64) -> Result<u64, InboxError> {
        let batch = batch.max(1);
        let mut conn = self.pool.get().await.map_err(Error::from)?;
        let mut deleted = 0_u64;
        loop {
            let n = store::purge_batch(&mut conn, &self.consumer, older_than, batch).await?;
            deleted += n as u64;
            if (n as i64) < batch {
                return Ok(deleted);
            }
        }
    }
}
