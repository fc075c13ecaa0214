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
//! The observer sits in the connection's stream through tokio-postgres's one
//! hook for wrapping it, its TLS connector, with the connection asking for
//! "direct" TLS negotiation ([`Observe`]): no `SSLRequest` is sent, the
//! "handshake" passes the socket through, and the startup message goes out
//! as it would on a plain connection (which is what the server sees: a plain
//! connection). A URL that asks for real TLS (`sslmode=require`) is refused
//! rather than silently downgraded (see [`crate::pool`]).

use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect, TlsStream};
use tokio_postgres::Socket;

/// How a connection's transaction stands, as the server last said.
#[derive(Debug, Default)]
pub(crate) struct Wire {
    state: Mutex<State>,
    /// Woken at every `ReadyForQuery`, and when the socket ends.
    answered: Notify,
}

/// Counts of transaction control on a connection: compared before and after
/// a body, they tell whether the body ended (or began) a transaction itself.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Marks {
    /// `ReadyForQuery` with status idle: no transaction open.
    idles: u64,
    /// `COMMIT` (`AND CHAIN` too) and `PREPARE TRANSACTION` completed: a
    /// transaction's writes kept, or handed to a two-phase commit.
    commits: u64,
    /// `BEGIN` and `START TRANSACTION` completed.
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
}

/// A statement the server refused: its SQLSTATE, and how long it ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Refusal {
    pub(crate) code: [u8; 5],
    pub(crate) ran: Duration,
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
    /// The refusal that made the transaction a failed one, until a rollback
    /// to a savepoint (status `T` again) or the next transaction undoes it.
    abort: Option<Refusal>,
    /// The refusal of the request being answered, until its `ReadyForQuery`.
    pending: Option<Refusal>,
    /// Every refusal of the current (or just ended) transaction, those a
    /// rollback to a savepoint undid included (rarely more than one).
    refusals: Vec<Refusal>,
    /// When each request not yet answered was sent (a `Query` or a `Sync`
    /// ends one, and each is answered by one `ReadyForQuery`).
    sent: VecDeque<Instant>,
    /// When the last `ReadyForQuery` arrived.
    answered: Option<Instant>,
}

impl Wire {
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

    /// Wait up to `within` for every request sent to be answered (or the
    /// connection to end); false when one still runs then.
    pub(crate) async fn settled(&self, within: Duration) -> bool {
        let until = tokio::time::Instant::now() + within;
        loop {
            let answered = self.answered.notified();
            {
                let state = self.state();
                if state.closed || state.sent.is_empty() {
                    return true;
                }
            }
            if tokio::time::timeout_at(until, answered).await.is_err() {
                return false;
            }
        }
    }

    fn on_sent(&self, requests: usize) {
        let now = Instant::now();
        let mut state = self.state();
        state.sent.extend(std::iter::repeat_n(now, requests));
    }

    fn on_error(&self, code: [u8; 5], fatal: bool) {
        let now = Instant::now();
        let mut state = self.state();
        // The server ends the session after a FATAL error (a terminated
        // backend, a shutdown): nothing sent after it runs, so the
        // transaction is over, before the socket's end is even read.
        state.closed |= fatal;
        let started = match (state.sent.front().copied(), state.answered) {
            (Some(sent), Some(answered)) => sent.max(answered),
            (sent, answered) => sent.or(answered).unwrap_or(now),
        };
        if state.pending.is_none() {
            state.pending = Some(Refusal {
                code,
                ran: now.saturating_duration_since(started),
            });
        }
    }

    /// Every refusal of the current (or just ended) transaction.
    pub(crate) fn refusals(&self) -> Vec<Refusal> {
        self.state().refusals.clone()
    }

    fn on_ready(&self, status: u8) {
        let mut state = self.state();
        state.sent.pop_front();
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
        drop(state);
        self.answered.notify_waiters();
    }

