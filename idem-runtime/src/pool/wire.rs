//! What the server says of a connection's transaction, read as its bytes go
//! by.
//!
//! PostgreSQL tells its client after every request how the transaction
//! stands: each `ReadyForQuery` carries the transaction status (idle, in a
//! transaction, in a failed transaction), each `ErrorResponse` its SQLSTATE,
//! and the `CommandComplete` of a `COMMIT` that the server turned into a
//! rollback says `ROLLBACK`. diesel's instrumentation cannot be relied on for
//! any of it: diesel-async reports a statement that returns rows as finished
//! before its execution error arrives through the row stream, so a body that
//! swallowed such an error (a lock timeout met by `get_result`, say) would
//! look clean. The server's own answers cannot be missed that way, whatever
//! diesel call ran the statement, and reading them adds nothing to the wire.
//!
//! Frontend messages are read too, only to know when each request was sent:
//! a failed statement's running time (see [`crate::cause::from_sqlstate`])
//! is counted from when it could start, its request's send or the previous
//! answer, whichever is later.
//!
//! One thing the wire writes itself: local mode's statements, which ride on
//! diesel-async's `BEGIN` and `COMMIT` by replacing their simple query with
//! the same statements and idem's in the extended protocol, and taking out
//! of the answer what tokio-postgres would not expect of a simple query
//! ([`ride`]).
//!
//! The observer sits in the connection's stream through tokio-postgres's one
//! hook for wrapping it, its TLS connector, with the connection asking for
//! "direct" TLS negotiation ([`Observe`]): no `SSLRequest` is sent, the
//! "handshake" passes the socket through, and the startup message goes out
//! as it would on a plain connection (which is what the server sees: a plain
//! connection). A URL that asks for real TLS (`sslmode=require`) is refused
//! rather than silently downgraded (see [`crate::pool`]).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::task::Waker;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::cause::{from_sqlstate, Bounds, RetryCause, Said};

mod cut;
mod frame;
mod reported;
mod ride;
mod says;
mod seal;
mod stop;
mod stream;
mod unanswered;

pub(crate) use ride::{Answer, MalformedRow, Row};
use says::Says;
pub(crate) use stream::Observe;
#[cfg(test)]
use stream::Observed;

/// How a connection's transaction stands, as the server last said.
#[derive(Debug, Default)]
pub(crate) struct Wire {
    state: Mutex<State>,
    /// Woken at every `ReadyForQuery`, and when the socket ends.
    answered: Notify,
    /// Something rides on the next request ([`Wire::ride`]): the cheap test
    /// that keeps the stream's common path from taking the lock for it.
    riding: AtomicBool,
    /// The transaction [`Wire::guard`] watches has ended or another begun:
    /// nothing more is written (see there).
    sealed: AtomicBool,
    /// A transaction is guarded (see [`Wire::guard`]).
    guarded: AtomicBool,
    /// Closed from outside its driver ([`Wire::sever`]): nothing more is
    /// read or written.
    severed: AtomicBool,
    /// Who waits for the socket to be readable, to be woken by a sever.
    reader: Mutex<Option<Waker>>,
    /// Held by the stream through each write and its count in `state`
    /// (see [`Wire::sever`]).
    writing: Mutex<()>,
    /// The connection keeps its session's prepared statements (not behind a
    /// transaction pooler).
    session_statements: bool,
    /// Cancels a statement running behind the body's end (see [`stop`]).
    stopper: stop::Stopper,
}

/// Counts of transaction control on a connection: compared before and after
/// a body, they tell whether the body ended (or began) a transaction itself.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Marks {
    /// `ReadyForQuery` with status idle: no transaction open.
    idles: u64,
    /// `COMMIT` (`AND CHAIN` too) and `PREPARE TRANSACTION` completed: a
    /// transaction's writes kept, or handed to a two-phase commit; and
    /// requests in which a statement ran outside a transaction block (after
    /// a body's own `ROLLBACK`, say), which committed on its own.
    commits: u64,
    /// `BEGIN` and `START TRANSACTION` completed, and `ROLLBACK AND CHAIN`
    /// (which begins the next transaction in the same statement).
    begins: u64,
}

impl Marks {
    /// Since `earlier`, a transaction ended or began (`Some`), and whether one
    /// was committed or prepared (`Some(true)`).
    pub(crate) fn since(self, earlier: Marks) -> Option<bool> {
        let ended = self.idles > earlier.idles || self.begins > earlier.begins;
        let committed = self.commits > earlier.commits;
        (ended || committed).then_some(committed)
    }

