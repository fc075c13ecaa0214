//! Statements that ride on a request idem does not write itself: its own
//! statements sent in the same message as diesel-async's `BEGIN` and
//! `COMMIT`, so that they cost no round trip of their own.
//!
//! diesel-async must send both itself, through its transaction manager's
//! supported hooks, so that it counts the transaction (a `conn.transaction(..)`
//! in a body then becomes a savepoint). Each is one simple query:
//!
//! - `BEGIN` takes its SQL from the caller (`begin_transaction_sql`), so what
//!   rides on it is written into that text. tokio-postgres reads past the
//!   rows a simple query returns; the wire keeps those of the request it was
//!   told to capture ([`Ride::arm`]), for the caller to read once `BEGIN` is
//!   answered.
//! - `COMMIT` is a fixed text. The wire writes the riding statements in front
//!   of it, in the same `Query` message, when that message goes out: the
//!   server runs them, then `COMMIT`, in one transaction and one round trip.
//!   If one fails, the transaction fails there, and `COMMIT` is never run.
//!   A prefix that meets anything but a `Query` at a message boundary fails
//!   the write instead: the connection breaks before `COMMIT` is sent, so the
//!   transaction cannot commit without what was to ride on it.

/// One row of a captured result, each column in PostgreSQL's text form
/// (`None`: NULL).
pub(crate) type Row = Vec<Option<Vec<u8>>>;

/// What rides on a connection's next request.
#[derive(Debug, Default)]
pub(super) struct Ride {
    /// Written in front of the next `Query` message's text.
    prefix: Option<Vec<u8>>,
    capture: Capture,
    /// The rows of the captured request's last result so far.
    rows: Vec<Row>,
    /// The captured request was answered.
    done: bool,
    /// A captured row could not be read.
    malformed: bool,
    /// The statements whose `PREPARE` rides, in order, not yet answered.
    preparing: std::collections::VecDeque<&'static str>,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum Capture {
    #[default]
    Off,
    /// The next simple query written is the one to capture.
    Next,
    /// It is written; this many requests are answered before it.
    Ahead(usize),
}

impl Ride {
    /// Ride `prefix` on the next `Query` written, and capture the rows of
    /// the next request's last result when `capture`.
    pub(super) fn arm(
        &mut self,
        prefix: Option<Vec<u8>>,
        capture: bool,
        preparing: Vec<&'static str>,
    ) {
        *self = Ride {
            prefix,
            capture: if capture { Capture::Next } else { Capture::Off },
            preparing: preparing.into(),
            ..Ride::default()
        };
    }

    /// A `PREPARE` was answered: the riding statement it prepared, if it was
    /// one (they are answered in the order they were written).
    pub(super) fn on_prepared(&mut self) -> Option<&'static str> {
        self.preparing.pop_front()
    }

    /// Stop riding; the captured rows, when the request was answered (an
    /// error when one of them could not be read).
    pub(super) fn disarm(&mut self) -> Option<Result<Vec<Row>, MalformedRow>> {
        let ride = std::mem::take(self);
        match (ride.done, ride.malformed) {
            (false, _) => None,
            (true, false) => Some(Ok(ride.rows)),
            (true, true) => Some(Err(MalformedRow)),
        }
    }

    /// Whether a prefix waits for the next `Query`.
    pub(super) fn has_prefix(&self) -> bool {
        self.prefix.is_some()
    }

    /// The prefix to write in front of the next `Query`, taken.
    pub(super) fn take_prefix(&mut self) -> Option<Vec<u8>> {
        self.prefix.take()
    }

    /// Rows are being captured (or will be): `DataRow` bodies are to be kept.
    pub(super) fn capturing(&self) -> bool {
        self.capture != Capture::Off
    }

    /// A simple query was written, with `ahead` requests (each ended by a
    /// `Query` or a `Sync`) to be answered before it. What rides is always
    /// a simple query (`BEGIN`'s, `COMMIT`'s): a `Sync` written with it (of
    /// a `Close` of a statement diesel-async dropped, say) is not it.
    pub(super) fn on_query(&mut self, ahead: usize) {
        if self.capture == Capture::Next {
            self.capture = Capture::Ahead(ahead);
        }
    }

    /// A `RowDescription`: a new result begins; only the last is kept.
    pub(super) fn on_description(&mut self) {
        if self.capture == Capture::Ahead(0) {
            self.rows.clear();
        }
    }

    /// A `DataRow` and its body.
    pub(super) fn on_row(&mut self, body: &[u8]) {
        if self.capture == Capture::Ahead(0) {
            match parse_row(body) {
                Some(row) => self.rows.push(row),
                None => self.malformed = true,
            }
        }
    }

    /// A `ReadyForQuery`: the request in front was answered.
    pub(super) fn on_ready(&mut self) {
        match self.capture {
            Capture::Ahead(0) => {
                self.capture = Capture::Off;
                self.done = true;
            }
            Capture::Ahead(n) => self.capture = Capture::Ahead(n - 1),
            Capture::Off | Capture::Next => {}
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

/// The `Query` message whose text is `prefix`, then `; `, then the text of
/// the `Query` whose body (its text and the closing NUL) is `original`.
pub(super) fn prefixed(prefix: &[u8], original: &[u8]) -> Vec<u8> {
    let body_len = prefix.len() + 2 + original.len();
    let mut message = Vec::with_capacity(1 + 4 + body_len);
    message.push(b'Q');
    message.extend_from_slice(&((body_len + 4) as u32).to_be_bytes());
    message.extend_from_slice(prefix);
    message.extend_from_slice(b"; ");
    message.extend_from_slice(original);
    message
}