    fn on_complete(&self, tag: &[u8]) {
        let mut state = self.state();
        match tag {
            b"ROLLBACK" => state.rollbacks += 1,
            b"COMMIT" | b"PREPARE TRANSACTION" => state.marks.commits += 1,
            b"BEGIN" | b"START TRANSACTION" => state.marks.begins += 1,
            _ => {}
        }
    }

    fn on_closed(&self) {
        self.state().closed = true;
        self.answered.notify_waiters();
    }
}

/// Longest message body kept to be read (`ErrorResponse` is the longest of
/// the three it reads; its SQLSTATE comes first in PostgreSQL's answers).
const KEPT: usize = 4096;

/// Splits a byte stream into protocol messages: a type byte (none for the
/// frontend's first, the startup message), a length that counts itself, a
/// body.
#[derive(Debug)]
struct Framer {
    header: [u8; 5],
    have: usize,
    /// The next message has no type byte.
    untyped: bool,
    left: usize,
    kind: u8,
    body: Vec<u8>,
    keep: fn(u8) -> bool,
}

impl Framer {
    fn new(untyped_first: bool, keep: fn(u8) -> bool) -> Framer {
        Framer {
            header: [0; 5],
            have: 0,
            untyped: untyped_first,
            left: 0,
            kind: 0,
            body: Vec::new(),
            keep,
        }
    }

    /// Feed `bytes`; `done` gets each whole message's type and kept body.
    fn feed(&mut self, mut bytes: &[u8], mut done: impl FnMut(u8, &[u8])) {
        while !bytes.is_empty() {
            if self.left == 0 && self.have < self.header_len() {
                let n = (self.header_len() - self.have).min(bytes.len());
                self.header[self.have..self.have + n].copy_from_slice(&bytes[..n]);
                self.have += n;
                bytes = &bytes[n..];
                if self.have < self.header_len() {
                    return;
                }
                let (kind, len) = if self.untyped {
                    (0, &self.header[..4])
                } else {
                    (self.header[0], &self.header[1..5])
                };
                let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize;
                self.kind = kind;
                self.left = len.saturating_sub(4);
                self.body.clear();
                if self.left == 0 {
                    self.finish(&mut done);
                }
                continue;
            }
            let n = self.left.min(bytes.len());
            if (self.keep)(self.kind) && self.body.len() < KEPT {
                let room = (KEPT - self.body.len()).min(n);
                self.body.extend_from_slice(&bytes[..room]);
            }
            self.left -= n;
            bytes = &bytes[n..];
            if self.left == 0 {
                self.finish(&mut done);
            }
        }
    }

    fn header_len(&self) -> usize {
        if self.untyped {
            4
        } else {
            5
        }
    }

    fn finish(&mut self, done: &mut impl FnMut(u8, &[u8])) {
        if !self.untyped {
            done(self.kind, &self.body);
        }
        self.untyped = false;
        self.have = 0;
    }
}

/// A field of an `ErrorResponse` body (fields: a type byte and a
/// NUL-terminated string each, then a NUL).
fn field(body: &[u8], wanted: u8) -> Option<&[u8]> {
    let mut rest = body;
    while let Some((&kind, tail)) = rest.split_first() {
        if kind == 0 {
            return None;
        }
        let end = tail.iter().position(|&b| b == 0)?;
        if kind == wanted {
            return Some(&tail[..end]);
        }
        rest = &tail[end + 1..];
    }
    None
}

/// The SQLSTATE of an `ErrorResponse` body.
fn sqlstate(body: &[u8]) -> Option<[u8; 5]> {
    field(body, b'C')?.try_into().ok()
}

/// Whether an `ErrorResponse` ends the session: its severity (`V`, never
/// translated; `S` before PostgreSQL 9.6) is FATAL or PANIC.
fn fatal(body: &[u8]) -> bool {
    let severity = field(body, b'V').or_else(|| field(body, b'S'));
    matches!(severity, Some(b"FATAL" | b"PANIC"))
}

