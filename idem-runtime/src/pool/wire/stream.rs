//! The stream in between: a connection's socket, read and written through,
//! with what passes reported to its [`Wire`]; local mode's statements
//! written in place of the simple query they ride on, and the answers only
//! they get taken out of what tokio-postgres reads (see
//! [`ride`](super::ride)).

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Instant;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect, TlsStream};
use tokio_postgres::Socket;

use super::frame::{bound, parsed, said, sqlstate, Framer, KEPT};
use super::says::Says;
use super::Wire;

/// A connection's stream, read and written through, with what it says
/// reported to its [`Wire`].
pub(crate) struct Observed<S> {
    pub(super) inner: S,
    pub(super) wire: Arc<Wire>,
    backend: Framer,
    frontend: Framer,
    /// A rewritten message (a statement riding on `COMMIT`) not yet all
    /// written to the socket, and how much of it is.
    owed: Vec<u8>,
    owed_at: usize,
    /// What the statements bound since the last `Sync` say.
    says: Says,
    /// The prepared statements (by name) whose text says something.
    named: Vec<(Vec<u8>, Says)>,
}

/// How much of a `Bind` or a `Close` is read: its names (a portal's and a
/// statement's, or one of them), which tokio-postgres keeps short.
const NAMES: usize = 256;

impl<S> Observed<S> {
    pub(super) fn new(inner: S, wire: Arc<Wire>) -> Self {
        Observed {
            inner,
            wire,
            backend: Framer::new(false),
            frontend: Framer::new(true),
            owed: Vec::new(),
            owed_at: 0,
            says: Says::default(),
            named: Vec::new(),
        }
    }

    /// Read `bytes` from the server; the ranges of them that tokio-postgres
    /// is not to see (see [`ride`](super::ride)).
    pub(super) fn read(&mut self, bytes: &[u8]) -> Vec<(usize, usize)> {
        let wire = &self.wire;
        let keep = |kind| match kind {
            b'Z' | b'E' | b'C' | b'S' | b'K' => KEPT,
            b'D' if wire.keeps_rows() => usize::MAX,
            _ => 0,
        };
        let mut dropped = Vec::new();
        self.backend.feed_stripping(
            bytes,
            keep,
            |kind, body| match kind {
                b'Z' => wire.on_ready(body.first().copied().unwrap_or(0)),
                b'1' => wire.on_parsed(),
                b'S' => wire.on_parameter(body),
                b'K' => wire.on_key(body),
                b'D' => wire.on_row(body),
                b'E' => wire.on_error(sqlstate(body).unwrap_or(*b"XX000"), said(body)),
                b'C' => wire.on_complete(body.strip_suffix(&[0]).unwrap_or(body)),
                b'G' => wire.on_copy_in(),
                _ => {}
            },
            |kind| wire.strips(kind),
            &mut dropped,
        );
        dropped
    }

    #[cfg(test)]
    pub(super) fn written(&mut self, bytes: &[u8]) {
        self.written_at(bytes, Instant::now(), false);
    }

    /// `bytes` went out (a ride's unit when `rewritten`); their write began
    /// `at`.
    fn written_at(&mut self, bytes: &[u8], at: Instant, rewritten: bool) {
        // One per request: what the statements it runs say (see `Says`):
        // a `Query`'s text, or the text a `Bind`'s statement was parsed from
        // (tokio-postgres prepares in a request of its own, and runs the
        // statement in the next).
        let mut requests = Vec::new();
        let (says, named) = (&mut self.says, &mut self.named);
        self.frontend.feed(
            bytes,
            |kind| match kind {
                b'Q' | b'P' => usize::MAX,
                // Names only: a `Bind`'s values after them are not read.
                b'B' | b'C' => NAMES,
                _ => 0,
            },
            |kind, body| match kind {
                b'Q' => {
                    let (mut said, bound) = (Says::of(body), std::mem::take(says));
                    if bound.any() {
                        said |= bound;
                    }
                    requests.push(said);
                }
                b'S' => requests.push(std::mem::take(says)),
                b'P' => {
                    let (name, text) = parsed(body);
                    named.retain(|(n, _)| n != name);
                    let said = Says::of(text);
                    if said.any() {
                        named.push((name.to_vec(), said));
                    }
                }
                b'B' => {
                    let statement = bound(body);
                    if let Some((_, said)) = named.iter().find(|(n, _)| n == statement) {
                        *says |= *said;
                    }
                }
                // Close of a statement (`S`): its name may be parsed anew.
                b'C' if body.first() == Some(&b'S') => {
                    let name = body[1..].split(|b| *b == 0).next().unwrap_or_default();
                    named.retain(|(n, _)| n != name);
                }
                _ => {}
            },
        );
        if !requests.is_empty() {
            self.wire.on_sent(&requests, rewritten, at);
        }
    }
}

