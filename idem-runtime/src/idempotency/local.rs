//! Local mode's statements as they ride on its transaction's `BEGIN` and
//! `COMMIT` (see [`crate::tx`]): the advisory lock and the read of the
//! record with `BEGIN`, the completed record with `COMMIT`. A new key costs
//! no round trip more than the body's own, a replay one (`BEGIN`, answered
//! with the record, then `ROLLBACK`).

use diesel::result::Error as DieselError;
use diesel::QueryResult;

use super::request::{Request, Stored};
use super::store::{Complete, Outcome, LOCK, READ_TEXT};
use crate::pool::Row;
use crate::sql::{from_hex, micros};
use crate::tx::{Last, Opening, Session};

/// The advisory lock and the read of a local request's record ([`LOCK`],
/// [`READ_TEXT`], prepared once per session). The lock comes first: the
/// read, a later statement, sees a record a duplicate committed while this
/// one waited (READ COMMITTED; under a snapshot isolation [`Complete`] finds
/// it instead).
pub(crate) struct LockAndRead<'r>(&'r Request);

impl<'r> LockAndRead<'r> {
    pub(super) fn new(request: &'r Request) -> Self {
        LockAndRead(request)
    }
}

impl Opening for LockAndRead<'_> {
    type Output = Option<Stored>;

    fn write(&self, session: &mut Session<'_>) -> QueryResult<()> {
        let request = self.0;
        let lock_key = request.lock_key().to_string();
        session.call(&LOCK, &[Some(lock_key.as_bytes())])?;
        session.call(
            &READ_TEXT,
            &[
                Some(request.scope().as_bytes()),
                Some(request.key().as_bytes()),
            ],
        )
    }

    /// The rows of the lock, then of the read.
    fn read(&self, results: Vec<Vec<Row>>) -> QueryResult<Option<Stored>> {
        let [_lock, rows]: [Vec<Row>; 2] = results
            .try_into()
            .map_err(|_| unreadable("not the answers of two statements"))?;
        let mut rows = rows.into_iter();
        let stored = rows.next().map(stored_from_text).transpose()?;
        match rows.next() {
            None => Ok(stored),
            Some(_) => Err(unreadable("more than one record of a key")),
        }
    }
}

/// A local request's completed record, to send with `COMMIT`. It writes its
/// row or fails (see [`Complete`]); with `returning`, the response comes back
/// as stored (for a replay cache).
pub(crate) struct Completing<'a> {
    request: &'a Request,
    outcome: Outcome,
    response: &'a serde_json::Value,
    /// The read found an expired record to take over (see [`Complete`]).
    takeover: bool,
    returning: bool,
}

impl<'a> Completing<'a> {
    pub(super) fn new(
        request: &'a Request,
        outcome: Outcome,
        response: &'a serde_json::Value,
        takeover: bool,
        returning: bool,
    ) -> Self {
        Completing {
            request,
            outcome,
            response,
            takeover,
            returning,
        }
    }
}

impl Last for Completing<'_> {
    type Output = Option<serde_json::Value>;

    fn write(&self, session: &mut Session<'_>) -> QueryResult<()> {
        Complete {
            identity: self.request.identity(),
            outcome: self.outcome,
            response: self.response,
            ttl_micros: micros(self.request.config.ttl),
            takeover: self.takeover,
            returning: self.returning,
        }
        .write(session)
    }

    /// An `INSERT` of one row, or a takeover (`ON CONFLICT .. DO UPDATE`
    /// reports the row it updated as inserted).
    fn wrote(&self, tag: &[u8]) -> bool {
        tag == b"INSERT 0 1"
    }

    /// The response as stored; none when it cannot be read, which only
    /// leaves the cache unfilled (the record is committed either way).
    fn read(&self, rows: Option<Vec<Row>>) -> Option<serde_json::Value> {
        let text = rows?.into_iter().next()?.into_iter().next()??;
        serde_json::from_slice(&text).ok()
    }
}

fn unreadable(what: &str) -> DieselError {
    DieselError::DeserializationError(format!("idem: the record read with BEGIN: {what}").into())
}

/// A row of [`READ_TEXT`].
fn stored_from_text(row: Row) -> QueryResult<Stored> {
    let [operation, fingerprint, state, outcome, response, lease_expired, expired, owner, remaining_ms]: [Option<Vec<u8>>; 9] =
        row.try_into().map_err(|_| unreadable("not nine columns"))?;
    Ok(Stored {
        operation: text(operation)?,
        fingerprint: hex(fingerprint)?,
        state: text(state)?,
        outcome: outcome.map(|v| text(Some(v))).transpose()?,
        response: response
            .map(|v| serde_json::from_slice(&v).map_err(|e| unreadable(&e.to_string())))
            .transpose()?,
        lease_expired: lease_expired.map(|v| boolean(Some(v))).transpose()?,
        expired: boolean(expired)?,
        owner: owner.map(|v| hex(Some(v))).transpose()?,
        remaining_ms: text(remaining_ms)?
            .parse()
            .map_err(|_| unreadable("remaining_ms"))?,
    })
}

fn text(value: Option<Vec<u8>>) -> QueryResult<String> {
    String::from_utf8(value.ok_or_else(|| unreadable("a NULL where a value belongs"))?)
        .map_err(|_| unreadable("text that is not UTF-8"))
}

fn hex(value: Option<Vec<u8>>) -> QueryResult<Vec<u8>> {
    from_hex(&value.ok_or_else(|| unreadable("a NULL where bytes belong"))?)
        .ok_or_else(|| unreadable("bytes not in hex"))
}

fn boolean(value: Option<Vec<u8>>) -> QueryResult<bool> {
    match value.as_deref() {
        Some(b"t") => Ok(true),
        Some(b"f") => Ok(false),
        _ => Err(unreadable("a boolean other than t or f")),
    }
}
