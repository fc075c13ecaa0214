//! Statements that ride on a request idem does not write itself: its own
//! statements sent in the same message as diesel-async's `BEGIN` and
//! `COMMIT`, so that they cost no round trip of their own.
//!
//! diesel-async must send both itself, through its transaction manager's
//! supported hooks, so that it counts the transaction (a `conn.transaction(..)`
//! in a body then becomes a savepoint). Each is one simple query, whose text
//! idem knows (it gives `BEGIN`'s, and `COMMIT`'s is fixed). The wire
//! replaces that `Query` message, as it goes out, with the same statements
//! in the extended protocol's messages and idem's own among them (see
//! `crate::tx`'s prepared statements): `BEGIN`'s first, then idem's; idem's,
//! then `COMMIT`. One `Sync` ends them, so the server answers them as one
//! request, and stops at the first that fails: a failed statement of idem's
//! leaves the transaction failed, and `COMMIT` never runs.
//!
//! tokio-postgres, which wrote a simple query, reads the answer as one: the
//! wire takes out what only the extended protocol answers (`ParseComplete`,
//! `BindComplete`), and keeps each statement's rows, which tokio-postgres
//! reads past, for idem to read once the request is answered. A `Query`
//! whose text is not the one expected, or that a write does not hold whole,
//! fails the write instead: the connection breaks before it is sent, so a
//! transaction cannot commit without what was to ride on its `COMMIT`.

use std::collections::VecDeque;

use super::says::Says;

/// One row of a captured result, each column in PostgreSQL's text form
/// (`None`: NULL).
pub(crate) type Row = Vec<Option<Vec<u8>>>;

/// One statement's answer in a ride's unit: its command tag and its rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Answer {
    pub(crate) tag: Vec<u8>,
    pub(crate) rows: Vec<Row>,
}

/// What rides on a connection's next request.
#[derive(Debug, Default)]
pub(super) struct Ride {
    /// The text of the `Query` to replace, and what replaces it (until it
    /// is written).
    query: Vec<u8>,
    unit: Option<Vec<u8>>,
    place: Place,
    /// Each statement answered so far, in order.
    results: Vec<Answer>,
    /// The rows of the statement being answered.
    rows: Vec<Row>,
    /// The replacing request was answered.
    done: bool,
    /// A captured row could not be read.
    malformed: bool,
    /// One per `Parse` in the unit, not yet answered: the statement it
    /// prepares under its name (none for an unnamed one).
    parses: VecDeque<Option<&'static str>>,
    /// The `Query` met instead of the one to replace was diesel-async's
    /// `RELEASE SAVEPOINT`: a savepoint the body left open made its
    /// `COMMIT` one.
    released: bool,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum Place {
    #[default]
    Off,
    /// Armed, not yet written.
    Next,
    /// Written; this many requests are answered before it.
    Ahead(usize),
}

/// The `Query` met was not the one to replace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Mismatch;

impl Ride {
    /// Replace the next `Query` (whose text must be `query`) with `unit`,
    /// whose `Parse` messages prepare `parses`.
    pub(super) fn arm(&mut self, query: Vec<u8>, unit: Vec<u8>, parses: Vec<Option<&'static str>>) {
        *self = Ride {
            query,
            unit: Some(unit),
            place: Place::Next,
            parses: parses.into(),
            ..Ride::default()
        };
    }

    /// Stop riding; each statement's answer, once the request was answered
    /// (an error when one of its rows could not be read).
    pub(super) fn disarm(&mut self) -> Option<Result<Vec<Answer>, MalformedRow>> {
        let ride = std::mem::take(self);
        match (ride.done, ride.malformed) {
            (false, _) => None,
            (true, false) => Some(Ok(ride.results)),
            (true, true) => Some(Err(MalformedRow)),
        }
    }

    /// Whether the `Query` met instead of the unit's was a `RELEASE
    /// SAVEPOINT` (see [`Ride::take_unit`]).
    pub(super) fn released(&self) -> bool {
        self.released
    }

    /// Whether a unit waits for its `Query`.
    pub(super) fn waits(&self) -> bool {
        self.unit.is_some()
    }

    /// A `Query` whose text is `text` is about to be written: the unit to
    /// write instead, if one waits.
    pub(super) fn take_unit(&mut self, text: &[u8]) -> Option<Result<Vec<u8>, Mismatch>> {
        self.unit.as_ref()?;
        // A body's own end, queued ahead of idem's `COMMIT`: it goes out as
        // it is, the unit waiting still, and the seal holds back what
        // follows it (see `Wire::guard`): what was to ride, with it.
        if text != self.query.as_slice() && Says::of(text).ends {
            return None;
        }
        if text != self.query.as_slice() {
            self.unit = None;
            self.released = text.starts_with(b"RELEASE SAVEPOINT ");
            return Some(Err(Mismatch));
        }
        self.unit.take().map(Ok)
    }

    /// Rows are being captured (or will be): `DataRow` bodies are to be kept.
    pub(super) fn capturing(&self) -> bool {
        self.place != Place::Off
    }

    /// The unit was written, with `ahead` requests (each ended by a `Query`
    /// or a `Sync`) to be answered before it.
    pub(super) fn on_written(&mut self, ahead: usize) {
        if self.place == Place::Next {
            self.place = Place::Ahead(ahead);
        }
    }

    /// Whether what the server sends now answers the unit.
    pub(super) fn answering(&self) -> bool {
        self.place == Place::Ahead(0)
    }

    /// A `ParseComplete`: the statement its `Parse` prepared, if it was one
    /// of the unit's (they are answered in the order they were written).
    pub(super) fn on_parsed(&mut self) -> Option<&'static str> {
        if self.answering() {
            self.parses.pop_front().flatten()
        } else {
            None
        }
    }

    /// A `DataRow` and its body.
    pub(super) fn on_row(&mut self, body: &[u8]) {
        if self.answering() {
            match parse_row(body) {
                Some(row) => self.rows.push(row),
                None => self.malformed = true,
            }
        }
    }

    /// A `CommandComplete` and its tag: a statement's rows are all in.
    pub(super) fn on_complete(&mut self, tag: &[u8]) {
        if self.answering() {
            let rows = std::mem::take(&mut self.rows);
            self.results.push(Answer {
                tag: tag.to_vec(),
                rows,
            });
        }
    }

    /// A `ReadyForQuery`: the request in front was answered.
    pub(super) fn on_ready(&mut self) {
        match self.place {
            Place::Ahead(0) => {
                self.place = Place::Off;
                self.done = true;
            }
            Place::Ahead(n) => self.place = Place::Ahead(n - 1),
            Place::Off | Place::Next => {}
        }
    }
}

/// A captured `DataRow` that does not parse (it never should: PostgreSQL
/// wrote it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MalformedRow;

/// A `DataRow` body: a column count, then each column's length (-1: NULL)
/// and bytes.
fn parse_row(body: &[u8]) -> Option<Row> {
    let count = u16::from_be_bytes(body.get(..2)?.try_into().ok()?);
    let mut rest = &body[2..];
    let mut row = Vec::with_capacity(count.into());
    for _ in 0..count {
        let len = i32::from_be_bytes(rest.get(..4)?.try_into().ok()?);
        rest = &rest[4..];
        if len < 0 {
            row.push(None);
            continue;
        }
        let len = len as usize;
        row.push(Some(rest.get(..len)?.to_vec()));
        rest = &rest[len..];
    }
    rest.is_empty().then_some(row)
}
