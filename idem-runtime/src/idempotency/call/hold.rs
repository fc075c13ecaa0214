//! Local mode's key held as outcome unknown once a body committed by hand:
//! its record rides on idem's own `COMMIT`, which never ran, so without
//! the hold a repeat would run the body again. Held as soon as the call
//! knows, and before callers waiting on the pool get the attempt's slot:
//! on the attempt's own connection, or, that connection lost, on one
//! outside the pool; else through the pool. A call dropped first hands its
//! transaction to a task that does the same (`after_body_commit`). And the
//! bounded statements external mode settles its claim with.

use std::time::{Duration, Instant};

use diesel::sql_types::{Binary, Nullable, Text};
use diesel_async::RunQueryDsl;
use scoped_futures::ScopedFutureExt;

use super::super::request::Request;
use super::super::store::{self, HoldUnknown};
use crate::error::Error;
use crate::pool::Pool;
use crate::retry::{retry, RetryPolicy};
use crate::tx::{AfterBodyCommit, Tx};

/// The least time a key's settling is given (its local hold after a body
/// committed by hand, an external claim released or marked unknown),
/// whatever the attempt's `commit_timeout_ms`: a local key left free over
/// a committed effect is run again by every repeat, a claim left as it is
/// stays in progress until its lease runs out, and each takes a round trip
/// or three (on the call's own connection, else a new one), which a
/// `commit_timeout_ms` of a few milliseconds never leaves (found: at 1 ms
/// no hold was written).
pub(super) const SETTLE_AT_LEAST: Duration = Duration::from_secs(1);

/// Hold `request`'s key (local mode) after its body committed by hand, on
/// `ended`'s connection when the attempt kept one, else through `pool`,
/// within `timeout` ([`SETTLE_AT_LEAST`] at least). Logged, never returned:
/// the caller's answer is the body's end.
pub(super) async fn hold_unknown(
    pool: &Pool,
    timeout: Duration,
    request: &Request,
    ended: Option<Tx>,
) {
    let timeout = timeout.max(SETTLE_AT_LEAST);
    let statement = request.hold_unknown();
    let started = Instant::now();
    let mut ended = ended;
    // Dropped before the hold is answered (here or outside the pool), the
    // transaction writes it again (see `after_body_commit`), its pool slot
    // given up only then; until `give_up`.
    let on_its_own = match ended.as_mut() {
        Some(tx) => tx.run_alone(timeout, statement).await,
        None => None,
    };
    let key = request.key();
    let held = match on_its_own {
        Some(Ok(written)) => Ok(written),
        // Failed there (its connection lost after the body's `COMMIT`, say):
        // elsewhere, in what is left of `timeout`. Had the first written it
        // after all, the second finds it by its owner and writes it again.
        not_there => {
            if let Some(Err(e)) = not_there {
                tracing::debug!(key, error = %e, "the hold on the call's own connection failed");
            }
            let left = || {
                timeout
                    .checked_sub(started.elapsed())
                    .filter(|l| !l.is_zero())
            };
            // Its slot still taken, the callers queued on the pool come
            // after a connection of its own; given half of what is left, so
            // that a server that stopped accepting connections leaves the
            // pool's idle ones time to take the hold.
            let outside = match left().filter(|_| ended.as_ref().is_some_and(Tx::keeps_a_lost_slot))
            {
                Some(left) => outside(pool, left / 2, statement).await,
                None => Err("no connection of its own".to_owned()),
            };
            // Else, or refused there too (a session setting a pooler's
            // server connection kept), through the pool.
            match (outside, left()) {
                (Ok(written), _) => Ok(written),
                (Err(_), Some(left)) => through_the_pool(pool, left, &mut ended, statement).await,
                (Err(_), None) => Err(format!("no answer within {timeout:?}")),
            }
        }
    };
    give_up(&mut ended);
    match held {
        Ok(1) => tracing::warn!(
            key,
            "the body committed by hand: its key is held as outcome unknown"
        ),
        Ok(_) => tracing::error!(
            key,
            "the body committed by hand, and another request of its key ran in the meantime (once the body's COMMIT released the key's lock): its key already had a live record"
        ),
        Err(e) => {
            tracing::error!(key, error = %e, "the body committed by hand, and its key could not be held as outcome unknown: a repeat will run it again")
        }
    }
}

