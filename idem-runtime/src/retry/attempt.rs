//! One attempt's transaction, begun at once or on first use.
//!
//! Most attempts begin their transaction before the body runs. An external
//! idempotent call's body attempt does not: its outside call runs with no
//! transaction open and no pooled connection held (a transaction held
//! across a call to another system would hold its locks as long), and the transaction that
//! records the outcome, with the body's own local writes, begins when the
//! body first asks for a connection through [`Deferred::conn`].
//!
//! Either way the transaction's statements are bounded by the call's
//! deadline ([`Timeouts`]): at once, by the time left when it begins; on
//! first use, by the time that was left when the body started, counted from
//! when the transaction begins.

use std::time::{Duration, Instant};

use diesel::QueryResult;
use diesel_async::AsyncPgConnection;

use deadpool::managed::TimeoutType;

use super::{Isolation, RetryCause, Transient};
use crate::error::Error;
use crate::pool::{Pool, PoolError};
use crate::tx::{
    Closing, CommitFailure, Last, Opening as First, Render, RolledBack, Session, Timeouts, Tx,
};

/// How an attempt begins its transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[doc(hidden)]
pub enum Begin {
    /// Check out a connection and `BEGIN` before the body runs.
    Now,
    /// Only when the body (or the step after it) first needs the database.
    OnFirstUse,
}

/// Where and how an attempt begun on first use begins.
#[derive(Clone)]
struct Lazy {
    pool: Pool,
    isolation: Isolation,
    /// The time its transaction gets, checkout included.
    budget: Duration,
    /// The last attempt the budget of attempts allows.
    last: bool,
}

/// One attempt's connection and transaction. Dropping it while its
/// transaction is open (the caller's future was cancelled mid-attempt)
/// cancels the running statement and closes the connection.
#[doc(hidden)]
pub struct Attempt {
    tx: Option<Tx>,
    /// How long its `COMMIT` (or `ROLLBACK`) may take to be answered.
    commit_timeout: Duration,
    /// `Begin::OnFirstUse`: where and how to begin.
    lazy: Option<Lazy>,
    /// A lost connection met while beginning on first use: nothing of the
    /// transaction ran, so the attempt is worth replaying.
    lost_at_begin: bool,
    /// The attempt before this one committed and went on
    /// ([`Step::CommitAndContinue`](super::Step::CommitAndContinue)), and
    /// its `COMMIT` went unanswered: what it wrote may not be there.
    follows_unknown_commit: bool,
}

impl Attempt {
    pub(crate) fn begun(tx: Tx, commit_timeout: Duration) -> Attempt {
        tx.bound_body_commit(commit_timeout);
        Attempt {
            tx: Some(tx),
            commit_timeout,
            lazy: None,
            lost_at_begin: false,
            follows_unknown_commit: false,
        }
    }

    /// An attempt whose transaction begins on first use, and then gets
    /// `budget` for its checkout and statements.
    pub(crate) fn deferred(
        pool: Pool,
        isolation: Isolation,
        budget: Duration,
        last: bool,
        commit_timeout: Duration,
    ) -> Attempt {
        Attempt {
            tx: None,
            commit_timeout,
            lazy: Some(Lazy {
                pool,
                isolation,
                budget,
                last,
            }),
            lost_at_begin: false,
            follows_unknown_commit: false,
        }
    }

    pub(crate) fn set_follows_unknown_commit(&mut self, unknown: bool) {
        self.follows_unknown_commit = unknown;
    }

    /// Whether the attempt before this one committed and went on, and its
    /// `COMMIT` went unanswered.
    pub(crate) fn follows_unknown_commit(&self) -> bool {
        self.follows_unknown_commit
    }

    /// Whether a synchronous standby must hold what this attempt shows
    /// (its pool's [`Replication`](crate::pool::Replication)).
    pub(crate) fn synchronous(&self) -> bool {
        self.tx.as_ref().and_then(Tx::replication) == Some(crate::pool::Replication::Synchronous)
    }

    /// The connection the attempt's body runs on.
    ///
    /// # Panics
    /// On an attempt begun on first use whose transaction is not open yet:
    /// use [`Attempt::open`] there.
    pub fn conn(&mut self) -> &mut AsyncPgConnection {
        self.tx
            .as_mut()
            .expect("this attempt's transaction begins on first use: call open()")
            .conn()
    }

    /// Whether the connection in the attempt's slot is still the one its
    /// transaction began on: not when the body swapped it for another
    /// (see [`crate::pool`]). True before the transaction opens.
    pub(crate) fn holds_its_session(&self) -> bool {
        match self.tx.as_ref() {
            Some(tx) => tx.holds_its_session(),
            None => true,
        }
    }

