//! A transaction's first statements sent together, and its last statement
//! before its `COMMIT`.
//!
//! Statements that do not depend on each other go out together through a
//! shared reference to the connection (how diesel-async pipelines: each is
//! sent when its future is first polled, and the futures are joined in a
//! fixed order, so they reach the server in that order): a local-mode
//! idempotent call sends its advisory lock and the read of its record in one
//! round trip.
//!
//! `BEGIN` and `COMMIT` are not pipelined with them. diesel-async's
//! transaction manager must learn of both (so that a `conn.transaction(..)`
//! in a body becomes a savepoint), and its supported hooks send them
//! themselves, on an exclusive borrow of the connection; telling it of a
//! `BEGIN` or `COMMIT` sent beside them would take an accessor diesel-async
//! keeps hidden. Each costs its own round trip (the README has the figures).
//!
//! # Failure
//!
//! When the server refuses the last statement, the transaction is failed,
//! and it is left open for its owner to roll back once it has read the
//! cause. A transaction the server already reports failed sends no last
//! statement at all: it is rolled back, as [`Tx::commit`] does.

use std::time::Duration;

use diesel::result::Error as DieselError;
use diesel::QueryResult;
use diesel_async::AsyncPgConnection;
use futures_util::future::BoxFuture;

use super::{CommitFailure, Tx};

/// Statements sent together, through a shared reference to the connection.
pub(crate) trait Pipelined {
    type Output: Send;
    /// The statements, sent when the future is first polled.
    fn send<'c>(&'c self, conn: &'c AsyncPgConnection) -> BoxFuture<'c, QueryResult<Self::Output>>;
}

/// How a transaction whose last statement went out before its `COMMIT`
/// ended, when it did not commit.
#[derive(Debug)]
pub(crate) enum Closing {
    /// The last statement failed: nothing was committed. The transaction
    /// is still open (failed), for its owner to roll back once it has read
    /// the failure's cause.
    Failed(DieselError),
    /// The statement was answered, the `COMMIT` was not committed for
    /// certain (as [`Tx::commit`]).
    Commit(CommitFailure),
}

impl Tx {
    /// Send `last`, then, once it is answered, `COMMIT`, unless a statement
    /// failed. `timeout` bounds the wait for `COMMIT`'s answer; the server
    /// bounds `last` by the transaction's statement timeout.
    pub(crate) async fn commit_after<P: Pipelined>(
        &mut self,
        timeout: Duration,
        last: &P,
    ) -> Result<P::Output, Closing> {
        if let Some(refusal) = self.refuse(timeout).await {
            return Err(Closing::Commit(refusal));
        }
        match last.send(self.conn()).await {
            Ok(output) => self
                .commit(timeout)
                .await
                .map(|()| output)
                .map_err(Closing::Commit),
            Err(err) => Err(Closing::Failed(err)),
        }
    }
}
