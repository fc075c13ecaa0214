//! A transaction's first statements sent with its `BEGIN`, and its last
//! statement sent with its `COMMIT`: no round trip of their own.
//!
//! diesel-async's transaction manager must learn of both `BEGIN` and
//! `COMMIT` (so that a `conn.transaction(..)` in a body becomes a
//! savepoint), and its supported hooks send each as one simple query. What
//! rides on them is written into that same query (see `crate::pool`'s wire,
//! which also keeps the rows tokio-postgres reads past): so it is SQL text,
//! with its values written in as literals ([`crate::sql`]), calling
//! statements prepared once per session ([`super::prepared`]).
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
use diesel_async::{AsyncPgConnection, SimpleAsyncConnection};

use super::{CommitFailure, Session, Tx};
use crate::pool::{MalformedRow, Row, Wire};

/// Statements to send with `BEGIN`, whose last one's rows are read.
pub(crate) trait Opening {
    type Output;
    /// The statements as simple-query text (literals, no parameters), their
    /// prepared statements called through `session`.
    fn sql(&self, session: &mut Session<'_>) -> QueryResult<String>;
    /// The answer, from the rows of the last statement.
    fn read(&self, rows: Vec<Row>) -> QueryResult<Self::Output>;
}

/// A statement to send with `COMMIT`. It must write or fail, never do
/// nothing: its row count is not read.
pub(crate) trait Last {
    type Output;
    /// The statement as simple-query text (literals, no parameters), its
    /// prepared statement called through `session`.
    fn sql(&self, session: &mut Session<'_>) -> QueryResult<String>;
    /// Whether it returns rows to read.
    fn returns_rows(&self) -> bool;
    /// The answer once committed, from its rows (`None`: none were read).
    fn read(&self, rows: Option<Vec<Row>>) -> Self::Output;
}

/// [`Opening::sql`] of the statements to send with a transaction's `BEGIN`,
/// called once its connection is known.
pub(crate) type Render<'a> = &'a (dyn Fn(&mut Session<'_>) -> QueryResult<String> + Sync);

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
}

/// The text `write` renders for one ride on `wire`'s session, and the
/// statements it prepares there; refused before anything is sent when the
/// session would not read its literals as written ([`literals_hold`]) or a
/// simple query cannot carry it ([`simple_query`]).
pub(super) fn ride_text(
    wire: &Wire,
    write: impl FnOnce(&mut Session<'_>) -> QueryResult<String>,
) -> QueryResult<(String, Vec<&'static str>)> {
    literals_hold(wire)?;
    let mut session = Session::new(wire);
    let sql = simple_query(write(&mut session)?)?;
    Ok((sql, session.preparing()))
}

/// Whether literals written as UTF-8 read as written on this session: not
/// when its client encoding was changed (a body's `SET client_encoding`),
/// where a multibyte character can swallow a quote's escape. Then nothing
/// rides: the call fails, and writes nothing.
fn literals_hold(wire: &Wire) -> QueryResult<()> {
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

/// `sql`, refused when a simple query cannot carry it: its text ends at
/// the first NUL (no value idem writes in has one; this keeps it so).
fn simple_query(sql: String) -> QueryResult<String> {
    if sql.contains('\0') {
        return Err(DieselError::SerializationError(
            "idem: a statement sent with BEGIN or COMMIT contains a NUL character".into(),
        ));
    }
    Ok(sql)
}

/// The rows a capture kept, as a query's result.
pub(super) fn captured(rows: Option<Result<Vec<Row>, MalformedRow>>) -> QueryResult<Vec<Row>> {
    match rows {
        Some(Ok(rows)) => Ok(rows),
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
        let (sql, preparing) =
            ride_text(&wire, |session| last.sql(session)).map_err(Closing::Failed)?;
        wire.ride(Some(sql.into_bytes()), last.returns_rows(), preparing);
        let committed = self.send_commit(timeout).await;
        let rows = wire.unride().and_then(Result::ok);
        match committed {
            Ok(()) => Ok(last.read(rows)),
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
            Err(failure) => Err(Closing::Commit(failure)),
        }
    }

    /// Run `first` on the open transaction, as one simple query of its own.
    pub(crate) async fn run<O: Opening>(&mut self, first: &O) -> QueryResult<O::Output> {
        let wire = self.wire_arc();
        let (sql, preparing) = ride_text(&wire, |session| first.sql(session))?;
        wire.ride(None, true, preparing);
        let mut shared: &AsyncPgConnection = self.conn();
        let ran = shared.batch_execute(&sql).await;
        let rows = wire.unride();
        ran?;
        first.read(captured(rows)?)
    }
}