    /// The marks as they stood before the answer to a lone `ROLLBACK` that
    /// was the last request answered: it counts one idle status, and
    /// nothing else, whether a transaction was open or not.
    pub(crate) fn before_a_lone_rollback(self) -> Marks {
        Marks {
            idles: self.idles.saturating_sub(1),
            ..self
        }
    }
}

/// A statement the server refused: its SQLSTATE, what else the server
/// said of it, and how long it ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Refusal {
    pub(crate) code: [u8; 5],
    pub(crate) said: Said,
    pub(crate) ran: Duration,
}

impl Refusal {
    /// What it means for its transaction under the loop's `bounds` (see
    /// [`from_sqlstate`]).
    pub(crate) fn cause(self, bounds: Option<Bounds>) -> Option<RetryCause> {
        from_sqlstate(&self.code, self.said, self.ran, bounds)
    }
}

/// A request sent and not yet answered (a `Query` or a `Sync` ends one,
/// and each is answered by one `ReadyForQuery`).
#[derive(Debug, Clone, Copy)]
struct Sent {
    /// When its write began.
    at: Instant,
    /// Whether a statement it runs names `CHAIN` (see [`Wire::on_ready`]).
    chained: bool,
    /// Whether a statement it runs may commit (see
    /// [`Wire::unanswered_may_commit`]).
    commit: bool,
    /// Whether its end itself may commit: a `COMMIT` (or `END`, `PREPARE`)
    /// the seal's refusal waits for up to its bound (see [`stop`]).
    commit_end: bool,
    /// Whether a statement it runs ends the transaction (see
    /// [`Wire::guard`]).
    ends: bool,
    /// Whether it runs nothing but `ROLLBACK`s: it writes nothing, even
    /// outside a transaction.
    rollback_only: bool,
}

#[derive(Debug, Default)]
struct State {
    /// The status of the last `ReadyForQuery`: `I`, `T` or `E`; 0 before it.
    status: u8,
    /// `CommandComplete` messages tagged `ROLLBACK` so far.
    rollbacks: u64,
    /// Transaction control seen so far, to tell a transaction that a body
    /// ended or began itself (see [`Marks`]).
    marks: Marks,
    /// The socket ended or failed.
    closed: bool,
    /// Statements completing now run outside a transaction block, each in
    /// a transaction of its own that commits: after an idle
    /// `ReadyForQuery`, or a `COMMIT` or `ROLLBACK` in the same request.
    outside: bool,
    /// A statement completed outside a transaction block in the request
    /// being answered (counted in [`Marks`] once it ends outside one).
    autocommitted: bool,
    /// The refusal that made the transaction a failed one, until a rollback
    /// to a savepoint (status `T` again) or the next transaction undoes it.
    abort: Option<Refusal>,
    /// The refusal of the request being answered, until its `ReadyForQuery`.
    pending: Option<Refusal>,
    /// Every refusal of the current (or just ended) transaction, those a
    /// rollback to a savepoint undid included (rarely more than one).
    refusals: Vec<Refusal>,
    /// The requests not yet answered, in order.
    sent: VecDeque<Sent>,
    /// A `ROLLBACK` tag in the request being answered.
    rolled_back: bool,
    /// The request being answered is a `COPY .. FROM STDIN` waiting for
    /// data the client has not sent (see [`Wire::unanswered_may_commit`]).
    copy_in: bool,
    /// `ReadyForQuery` messages so far: which request is being answered.
    answers: u64,
    /// The wait of a write the seal refused (see [`stop`]).
    waits: stop::Waits,
    /// When the last `ReadyForQuery` arrived.
    answered: Option<Instant>,
    /// What rides on the next request.
    ride: ride::Ride,
    /// idem's statements prepared on this session (`crate::tx`'s prepared
    /// statements), once the server answered their `Parse`.
    prepared: Vec<&'static str>,
    /// Bumped whenever the session may have lost some of them: their names
    /// carry it, so that preparing them again never meets one left over.
    generation: u32,
    /// Refusals so far that said one of idem's statements was lost
    /// ([`loses_statements`]).
    losses: u64,
    /// What the server reported of the session unasked: its key, and
    /// parameters whose change would poison it for idem.
    reported: reported::Reported,
    /// The transaction control when a body was handed the connection
    /// ([`Wire::guard`]).
    guard: Option<Marks>,
    /// The seal refused a write ([`Wire::withheld`]).
    withheld: bool,
    /// What it refused was idem's own `COMMIT`, alone.
    withheld_commit: bool,
    /// Ride units written so far ([`Wire::units_sent`]).
    units: u64,
}