/// The hold through the pool, within `left`. On a pool of more than one,
/// first with the call's slot still taken, for half of `left`: the
/// checkout then waits for a connection another caller returns, where in
/// the freed slot it would make a new one (which a server that stopped
/// accepting connections leaves stalled for all the time left). Then, as
/// on a pool of one (whose checkout would wait for that slot), with the
/// slot given up: two holds keeping theirs must not wait on each other.
async fn through_the_pool(
    pool: &Pool,
    left: Duration,
    ended: &mut Option<Tx>,
    statement: HoldUnknown<'_>,
) -> Result<usize, String> {
    let started = Instant::now();
    if ended.is_some() && pool.status().max_size > 1 {
        // A write that went out before the time ran out is found again by
        // the second, by its owner.
        if let Ok(written) = bounded(pool, left / 2, "idem.hold_unknown", statement).await {
            return Ok(written);
        }
    }
    give_up(ended);
    let rest = left.saturating_sub(started.elapsed());
    if rest.is_zero() {
        return Err(format!("no answer within {left:?}"));
    }
    bounded(pool, rest, "idem.hold_unknown", statement)
        .await
        .map_err(|e| e.to_string())
}

/// The hold is answered (or written elsewhere): the transaction, and the
/// pool slot it kept, go.
fn give_up(ended: &mut Option<Tx>) {
    if let Some(mut tx) = ended.take() {
        tx.done_after_body_commit();
    }
}

/// [`hold_unknown`] for a call dropped after its body committed by hand,
/// in a task of its own (nothing without a Tokio runtime, or when the
/// runtime shuts down first: logged).
pub(super) fn hold_in_background(pool: Pool, timeout: Duration, request: Request) {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            // A runtime shutting down drops its tasks unrun, or midway (a
            // call dropped with it finds its handle still current).
            let unheld = Unheld(Some(request.key().to_owned()));
            runtime.spawn(async move {
                let mut unheld = unheld;
                hold_unknown(&pool, timeout, &request, None).await;
                unheld.0 = None;
            });
        }
        Err(_) => tracing::error!(key = request.key(), "a call dropped after its body committed by hand, outside a Tokio runtime: its key is not held"),
    }
}

/// The hold of a call dropped after its body committed by hand, its
/// transaction still open: run with that transaction (rolled back first)
/// on its own connection, whose pool slot stays taken until the hold is
/// written, so that the callers waiting on the pool (duplicates among them)
/// come after it (see [`Tx::after_body_commit`]).
pub(super) fn after_body_commit(
    pool: Pool,
    timeout: Duration,
    request: Request,
) -> AfterBodyCommit {
    Box::new(move |mut tx: Tx| {
        // Made before the task: a runtime shutting down drops it unrun.
        let unheld = Unheld(Some(request.key().to_owned()));
        Box::pin(async move {
            let mut unheld = unheld;
            // Its `ROLLBACK` is answered after the body's end: a `COMMIT`
            // that failed (a deferred constraint) committed nothing, and
            // there is nothing to hold.
            if tx.roll_back_reading(timeout).await.ended == Some(false) {
                unheld.0 = None;
                return;
            }
            hold_unknown(&pool, timeout, &request, Some(tx)).await;
            unheld.0 = None;
        })
    })
}

/// A background hold not (known to be) written: logged when dropped.
struct Unheld(Option<String>);

impl Drop for Unheld {
    fn drop(&mut self) {
        if let Some(key) = self.0.take() {
            tracing::error!(key, "a call dropped after its body committed by hand: its runtime shut down before its key was held; a repeat will run it again");
        }
    }
}

/// Run `statement` on a connection outside the pool's slots, within
/// `timeout` (see `Tx::keeps_a_lost_slot`).
async fn outside<Q>(pool: &Pool, timeout: Duration, statement: Q) -> Result<usize, String>
where
    Q: diesel::query_builder::QueryFragment<diesel::pg::Pg> + diesel::query_builder::QueryId + Send,
{
    let write = async {
        let mut conn = pool.connect_outside().await.map_err(|e| e.to_string())?;
        statement
            .execute(&mut *conn)
            .await
            .map_err(|e| e.to_string())
    };
    tokio::time::timeout(timeout, write)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {timeout:?}")))
}

