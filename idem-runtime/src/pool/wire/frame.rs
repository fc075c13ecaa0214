//! The protocol's framing: a stream of bytes split into messages, and the
//! fields of an `ErrorResponse`.

use crate::cause::{Said, CANCEL_REQUEST};

/// Longest body kept of the messages read for their status
/// (`ErrorResponse` is the longest of those; its SQLSTATE comes first in
/// PostgreSQL's answers). Rows captured for a riding statement are kept whole.
pub(super) const KEPT: usize = 4096;

/// Splits a byte stream into protocol messages: a type byte (none for the
/// frontend's first, the startup message), a length that counts itself, a
/// body.
#[derive(Debug)]
pub(super) struct Framer {
    header: [u8; 5],
    have: usize,
    /// The next message has no type byte.
    untyped: bool,
    left: usize,
    kind: u8,
    body: Vec<u8>,
    /// How much of the current message's body is kept.
    limit: usize,
    /// The current message is taken out of the stream.
    dropping: bool,
}

impl Framer {
    pub(super) fn new(untyped_first: bool) -> Framer {
        Framer {
            header: [0; 5],
            have: 0,
            untyped: untyped_first,
            left: 0,
            kind: 0,
            body: Vec::new(),
            limit: 0,
            dropping: false,
        }
    }

    /// Feed `bytes`; `keep` says how much of a message's body to keep, given
    /// its type, and `done` gets each whole message's type and kept body.
    pub(super) fn feed(
        &mut self,
        bytes: &[u8],
        keep: impl Fn(u8) -> usize,
        done: impl FnMut(u8, &[u8]),
    ) {
        self.feed_stripping(bytes, keep, done, |_| false, &mut Vec::new());
    }

    /// [`Framer::feed`], and the messages whose type `strip` names (asked
    /// as each begins, once every message before it was `done`) are
    /// marked in `dropped`: the ranges of `bytes` they take, in order.
    pub(super) fn feed_stripping(
        &mut self,
        mut bytes: &[u8],
        keep: impl Fn(u8) -> usize,
        mut done: impl FnMut(u8, &[u8]),
        strip: impl Fn(u8) -> bool,
        dropped: &mut Vec<(usize, usize)>,
    ) {
        let total = bytes.len();
        while !bytes.is_empty() {
            let at = total - bytes.len();
            if self.left == 0 && self.have < self.header_len() {
                if self.have == 0 && !self.untyped {
                    self.dropping = strip(bytes[0]);
                }
                let n = (self.header_len() - self.have).min(bytes.len());
                if self.dropping {
                    mark(dropped, at, n);
                }
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
                self.limit = if self.untyped { 0 } else { keep(kind) };
                if self.left == 0 {
                    self.finish(&mut done);
                }
                continue;
            }
            let n = self.left.min(bytes.len());
            if self.dropping {
                mark(dropped, at, n);
            }
            if self.body.len() < self.limit {
                let room = (self.limit - self.body.len()).min(n);
                self.body.extend_from_slice(&bytes[..room]);
            }
            self.left -= n;
            bytes = &bytes[n..];
            if self.left == 0 {
                self.finish(&mut done);
            }
        }
    }

    /// Where in `next`, the bytes to be fed next, the next message starts:
    /// 0 between two messages, after the rest of the current one otherwise;
    /// `None` when it starts beyond `next` (or the current message's length
    /// is not in it yet, so nothing in it starts a message).
    pub(super) fn next_start(&self, next: &[u8]) -> Option<usize> {
        if self.left == 0 && self.have == 0 {
            return Some(0);
        }
        if self.have == self.header_len() {
            return Some(self.left);
        }
        // A header cut short: its length comes first in `next`.
        let missing = self.header_len() - self.have;
        let mut header = self.header;
        header[self.have..self.header_len()].copy_from_slice(next.get(..missing)?);
        let len = if self.untyped {
            &header[..4]
        } else {
            &header[1..5]
        };
        let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize;
        Some(missing + len.saturating_sub(4))
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

/// `n` bytes from `at` are dropped: joined to the last range when they follow it.
fn mark(dropped: &mut Vec<(usize, usize)>, at: usize, n: usize) {
    match dropped.last_mut() {
        Some(last) if last.1 == at => last.1 += n,
        _ => dropped.push((at, at + n)),
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
pub(super) fn sqlstate(body: &[u8]) -> Option<[u8; 5]> {
    field(body, b'C')?.try_into().ok()
}

/// Whether an `ErrorResponse` ends the session: its severity (`V`, never
/// translated; `S` before PostgreSQL 9.6) is FATAL or PANIC.
fn fatal(body: &[u8]) -> bool {
    let severity = field(body, b'V').or_else(|| field(body, b'S'));
    matches!(severity, Some(b"FATAL" | b"PANIC"))
}

/// What an `ErrorResponse` says besides its SQLSTATE (see [`Said`]).
pub(super) fn said(body: &[u8]) -> Said {
    Said {
        fatal: fatal(body),
        cancel_request: field(body, b'C') == Some(b"57014")
            && field(body, b'M') == Some(CANCEL_REQUEST),
    }
}

/// A `Parse` body's statement name and text.
pub(super) fn parsed(body: &[u8]) -> (&[u8], &[u8]) {
    let mut fields = body.split(|b| *b == 0);
    let name = fields.next().unwrap_or_default();
    (name, fields.next().unwrap_or_default())
}

/// The name of the statement a `Bind` body binds (after its portal's).
pub(super) fn bound(body: &[u8]) -> &[u8] {
    body.split(|b| *b == 0).nth(1).unwrap_or_default()
}