    /// The attempt's connection, beginning its transaction first when it
    /// was deferred.
    pub async fn open(&mut self) -> Result<&mut AsyncPgConnection, Error> {
        if self.tx.is_none() {
            self.begin_deferred(None).await?;
        }
        Ok(self.conn())
    }

    /// Run `first` as the attempt's first statements, sent with its `BEGIN`
    /// (no round trip of their own). Only an attempt that begins on first
    /// use has them (local mode's, see `Call::begin`); on one already open
    /// they would come after statements that were to follow them, so they
    /// are refused.
    pub(crate) async fn open_with<F: First + Sync>(
        &mut self,
        first: &F,
    ) -> Result<QueryResult<F::Output>, Error> {
        match self.tx.as_mut() {
            Some(_) => Ok(Err(diesel::result::Error::QueryBuilderError(
                "idem: the first statements of an attempt whose transaction is already open (a bug in idem)"
                    .into(),
            ))),
            None => {
                let render = |session: &mut Session<'_>| first.write(session);
                self.begin_deferred(Some(&render)).await?;
                let tx = self.tx.as_mut().expect("just begun");
                Ok(tx
                    .opened()
                    .expect("begun with statements to send")
                    .and_then(|rows| first.read(rows)))
            }
        }
    }

    /// Commit with `last` sent in the same message as `COMMIT`.
    ///
    /// # Panics
    /// On an attempt whose transaction was never opened.
    pub(crate) async fn commit_with<L: Last>(&mut self, last: &L) -> Result<L::Output, Closing> {
        let timeout = self.commit_timeout;
        self.tx
            .as_mut()
            .expect("an attempt commits with a statement only once open")
            .commit_with(timeout, last)
            .await
    }

    /// Check out a connection and begin the deferred transaction, with
    /// `opening` sent with its `BEGIN`, within the attempt's budget.
    async fn begin_deferred(&mut self, opening: Option<Render<'_>>) -> Result<(), Error> {
        let lazy = self
            .lazy
            .clone()
            .expect("an attempt without a transaction begins on first use");
        let until = Instant::now() + lazy.budget;
        match open(&lazy.pool, lazy.isolation, until, lazy.last, opening).await {
            Ok(tx) => {
                tx.bound_body_commit(self.commit_timeout);
                self.tx = Some(tx);
                Ok(())
            }
            Err(Opening::Checkout(err)) => {
                self.lost_at_begin = matches!(err, PoolError::Backend(_));
                Err(Error::Pool(err))
            }
            Err(Opening::Begin(err)) => {
                self.lost_at_begin = err.transient() == Some(RetryCause::ConnectionLost);
                Err(Error::Begin(err))
            }
        }
    }

    /// Why the attempt failed in a way worth replaying, as seen on its
    /// connection.
    pub(crate) fn failure_cause(&self) -> Option<RetryCause> {
        match &self.tx {
            Some(tx) => tx.error_cause(),
            None => self.lost_at_begin.then_some(RetryCause::ConnectionLost),
        }
    }

    /// Whether its transaction failed on a prepared statement of idem's the
    /// session no longer held (see `crate::tx`'s prepared statements).
    pub(crate) fn statement_lost(&self) -> bool {
        self.tx.as_ref().is_some_and(Tx::statement_lost)
    }

    /// Whether the body ended (or began) a transaction itself, once what it
    /// sent is answered (up to the commit timeout; see
    /// [`Tx::ended_by_body_settled`]); `Some(true)` when it committed what
    /// it had written. An early look, before idem's `ROLLBACK`: a request
    /// the body queued may not be on the wire yet (see
    /// [`Attempt::roll_back_reading`], which decides).
    pub(crate) async fn ended_by_body_settled(&mut self) -> Option<bool> {
        match &mut self.tx {
            Some(tx) => tx.ended_by_body_settled(self.commit_timeout).await,
            None => None,
        }
    }

    pub(crate) async fn commit(&mut self) -> Result<(), CommitFailure> {
        match self.tx.as_mut() {
            Some(tx) => tx.commit(self.commit_timeout).await,
            // Nothing began, nothing to commit.
            None => Ok(()),
        }
    }

    /// Roll back; true when the connection turned out to be lost.
    pub(crate) async fn roll_back(&mut self) -> bool {
        match self.tx.as_mut() {
            Some(tx) => tx.roll_back(self.commit_timeout).await,
            None => false,
        }
    }

