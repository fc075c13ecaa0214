//! What a client's bytes ask PostgreSQL to run, read off the wire for the
//! [proxy](crate::proxy)'s rules.
//!
//! A rule is about a statement being run, and a prepared statement's text
//! travels only once, in its `Parse`; every later run is a `Bind` naming it.
//! So the reader keeps each connection's prepared statements by name, and
//! reports, for a chunk of bytes, the SQL of every statement the chunk runs:
//! a simple query's text, or the text a `Bind` names. A `Parse` alone runs
//! nothing and reports nothing. Texts keep their terminating NUL, so a
//! pattern such as `"COMMIT\0"` tells `COMMIT` from `READ COMMITTED`.

use std::collections::HashMap;

/// The startup packet's request codes that are not a startup (the server
/// answers them with one byte, and the real startup packet follows).
const SSL_REQUEST: u32 = 80_877_103;
const GSSENC_REQUEST: u32 = 80_877_104;
const CANCEL_REQUEST: u32 = 80_877_102;

/// One connection's frontend stream, read as it arrives.
#[derive(Debug, Default)]
pub(crate) struct Frontend {
    /// Bytes of a message not complete yet.
    pending: Vec<u8>,
    /// Past the startup packet (whose messages carry no type byte).
    started: bool,
    /// Prepared statements by name ("" the unnamed one), with their SQL.
    statements: HashMap<Vec<u8>, Vec<u8>>,
}

impl Frontend {
    /// The SQL texts of the statements that the messages completed by
    /// `chunk` run, in order.
    pub(crate) fn runs(&mut self, chunk: &[u8]) -> Vec<Vec<u8>> {
        self.pending.extend_from_slice(chunk);
        let mut runs = Vec::new();
        let mut at = 0;
        loop {
            let rest = &self.pending[at..];
            if !self.started {
                let Some(len) = be_u32(rest, 0) else { break };
                let len = len as usize;
                if len < 8 || rest.len() < len {
                    break;
                }
                let code = be_u32(rest, 4).unwrap_or(0);
                if !matches!(code, SSL_REQUEST | GSSENC_REQUEST | CANCEL_REQUEST) {
                    self.started = true;
                }
                at += len;
                continue;
            }
            let Some(len) = be_u32(rest, 1) else { break };
            let total = 1 + len as usize;
            if len < 4 || rest.len() < total {
                break;
            }
            let body = &rest[5..total];
            match rest[0] {
                b'Q' => runs.push(until_nul(body).to_vec()),
                b'P' => {
                    let name = until_nul(body);
                    let sql = until_nul(&body[name.len()..]);
                    let (name, sql) = (strip_nul(name).to_vec(), sql.to_vec());
                    self.statements.insert(name, sql);
                }
                b'B' => {
                    let portal = until_nul(body);
                    let name = strip_nul(until_nul(&body[portal.len()..]));
                    if let Some(sql) = self.statements.get(name) {
                        runs.push(sql.clone());
                    }
                }
                // Close: 'S' and the statement's name.
                b'C' if body.first() == Some(&b'S') => {
                    self.statements.remove(strip_nul(until_nul(&body[1..])));
                }
                _ => {}
            }
            at += total;
        }
        self.pending.drain(..at);
        runs
    }
}

fn be_u32(bytes: &[u8], at: usize) -> Option<u32> {
    let four = bytes.get(at..at + 4)?;
    Some(u32::from_be_bytes([four[0], four[1], four[2], four[3]]))
}

/// The bytes up to and including the first NUL (all of them if none).
fn until_nul(bytes: &[u8]) -> &[u8] {
    match bytes.iter().position(|&b| b == 0) {
        Some(end) => &bytes[..=end],
        None => bytes,
    }
}

fn strip_nul(bytes: &[u8]) -> &[u8] {
    bytes.strip_suffix(&[0]).unwrap_or(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(kind: u8, body: &[u8]) -> Vec<u8> {
        let mut out = vec![kind];
        out.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
        out.extend_from_slice(body);
        out
    }

    fn startup() -> Vec<u8> {
        let mut body = 196_608_u32.to_be_bytes().to_vec();
        body.extend_from_slice(b"user\0postgres\0\0");
        let mut out = (body.len() as u32 + 4).to_be_bytes().to_vec();
        out.extend_from_slice(&body);
        out
    }

    #[test]
    fn a_bind_runs_the_text_its_statement_was_parsed_with() {
        let mut wire = Frontend::default();
        assert!(wire.runs(&startup()).is_empty());
        let parse = message(b'P', b"s1\0COMMIT\0\0\0");
        assert!(wire.runs(&parse).is_empty(), "a Parse runs nothing");
        let bind = message(b'B', b"\0s1\0\0\0\0\0\0\0");
        let query = message(b'Q', b"BEGIN ISOLATION LEVEL READ COMMITTED\0");
        // One chunk, split mid-message: reported once complete, in order.
        let both = [bind.clone(), query].concat();
        let (head, tail) = both.split_at(3);
        assert!(wire.runs(head).is_empty());
        assert_eq!(
            wire.runs(tail),
            vec![
                b"COMMIT\0".to_vec(),
                b"BEGIN ISOLATION LEVEL READ COMMITTED\0".to_vec()
            ]
        );
        // Closed, the name runs nothing any more.
        assert!(wire.runs(&message(b'C', b"Ss1\0")).is_empty());
        assert!(wire.runs(&bind).is_empty());
    }

    #[test]
    fn an_ssl_request_comes_before_the_startup_packet() {
        let mut wire = Frontend::default();
        let mut ssl = 8_u32.to_be_bytes().to_vec();
        ssl.extend_from_slice(&SSL_REQUEST.to_be_bytes());
        assert!(wire.runs(&[ssl, startup()].concat()).is_empty());
        assert_eq!(
            wire.runs(&message(b'Q', b"SELECT 1\0")),
            vec![b"SELECT 1\0".to_vec()]
        );
    }
}