/// Run one statement of this call's settling (its external claim, or its
/// local key held as outcome unknown) through the retry loop, within
/// `timeout`: its row lock waits and statements are bounded by the loop's
/// deadline, its `COMMIT` by the same `timeout` (the row may still be locked
/// by an attempt whose COMMIT went unanswered). How many rows it wrote.
pub(super) async fn bounded<Q>(
    pool: &Pool,
    timeout: Duration,
    name: &'static str,
    statement: Q,
) -> Result<usize, Error>
where
    Q: diesel::query_builder::QueryFragment<diesel::pg::Pg>
        + diesel::query_builder::QueryId
        + Clone
        + Send
        + Sync,
{
    let policy = RetryPolicy::new().deadline(timeout).commit_timeout(timeout);
    retry(pool, policy, name, |conn| {
        let statement = statement.clone();
        async move { statement.execute(conn).await.map_err(Error::Database) }.scope_boxed()
    })
    .await
}

/// Settle this call's external claim by `statement` (`store::RELEASE` or
/// `store::MARK_UNKNOWN`), within `timeout`.
pub(super) async fn settle(
    pool: &Pool,
    timeout: Duration,
    request: &Request,
    statement: &'static str,
) -> Result<usize, Error> {
    bounded(
        pool,
        timeout,
        "idem.settle_claim",
        settling(request, statement),
    )
    .await
}

fn settling<'r>(
    request: &'r Request,
    statement: &'static str,
) -> impl diesel::query_builder::QueryFragment<diesel::pg::Pg>
       + diesel::query_builder::QueryId
       + Clone
       + Send
       + Sync
       + 'r {
    diesel::sql_query(statement)
        .bind::<Text, _>(request.scope())
        .bind::<Text, _>(request.key())
        .bind::<Nullable<Binary>, _>(request.owner())
}

/// Release this call's external claim when no body ran, within `timeout`.
/// Its `COMMIT` may have gone unanswered and still be running (not
/// cancelled behind a transaction pooler, or past its cancel): a plain
/// `DELETE` would not see it, and the claim, committed after, would hold
/// the key in progress, then as outcome unknown, over no body run (found
/// behind PgBouncer). So the claim is sent again first, in the same
/// transaction: it waits for that `COMMIT` on the key's unique index, then
/// finds the claim by this call's token, or makes it anew, and the release
/// deletes it. Another request's record is left alone.
pub(super) async fn release_claim(
    pool: &Pool,
    timeout: Duration,
    request: &Request,
) -> Result<usize, Error> {
    let policy = RetryPolicy::new().deadline(timeout).commit_timeout(timeout);
    retry(pool, policy, "idem.release_claim", |conn| {
        async move {
            request.claim(conn).await.map_err(Error::Database)?;
            let release = settling(request, store::RELEASE);
            release.execute(conn).await.map_err(Error::Database)
        }
        .scope_boxed()
    })
    .await
}

/// An external claim's settling that failed within `within`: logged, and,
/// when no body ran, released again in the background.
pub(super) fn unsettled(
    pool: &Pool,
    within: Duration,
    request: &Request,
    body_ran: bool,
    e: Error,
) {
    let key = request.key();
    if body_ran {
        tracing::error!(key, error = %e, "could not settle an external idempotency claim; its lease will expire into outcome unknown");
    } else {
        tracing::warn!(key, error = %e, "an external claim with no body run was not released in time; released in the background");
        release_in_background(pool.clone(), within, request.clone());
    }
}

/// [`release_claim`] once more, in a task of its own, after it failed
/// within the call's bound, or for a call dropped after its claim and
/// before its body ran: a claim `COMMIT` that outlasts that bound (one
/// that goes on past its cancel, a WAL flush that stalls, or any behind a
/// transaction pooler, which gets no cancel) commits after the release
/// gave up, or the release's own `COMMIT` was cancelled, and the key
/// stayed in progress, then outcome unknown, over no body run (found by
/// session 52). Given the claim's lease (`within` at least): no body ran
/// for this token, so its claim may go whenever it is found.
pub(super) fn release_in_background(pool: Pool, within: Duration, request: Request) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        tracing::error!(key = request.key(), "an external claim with no body run could not be released, outside a Tokio runtime: its lease will expire into outcome unknown");
        return;
    };
    let timeout = request.config.lease.max(within);
    runtime.spawn(async move {
        match release_claim(&pool, timeout, &request).await {
            Ok(_) => tracing::info!(key = request.key(), "an external claim with no body run released in the background"),
            Err(e) => tracing::error!(key = request.key(), error = %e, "could not release an external claim with no body run; its lease will expire into outcome unknown"),
        }
    });
}