    /// Roll back, and read where the body had left the transaction once
    /// everything it sent or queued is answered (see
    /// [`Tx::roll_back_reading`]): what a body that returned an error, or
    /// a step back to the loop, is decided on.
    pub(crate) async fn roll_back_reading(&mut self) -> RolledBack {
        match self.tx.as_mut() {
            Some(tx) => tx.roll_back_reading(self.commit_timeout).await,
            None => RolledBack {
                lost: false,
                ended: None,
            },
        }
    }

    /// See [`Tx::watch_end`]; with the attempt's commit timeout.
    pub(crate) fn watch_end(&mut self) -> Option<(crate::tx::EndWatch, Duration)> {
        Some((self.tx.as_mut()?.watch_end()?, self.commit_timeout))
    }

    /// The attempt's transaction, for [`Tx::run_alone`] once it ended.
    pub(crate) fn into_tx(self) -> Option<Tx> {
        self.tx
    }

    /// See [`Tx::after_body_commit`].
    pub(crate) fn after_body_commit(&mut self, then: crate::tx::AfterBodyCommit) {
        if let Some(tx) = self.tx.as_mut() {
            tx.after_body_commit(then);
        }
    }

    pub(crate) fn end_in_background(self) {
        if let Some(tx) = self.tx {
            tx.end_in_background(self.commit_timeout);
        }
    }
}

/// Why a transaction could not be opened.
pub(crate) enum Opening {
    /// No connection in time, or none could be set up: nothing ran.
    Checkout(PoolError),
    /// `BEGIN` failed.
    Begin(diesel::result::Error),
}

/// Check a connection out of `pool` and begin a transaction with
/// `isolation` (and `opening` sent with `BEGIN`, see [`Tx::begin`]), both by
/// `until`, its statements bounded by the time then left
/// (all of it for a lock wait on the `last` attempt). A connection that broke
/// while idle in the pool ran nothing, so another is tried at once: one per
/// connection the pool may hold, so a pool whose connections all went stale
/// at once (a restarted server, a proxy that dropped them) is worked through
/// without spending the caller's budget. The one checkout of every attempt,
/// begun at once or on first use.
pub(crate) async fn open(
    pool: &Pool,
    isolation: Isolation,
    until: Instant,
    last: bool,
    opening: Option<Render<'_>>,
) -> Result<Tx, Opening> {
    let mut stale = 0;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        let conn = match tokio::time::timeout(left, pool.get()).await {
            Ok(checked_out) => checked_out,
            Err(_elapsed) => Err(PoolError::Timeout(TimeoutType::Wait)),
        }
        .map_err(Opening::Checkout)?;
        let left = until.saturating_duration_since(Instant::now());
        match Tx::begin(conn, isolation, Timeouts::within(left, last), opening).await {
            Ok(tx) => return Ok(tx),
            Err(failure)
                if failure.0.transient() == Some(RetryCause::ConnectionLost)
                    && stale < pool.status().max_size =>
            {
                stale += 1;
                tracing::debug!(error = %failure.0, "a pooled connection was stale; trying another");
            }
            Err(failure) => return Err(Opening::Begin(failure.0)),
        }
    }
}

/// The database side of an external idempotent call's body: nothing is
/// checked out while the body calls the other system; [`Deferred::conn`]
/// begins the transaction that records the call's outcome, and the body's
/// local writes made through it commit with that record.
///
/// An external body takes it in place of the connection (a sketch: the
/// macro lives in the `idem` facade, which this crate cannot name; the same
/// example compiles in the guide, `docs/idempotent.md`):
///
/// ```text
/// #[idempotent(key = cmd.key, mode = external, scope = none)]
/// async fn refund(db: &mut idem::Deferred<'_>, cmd: &RefundCmd) -> Result<Refund, AppError> {
///     let receipt = psp.refund(&cmd.order, &current_key().unwrap()).await?; // no transaction open
///     let conn = db.conn().await?;                                          // now one begins
///     record_refund(conn, &receipt).await?;
///     Ok(Refund { receipt })
/// }
/// ```
pub struct Deferred<'a> {
    attempt: &'a mut Attempt,
}

impl<'a> Deferred<'a> {
    #[doc(hidden)]
    pub fn new(attempt: &'a mut Attempt) -> Self {
        Deferred { attempt }
    }

    /// The connection of the transaction that records this call's outcome,
    /// checked out and begun on first use. Anything the body sends to
    /// another system after this runs with that transaction open.
    pub async fn conn(&mut self) -> Result<&mut AsyncPgConnection, Error> {
        self.attempt.open().await
    }

    /// Whether the transaction has begun.
    pub fn is_open(&self) -> bool {
        self.attempt.tx.is_some()
    }
}
