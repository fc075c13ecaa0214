//! A transaction's first statements sent with its `BEGIN`, and its last
//! statement sent with its `COMMIT`: no round trip of their own.
//!
//! diesel-async's transaction manager must learn of both `BEGIN` and
//! `COMMIT` (so that a `conn.transaction(..)` in a body becomes a
//! savepoint), and its supported hooks send each as one simple query. The
//! connection's wire replaces that query, as it goes out, with the same
//! statements and idem's among them, in the extended protocol's messages
//! ([`super::prepared`]; see `crate::pool`'s wire, which also keeps the
//! rows tokio-postgres reads past). Values go as parameters.
//!
//! # Failure
//!
//! A failed first statement fails the transaction `BEGIN` opened; a failed
//! last statement fails the transaction before its `COMMIT` runs. Either
//! way the transaction is left open (failed), for its owner to roll back
//! once it has read the cause; diesel-async does not count it as open, so
//! [`Tx`] rolls it back itself. A transaction the server already reports
//! failed sends no last statement at all: it is rolled back, as
//! [`Tx::commit`] does.

use std::time::Duration;

use diesel::result::Error as DieselError;
use diesel::QueryResult;

use super::{CommitFailure, Session, Tx};
use crate::pool::{Answer, MalformedRow, Row, Wire};

/// Statements to send with `BEGIN`.
pub(crate) trait Opening {
    type Output;
    /// Write the statements through `session`.
    fn write(&self, session: &mut Session<'_>) -> QueryResult<()>;
    /// The answer, from the rows of each statement, in order.
    fn read(&self, results: Vec<Vec<Row>>) -> QueryResult<Self::Output>;
}

/// A statement to send with `COMMIT`. It must write or fail, never do
/// nothing.
pub(crate) trait Last {
    type Output;
    /// Write the statement through `session`.
    fn write(&self, session: &mut Session<'_>) -> QueryResult<()>;
    /// Whether its command tag says it wrote: when not, the statement that
    /// ran was not the one written (another under its prepared name).
    fn wrote(&self, tag: &[u8]) -> bool;
    /// The answer once committed, from its rows (`None`: none were read).
    fn read(&self, rows: Option<Vec<Row>>) -> Self::Output;
}

/// [`Opening::write`] of the statements to send with a transaction's
/// `BEGIN`, called once its connection is known.
pub(crate) type Render<'a> = &'a (dyn Fn(&mut Session<'_>) -> QueryResult<()> + Sync);

/// How a transaction whose last statement went out with its `COMMIT`
/// ended, when it did not commit.
#[derive(Debug)]
pub(crate) enum Closing {
    /// The last statement failed: nothing was committed. The transaction
    /// is still open (failed), for its owner to roll back once it has read
    /// the failure's cause.
    Failed(DieselError),
    /// The `COMMIT` was not committed for certain (as [`Tx::commit`]).
    Commit(CommitFailure),
    /// Committed, but the last statement did not write ([`Last::wrote`]):
    /// the connection is discarded.
    Unwritten,
}

/// A ride's messages: what `before` writes (what the simple query being
/// replaced does), what `write` writes, then `after`, ended by a `Sync`.
/// Refused before anything is sent when the session would not read its
/// values as written ([`values_hold`]).
pub(super) struct Unit {
    pub(super) messages: Vec<u8>,
    pub(super) parses: Vec<Option<&'static str>>,
    /// The index of the first statement `write` wrote.
    pub(super) first: usize,
}

pub(super) fn ride_unit(
    wire: &Wire,
    before: impl FnOnce(&mut Session<'_>) -> QueryResult<()>,
    write: impl FnOnce(&mut Session<'_>) -> QueryResult<()>,
    after: Option<&str>,
) -> QueryResult<Unit> {
    values_hold(wire)?;
    let mut session = Session::new(wire);
    before(&mut session)?;
    let first = session.statements();
    write(&mut session)?;
    if let Some(sql) = after {
        session.plain(sql);
    }
    let (messages, parses) = session.finish();
    Ok(Unit {
        messages,
        parses,
        first,
    })
}

/// Whether values written as UTF-8 read as written on this session: not
/// when its client encoding was changed (a body's `SET client_encoding`),
/// where the key read before the body and the one recorded after it would
/// differ. Then nothing rides: the call fails, and writes nothing.
fn values_hold(wire: &Wire) -> QueryResult<()> {
    match wire.foreign_encoding() {
        None => Ok(()),
        Some(encoding) => Err(DieselError::QueryBuilderError(
            format!(
                "idem: the session's client_encoding is {encoding}, not UTF8 (set by the \
                 function's body?); local mode's statements are not sent"
            )
            .into(),
        )),
    }
}

/// The rows a capture kept, statement by statement, from the `first`.
pub(super) fn captured(
    answers: Option<Result<Vec<Answer>, MalformedRow>>,
    first: usize,
) -> QueryResult<Vec<Vec<Row>>> {
    match answers {
        Some(Ok(answers)) => Ok(answers.into_iter().skip(first).map(|a| a.rows).collect()),
        Some(Err(MalformedRow)) => Err(DieselError::DeserializationError(
            "idem: a row sent with BEGIN could not be read".into(),
        )),
        None => Err(DieselError::DeserializationError(
            "idem: the rows of the statements sent with BEGIN were not seen".into(),
        )),
    }
}

impl Tx {
    /// Send `last` with `COMMIT`, unless the transaction failed. `timeout`
    /// bounds the wait for the answer.
    pub(crate) async fn commit_with<L: Last>(
        &mut self,
        timeout: Duration,
        last: &L,
    ) -> Result<L::Output, Closing> {
        if let Some(refusal) = self.refuse(timeout).await {
            return Err(Closing::Commit(refusal));
        }
        // Nothing was sent yet: the transaction is still sound.
        let wire = self.wire_arc();
        let unit = ride_unit(
            &wire,
            |_| Ok(()),
            |session| last.write(session),
            Some("COMMIT"),
        )
        .map_err(Closing::Failed)?;
        wire.ride(b"COMMIT".to_vec(), unit.messages, unit.parses);
        let committed = self.send_commit(timeout).await;
        let released = wire.released_savepoint();
        let answer = wire
            .unride()
            .and_then(Result::ok)
            .and_then(|answers| answers.into_iter().next());
        match committed {
            Ok(()) => match answer {
                Some(answer) if !last.wrote(&answer.tag) => {
                    tracing::error!(
                        tag = %String::from_utf8_lossy(&answer.tag),
                        "the statement sent with COMMIT did not write: another statement stands under its name; closing the connection"
                    );
                    self.discard();
                    Err(Closing::Unwritten)
                }
                Some(answer) => Ok(last.read(Some(answer.rows))),
                None => Ok(last.read(None)),
            },
            // The server says the transaction failed and is still open: the
            // last statement failed, and COMMIT never ran. diesel-async
            // counted the transaction as ended with the error, which the
            // server sends before the status that says so.
            Err(CommitFailure::Failed(err))
                if wire.settled(timeout).await && wire.unfinished() && !wire.closed() =>
            {
                self.open = true;
                self.unmanaged = true;
                Err(Closing::Failed(err))
            }
            // The wire refused the `RELEASE SAVEPOINT` a savepoint the body
            // left open sent in place of `COMMIT`, and closed the connection
            // before it went out: nothing committed.
            Err(CommitFailure::Unknown) if released => {
                Err(Closing::Commit(CommitFailure::SavepointOpen))
            }
            Err(failure) => Err(Closing::Commit(failure)),
        }
    }
}