impl<S: AsyncWrite + Unpin> Observed<S> {
    /// Write what is owed of a rewritten message first.
    fn poll_owed(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.owed_at < self.owed.len() {
            match Pin::new(&mut self.inner).poll_write(cx, &self.owed[self.owed_at..]) {
                Poll::Ready(Ok(0)) => {
                    self.wire.on_closed();
                    return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
                }
                Poll::Ready(Ok(n)) => self.owed_at += n,
                Poll::Ready(Err(e)) => {
                    self.wire.on_closed();
                    return Poll::Ready(Err(e));
                }
                Poll::Pending => return Poll::Pending,
            }
        }
        self.owed.clear();
        self.owed_at = 0;
        Poll::Ready(Ok(()))
    }

    /// When a unit waits to replace the next `Query` (see
    /// [`ride`](super::ride)): the first `Query` that starts in `buf` is
    /// taken, with what precedes it (a
    /// `Close` of a statement diesel-async dropped, say), and the unit owed
    /// in its place. Returns how much of `buf` was taken; `None` when `buf`
    /// holds no `Query`'s start (it is written as it is, and the unit still
    /// waits). A `Query` this write does not hold whole, or whose text is
    /// not the one expected, fails the write (tokio-postgres always writes
    /// whole messages), so that it cannot go out without what rides on it.
    fn ride_on(&mut self, buf: &[u8]) -> io::Result<Option<usize>> {
        if !self.wire.unit_waits() {
            return Ok(None);
        }
        let Some(mut at) = self.frontend.next_start(buf) else {
            return Ok(None);
        };
        loop {
            let Some(rest) = buf.get(at..).filter(|rest| !rest.is_empty()) else {
                return Ok(None);
            };
            let whole = rest
                .get(1..5)
                .map(|len| 1 + u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize)
                .filter(|&n| n >= 5 && rest.len() >= n);
            match (rest[0], whole) {
                (b'Q', Some(n)) => {
                    let text = rest[5..n].strip_suffix(&[0]).unwrap_or(&rest[5..n]);
                    return match self.wire.take_unit(text) {
                        None => Ok(None),
                        Some(Ok(unit)) => Ok(Some(self.owe(buf, at, unit, at + n))),
                        Some(Err(_)) => Err(self.refuse("met a query other than the one expected")),
                    };
                }
                (_, Some(n)) => at += n,
                // What precedes a message this write does not hold whole.
                (_, None) if at > 0 => return Ok(Some(self.owe(buf, at, Vec::new(), at))),
                (b'Q', None) => return Err(self.refuse("met a query not written whole")),
                (_, None) => return Ok(None),
            }
        }
    }

    /// See [`cut`](super::cut): only while a transaction is guarded.
    fn cut(&self, buf: &[u8]) -> Option<usize> {
        if !self.wire.guarded() {
            return None;
        }
        super::cut::end_cut(buf, self.frontend.next_start(buf)?, &self.named)
    }

    /// Owe `buf[..at]` and `unit` in place of `buf[..taken]`.
    fn owe(&mut self, buf: &[u8], at: usize, unit: Vec<u8>, taken: usize) -> usize {
        // Before the owed bytes are written (see `Wire::on_sent`).
        let now = Instant::now();
        self.written_at(&buf[..at], now, false);
        self.written_at(&unit, now, true);
        let mut owed = buf[..at].to_vec();
        owed.extend(unit);
        self.owed = owed;
        self.owed_at = 0;
        taken
    }