/// A connection's stream, read and written through, with what it says
/// reported to its [`Wire`].
pub(crate) struct Observed<S> {
    inner: S,
    wire: Arc<Wire>,
    backend: Framer,
    frontend: Framer,
}

impl<S> Observed<S> {
    fn new(inner: S, wire: Arc<Wire>) -> Self {
        Observed {
            inner,
            wire,
            backend: Framer::new(false, |kind| matches!(kind, b'Z' | b'E' | b'C')),
            frontend: Framer::new(true, |_| false),
        }
    }

    fn read(&mut self, bytes: &[u8]) {
        let wire = &self.wire;
        self.backend.feed(bytes, |kind, body| match kind {
            b'Z' => wire.on_ready(body.first().copied().unwrap_or(0)),
            b'E' => wire.on_error(sqlstate(body).unwrap_or(*b"XX000"), fatal(body)),
            b'C' => wire.on_complete(body.strip_suffix(&[0]).unwrap_or(body)),
            _ => {}
        });
    }

    fn written(&mut self, bytes: &[u8]) {
        let mut requests = 0;
        self.frontend.feed(bytes, |kind, _| {
            if matches!(kind, b'Q' | b'S') {
                requests += 1;
            }
        });
        if requests > 0 {
            self.wire.on_sent(requests);
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Observed<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        match &polled {
            Poll::Ready(Ok(())) if buf.filled().len() == before => this.wire.on_closed(),
            Poll::Ready(Ok(())) => this.read(&buf.filled()[before..]),
            Poll::Ready(Err(_)) => this.wire.on_closed(),
            Poll::Pending => {}
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Observed<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_write(cx, buf);
        match &polled {
            Poll::Ready(Ok(n)) => this.written(&buf[..*n]),
            Poll::Ready(Err(_)) => this.wire.on_closed(),
            Poll::Pending => {}
        }
        polled
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> TlsStream for Observed<S> {
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}

/// The "TLS connector" that puts an [`Observed`] stream around a new
/// connection's socket and reports to `wire`.
#[derive(Clone)]
pub(crate) struct Observe(pub(crate) Arc<Wire>);

impl MakeTlsConnect<Socket> for Observe {
    type Stream = Observed<Socket>;
    type TlsConnect = Observe;
    type Error = io::Error;

    fn make_tls_connect(&mut self, _domain: &str) -> io::Result<Observe> {
        Ok(self.clone())
    }
}

impl TlsConnect<Socket> for Observe {
    type Stream = Observed<Socket>;
    type Error = io::Error;
    type Future = std::future::Ready<io::Result<Observed<Socket>>>;

    fn connect(self, stream: Socket) -> Self::Future {
        std::future::ready(Ok(Observed::new(stream, self.0)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(kind: u8, body: &[u8]) -> Vec<u8> {
        let mut m = vec![kind];
        m.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
        m.extend_from_slice(body);
        m
    }

    fn error(code: &[u8; 5]) -> Vec<u8> {
        let mut body = b"SERROR\0C".to_vec();
        body.extend_from_slice(code);
        body.extend_from_slice(b"\0Mboom\0\0");
        message(b'E', &body)
    }

    fn observed() -> Observed<()> {
        Observed::new((), Arc::new(Wire::default()))
    }

    #[test]
    fn a_failed_transaction_and_its_cause_are_read_one_byte_at_a_time() {
        let mut o = observed();
        let mut stream = message(b'Z', b"T");
        stream.extend(message(b'D', &[7; 300]));
        stream.extend(error(b"55P03"));
        stream.extend(message(b'Z', b"E"));
        // A later refusal in the failed transaction does not replace the cause.
        stream.extend(error(b"25P02"));
        stream.extend(message(b'Z', b"E"));
        for byte in stream.chunks(1) {
            o.read(byte);
        }
        assert!(o.wire.unfinished());
        assert_eq!(o.wire.abort().map(|r| r.code), Some(*b"55P03"));
        // COMMIT of a failed transaction: the server says ROLLBACK.
        o.read(&message(b'C', b"ROLLBACK\0"));
        o.read(&message(b'Z', b"I"));
        assert_eq!(o.wire.rollbacks(), 1);
        assert!(!o.wire.unfinished());
        // The cause is kept past the rollback, for the loop to read.
        assert_eq!(o.wire.abort().map(|r| r.code), Some(*b"55P03"));
    }

    #[test]
    fn a_rollback_to_a_savepoint_clears_the_failure() {
        let mut o = observed();
        o.read(&message(b'Z', b"T"));
        let mut stream = error(b"22012");
        stream.extend(message(b'Z', b"E"));
        stream.extend(message(b'C', b"ROLLBACK\0"));
        stream.extend(message(b'Z', b"T"));
        o.read(&stream);
        assert!(!o.wire.unfinished());
        assert_eq!(o.wire.abort(), None);
    }

    #[test]
    fn requests_are_counted_from_the_startup_message_on() {
        let mut o = observed();
        // Startup (untyped), then a Parse/Bind/Execute/Sync and a Query.
        let mut out = 12u32.to_be_bytes().to_vec();
        out.extend_from_slice(&[0, 3, 0, 0, 0, 0, 0, 0]);
        out.extend(message(b'P', b"\0SELECT 1\0\0\0"));
        out.extend(message(b'S', b""));
        out.extend(message(b'Q', b"COMMIT\0"));
        for chunk in out.chunks(3) {
            o.written(chunk);
        }
        assert_eq!(o.wire.state().sent.len(), 2);
        let still_owed = tokio::time::Duration::from_millis(1);
        o.read(&message(b'Z', b"T"));
        assert!(!block_on(o.wire.idle(still_owed)));
        o.read(&message(b'Z', b"I"));
        assert!(block_on(o.wire.idle(still_owed)));
    }

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap()
            .block_on(f)
    }

    #[test]
    fn transaction_control_is_counted() {
        let mut o = observed();
        o.read(&message(b'C', b"BEGIN\0"));
        o.read(&message(b'Z', b"T"));
        let begun = o.wire.marks();
        // A savepoint rolled back: no transaction ended.
        o.read(&message(b'C', b"ROLLBACK\0"));
        o.read(&message(b'Z', b"T"));
        assert_eq!(o.wire.marks().since(begun), None);
        // COMMIT AND CHAIN: committed, still in a transaction.
        o.read(&message(b'C', b"COMMIT\0"));
        o.read(&message(b'Z', b"T"));
        assert_eq!(o.wire.marks().since(begun), Some(true));
        // A ROLLBACK then a BEGIN in one simple query: ended, nothing kept.
        let before = o.wire.marks();
        o.read(&message(b'C', b"ROLLBACK\0"));
        o.read(&message(b'C', b"BEGIN\0"));
        o.read(&message(b'Z', b"T"));
        assert_eq!(o.wire.marks().since(before), Some(false));
        // Ended by the server: idle.
        let before = o.wire.marks();
        o.read(&message(b'Z', b"I"));
        assert_eq!(o.wire.marks().since(before), Some(false));
    }

    #[test]
    fn a_fatal_error_ends_the_connection() {
        let mut o = observed();
        o.read(&message(b'Z', b"T"));
        assert!(!o.wire.closed());
        o.read(&message(b'E', b"SFATAL\0VFATAL\0C57P01\0Mterminating\0\0"));
        assert!(o.wire.closed() && o.wire.unfinished());
        assert_eq!(o.wire.pending().map(|r| r.code), Some(*b"57P01"));
    }

    #[test]
    fn sqlstate_is_the_c_field() {
        assert_eq!(sqlstate(&error(b"40P01")[5..]), Some(*b"40P01"));
        assert_eq!(sqlstate(b"SERROR\0\0"), None);
        assert_eq!(sqlstate(b"Cabc"), None);
    }
}