/// SQLSTATE `invalid_sql_statement_name`: a `Bind` (or `EXECUTE`) of a
/// statement the session does not hold.
const MISSING_STATEMENT: &[u8; 5] = b"26000";

/// SQLSTATE `duplicate_prepared_statement`: a `Parse` (or `PREPARE`) of a
/// name the session holds already.
const TAKEN_STATEMENT: &[u8; 5] = b"42P05";

/// Whether a refusal with SQLSTATE `code` means a prepared statement of
/// idem's is gone unseen (dropped inside a function, or a transaction pooler
/// between client and server) or one of its names was taken by the
/// application's own: the session's statements are prepared again, under
/// new names.
pub(crate) fn loses_statements(code: &[u8; 5]) -> bool {
    code == MISSING_STATEMENT || code == TAKEN_STATEMENT
}

impl State {
    fn forget_prepared(&mut self) {
        self.prepared.clear();
        self.generation += 1;
    }
}

impl Wire {
    /// The wire of a new connection; `session_statements`: it keeps its
    /// session's prepared statements (no transaction pooler in between).
    pub(crate) fn new(session_statements: bool) -> Wire {
        Wire {
            session_statements,
            ..Wire::default()
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Its `COMMIT` cannot commit: the transaction failed, or the
    /// connection is gone (before `COMMIT` was sent, so nothing committed).
    pub(crate) fn unfinished(&self) -> bool {
        let state = self.state();
        state.status == b'E' || state.closed
    }

    /// The refusal that failed the current (or just ended) transaction.
    pub(crate) fn abort(&self) -> Option<Refusal> {
        self.state().abort
    }

    /// Replace the next `Query` message written, whose text must be
    /// `query`, with `unit` (extended-protocol messages ended by a `Sync`),
    /// and keep the rows of each of its statements (see [`ride`]). Armed
    /// before the request is sent; [`Wire::unride`] ends it.
    ///
    /// `parses`: one per `Parse` in `unit`, in order: the statement it
    /// prepares under its name, counted prepared once the server answers it.
    pub(crate) fn ride(&self, query: Vec<u8>, unit: Vec<u8>, parses: Vec<Option<&'static str>>) {
        self.state().ride.arm(query, unit, parses);
        self.riding.store(true, Ordering::Release);
    }

    /// How many ride units were written so far (see [`Wire::ride`]): one
    /// more once idem's `COMMIT`, with what rides on it, went out.
    pub(crate) fn units_sent(&self) -> u64 {
        self.state().units
    }

    /// Whether the connection keeps its session's prepared statements.
    pub(crate) fn keeps_session_statements(&self) -> bool {
        self.session_statements
    }

    /// Whether idem's statement `name` is prepared on this session, and
    /// the generation its name carries (see [`crate::tx`]'s prepared
    /// statements).
    pub(crate) fn prepared(&self, name: &str) -> (bool, u32) {
        let state = self.state();
        (state.prepared.contains(&name), state.generation)
    }

    /// Whether the ride was refused because diesel-async sent `RELEASE
    /// SAVEPOINT` where its `COMMIT` belonged (a savepoint the body left
    /// open); read before [`Wire::unride`].
    pub(crate) fn released_savepoint(&self) -> bool {
        self.state().ride.released()
    }

    /// Stop riding; the rows of each statement of the unit, once it was
    /// answered.
    pub(crate) fn unride(&self) -> Option<Result<Vec<Answer>, MalformedRow>> {
        let rows = self.state().ride.disarm();
        self.riding.store(false, Ordering::Release);
        rows
    }

    /// As a `DEALLOCATE` seen on the wire does.
    #[cfg(test)]
    pub(crate) fn forget_prepared_for_test(&self) {
        self.on_complete(b"DEALLOCATE ALL");
    }

    /// The session's client encoding, when it is not UTF8: values written
    /// as UTF-8 are then read in another encoding.
    pub(crate) fn foreign_encoding(&self) -> Option<String> {
        self.state().reported.foreign_encoding()
    }

    /// The backend's process id and secret, as the server gave them at
    /// start-up: what names the server session this wire watches.
    pub(crate) fn backend_key(&self) -> Option<[u8; 8]> {
        self.state().reported.key()
    }

    /// Session state committed since start-up that would refuse idem's
    /// statements on later calls (a read-only default, another session
    /// user), said for a log line (see [`reported`]).
    pub(crate) fn session_drift(&self) -> Option<String> {
        self.state().reported.drift()
    }

    fn on_parameter(&self, body: &[u8]) {
        self.state().reported.on_parameter(body);
    }

    fn on_key(&self, body: &[u8]) {
        self.state().reported.on_key(body);
    }

    fn riding(&self) -> bool {
        self.riding.load(Ordering::Acquire)
    }

    /// How many refusals so far said a prepared statement was lost or its
    /// name taken ([`loses_statements`]).
    pub(crate) fn losses(&self) -> u64 {
        self.state().losses
    }

    /// The refusal of the request still being answered, if any.
    pub(crate) fn pending(&self) -> Option<Refusal> {
        self.state().pending
    }

    /// How many `COMMIT`s and `ROLLBACK`s ended as a rollback so far.
    pub(crate) fn rollbacks(&self) -> u64 {
        self.state().rollbacks
    }

    /// The transaction control seen so far.
    pub(crate) fn marks(&self) -> Marks {
        self.state().marks
    }

    /// The socket ended or failed.
    pub(crate) fn closed(&self) -> bool {
        self.state().closed
    }

    /// Idle, with every request answered: safe to hand out again. Answers
    /// still on their way get up to `settle` to arrive.
    pub(crate) async fn idle(&self, settle: Duration) -> bool {
        self.settled(settle).await && {
            let state = self.state();
            state.status == b'I' && !state.closed
        }
    }

    /// Whether the server last said a transaction block is open (status `T`
    /// or `E`).
    pub(crate) fn in_block(&self) -> bool {
        matches!(self.state().status, b'T' | b'E')
    }

    /// `requests` were written; `rewritten`: they are a ride's unit.
    ///
    /// `at`: when their write began. Taken before the write, never after:
    /// a thread preempted between the write and the clock would date the
    /// requests late, and a lock timeout that ran its full bound would look
    /// shorter than the loop's own (see [`crate::cause::from_sqlstate`]).
    fn on_sent(&self, requests: &[Says], rewritten: bool, at: Instant) {
        let mut state = self.state();
        if rewritten {
            let ahead = state.sent.len();
            state.ride.on_written(ahead);
            state.units += 1;
        }
        state.sent.extend(requests.iter().map(|says| Sent {
            at,
            chained: says.chain,
            commit: says.commit,
            commit_end: says.commit_end,
            ends: says.ends,
            rollback_only: says.rollback_only,
        }));
        // An end sent seals at once: what is written behind it, before its
        // answer, would run outside the transaction.
        if state.guard.is_some() {
            self.reseal(&state);
        }
    }

    fn on_error(&self, code: [u8; 5], said: Said) {
        let fatal = said.fatal;
        let now = Instant::now();
        let mut state = self.state();
        // The server ends the session after a FATAL error (a terminated
        // backend, a shutdown): nothing sent after it runs, so the
        // transaction is over, before the socket's end is even read.
        state.closed |= fatal;
        // What ran outside a block in this request shares its implicit
        // transaction with the statement that failed: rolled back with it
        // (one an explicit `COMMIT` ended first is counted at its tag).
        state.autocommitted = false;
        if loses_statements(&code) {
            state.forget_prepared();
            state.losses += 1;
        }
        let started = match (state.sent.front().map(|s| s.at), state.answered) {
            (Some(sent), Some(answered)) => sent.max(answered),
            (sent, answered) => sent.or(answered).unwrap_or(now),
        };
        if state.pending.is_none() {
            state.pending = Some(Refusal {
                code,
                said,
                ran: now.saturating_duration_since(started),
            });
        }
    }

    /// Every refusal of the current (or just ended) transaction.
    pub(crate) fn refusals(&self) -> Vec<Refusal> {
        self.state().refusals.clone()
    }

    /// Whether the current (or just ended) transaction failed, and was not
    /// undone to a savepoint, for the session's rights or as read-only
    /// (`42501`, `25006`): what a session state a body committed and the
    /// server does not report (`SET ROLE`) looks like from here. A refusal
    /// a savepoint undid, in a transaction that went on, does not count.
    pub(crate) fn refused_for_session(&self) -> bool {
        let session = |r: Refusal| matches!(&r.code, b"42501" | b"25006");
        self.state().abort.is_some_and(session)
    }

    fn on_ready(&self, status: u8) {
        let mut state = self.state();
        // `ROLLBACK AND CHAIN` ends the transaction and begins another in
        // one statement, with `ROLLBACK TO SAVEPOINT`'s tag and no idle
        // status between: told apart by its text, it counts as a begin.
        let chained = state.sent.pop_front().is_some_and(|s| s.chained);
        state.answers += 1;
        state.copy_in = false;
        if std::mem::take(&mut state.rolled_back) && chained && status != b'I' {
            state.marks.begins += 1;
        }
        state.ride.on_ready();
        state.answered = Some(Instant::now());
        if state.status == b'I' && status != b'I' {
            state.refusals.clear();
        }
        let pending = state.pending.take();
        if let Some(refusal) = pending {
            state.refusals.push(refusal);
        }
        match status {
            b'E' if state.status != b'E' => state.abort = pending,
            b'T' => state.abort = None,
            _ => {}
        }
        state.status = status;
        state.marks.idles += u64::from(status == b'I');
        // `ROLLBACK TO SAVEPOINT` has `ROLLBACK`'s tag: a statement after
        // one counts only if the request ended outside a block (then one
        // after a real end may have committed; at worst it was a read).
        if std::mem::take(&mut state.autocommitted) && status == b'I' {
            state.marks.commits += 1;
        }
        state.outside = status == b'I';
        if state.guard.is_some() {
            self.reseal(&state);
        }
        drop(state);
        self.answered.notify_waiters();
    }

    /// A `CopyInResponse`: the server waits for the request's data.
    fn on_copy_in(&self) {
        self.state().copy_in = true;
    }

    fn on_complete(&self, tag: &[u8]) {
        let mut state = self.state();
        state.ride.on_complete(tag);
        if tag.starts_with(b"DEALLOCATE") || tag == b"DISCARD ALL" {
            // Someone else's: any of idem's statements may be gone (the tag
            // does not say which), so all are prepared again, under new
            // names, since some may still be there.
            state.forget_prepared();
        }
        match tag {
            b"ROLLBACK" => {
                // It rolls back the implicit transaction of what ran outside
                // a block before it in the request (a `ROLLBACK TO
                // SAVEPOINT` in an explicit one: a `COMMIT` tag after it
                // counts that).
                state.autocommitted = false;
                state.rollbacks += 1;
                state.outside = true;
                state.rolled_back = true;
            }
            b"COMMIT" | b"PREPARE TRANSACTION" => {
                state.marks.commits += 1;
                state.outside = true;
            }
            b"BEGIN" | b"START TRANSACTION" => {
                state.marks.begins += 1;
                state.outside = false;
            }
            _ => state.autocommitted |= state.outside,
        }
    }

    /// A `ParseComplete`: one of idem's statements may now be prepared.
    fn on_parsed(&self) {
        if self.riding() {
            let mut state = self.state();
            if let Some(name) = state.ride.on_parsed() {
                state.prepared.push(name);
            }
        }
    }

    /// Whether a message of type `kind`, about to be read, is taken out of
    /// what tokio-postgres reads: an answer only the extended protocol
    /// gives, to a unit that replaced a simple query.
    fn strips(&self, kind: u8) -> bool {
        matches!(kind, b'1' | b'2') && self.riding() && self.state().ride.answering()
    }

    /// A `Query` whose text is `text` is about to be written: the unit that
    /// replaces it, if one waits (see [`Wire::ride`]).
    fn take_unit(&self, text: &[u8]) -> Option<Result<Vec<u8>, ride::Mismatch>> {
        self.state().ride.take_unit(text)
    }

    /// Whether a unit waits for its `Query`.
    fn unit_waits(&self) -> bool {
        self.state().ride.waits()
    }

    fn on_row(&self, body: &[u8]) {
        if self.riding() {
            self.state().ride.on_row(body);
        }
    }

    /// Whether `DataRow` bodies are to be kept whole, for a capture.
    fn keeps_rows(&self) -> bool {
        self.riding() && self.state().ride.capturing()
    }

    fn on_closed(&self) {
        self.state().closed = true;
        self.answered.notify_waiters();
    }
}

#[cfg(test)]
mod tests;