    /// The connection is closed before anything more is sent: what was to
    /// ride could not.
    fn refuse(&self, what: &str) -> io::Error {
        self.wire.on_closed();
        io::Error::other(format!(
            "idem: statements to ride on BEGIN or COMMIT {what}; the connection is closed before anything commits"
        ))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Observed<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.wire.severed() {
                this.wire.on_closed();
                return Poll::Ready(Err(severed()));
            }
            let before = buf.filled().len();
            let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
            match &polled {
                Poll::Ready(Ok(())) if buf.filled().len() == before => this.wire.on_closed(),
                Poll::Ready(Ok(())) => {
                    let dropped = this.read(&buf.filled()[before..]);
                    if !dropped.is_empty() {
                        let kept = compact(&mut buf.filled_mut()[before..], &dropped);
                        buf.set_filled(before + kept);
                        // All of it taken out: read on, since no new bytes
                        // would read as the stream's end.
                        if kept == 0 {
                            continue;
                        }
                    }
                }
                Poll::Ready(Err(_)) => this.wire.on_closed(),
                Poll::Pending => {
                    // Checked again once the waker is left: a sever between
                    // the first check and now would find none to wake.
                    this.wire.waits_to_read(cx.waker());
                    if this.wire.severed() {
                        continue;
                    }
                }
            }
            return polled;
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Observed<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        // Through the write and its count, so that a sever from another
        // thread (a transaction dropped as the driver writes) sees both or
        // neither.
        let wire = this.wire.clone();
        let _writing = wire.writing();
        if let Err(e) = ready!(this.poll_owed(cx)) {
            return Poll::Ready(Err(e));
        }
        if this.wire.severed() {
            this.wire.on_closed();
            return Poll::Ready(Err(severed()));
        }
        if this.wire.sealed() && buf != LONE_ROLLBACK {
            // Refused once what runs ahead of it that may commit is
            // answered (a `COMMIT` the body queued, a statement behind its
            // end), within bounds: closed now, the connection would leave
            // it to run or be lost, unknown (see `stop`). The driver reads
            // on meanwhile, and polls this write again after each answer.
            if this.wire.holds_refused(cx.waker()) {
                return Poll::Pending;
            }
            this.wire.on_sealed(buf == LONE_COMMIT);
            return Poll::Ready(Err(io::Error::other(
                "idem: the function's body ended idem's transaction itself; nothing more it sends goes out, and the connection is closed",
            )));
        }
        // While a body runs, no write goes past an end it holds.
        let buf = match this.cut(buf) {
            Some(cut) => &buf[..cut],
            None => buf,
        };
        if this.wire.riding() {
            if let Some(taken) = this.ride_on(buf)? {
                // Sent now if the socket takes it; owed (and flushed) if not.
                if let Poll::Ready(Err(e)) = this.poll_owed(cx) {
                    return Poll::Ready(Err(e));
                }
                return Poll::Ready(Ok(taken));
            }
        }
        let at = Instant::now();
        let polled = Pin::new(&mut this.inner).poll_write(cx, buf);
        match &polled {
            Poll::Ready(Ok(n)) => this.written_at(&buf[..*n], at, false),
            Poll::Ready(Err(_)) => this.wire.on_closed(),
            Poll::Pending => {}
        }
        polled
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_owed(cx))?;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_owed(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

/// A `ROLLBACK` alone, as diesel-async and idem send it (a simple query):
/// what the seal lets through (see [`Wire::guard`]). It writes nothing
/// wherever it runs.
const LONE_ROLLBACK: &[u8] = b"Q\0\0\0\x0dROLLBACK\0";

/// A `COMMIT` alone, as diesel-async sends idem's.
const LONE_COMMIT: &[u8] = b"Q\0\0\0\x0bCOMMIT\0";

/// The error of a read or write after [`Wire::sever`].
fn severed() -> io::Error {
    io::Error::other(
        "idem: the connection was closed by idem: a body took it out of the slot it was lent in",
    )
}

/// `bytes` without the `dropped` ranges (in order), moved to its front;
/// how many are kept.
pub(super) fn compact(bytes: &mut [u8], dropped: &[(usize, usize)]) -> usize {
    let mut kept = 0;
    let mut from = 0;
    for &(start, end) in dropped
        .iter()
        .chain(std::iter::once(&(bytes.len(), bytes.len())))
    {
        bytes.copy_within(from..start, kept);
        kept += start - from;
        from = end;
    }
    kept
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
