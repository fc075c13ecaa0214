//! Where a write is cut while a body runs: just after the first request in
//! it that ends the transaction (see `Wire::guard`). tokio-postgres writes
//! every request queued so far in one write, a body's own end and what
//! comes after it (the body's next request, or idem's own `COMMIT`) among
//! them; the seal, checked once per write, would let all of it go out.
//! Written up to the end, the rest comes back in the next write, which the
//! seal then holds.

use super::frame;
use super::says::Says;

/// Where `buf` is cut: just past the first request that ends the
/// transaction, when something follows it; `start`: where its first whole
/// message begins. `named`: what the statements prepared by name on this
/// connection say.
pub(super) fn end_cut(buf: &[u8], start: usize, named: &[(Vec<u8>, Says)]) -> Option<usize> {
    // Almost every write holds one request: those are never read further.
    let requests = messages(buf, start).filter(|m| matches!(m.0, b'Q' | b'S'));
    if requests.take(2).count() < 2 {
        return None;
    }
    let (mut bound, mut parsed) = (Says::default(), Vec::new());
    for (kind, body, end) in messages(buf, start) {
        let ends = match kind {
            b'Q' => Says::of(body.strip_suffix(&[0]).unwrap_or(body)).ends || bound.ends,
            b'S' => bound.ends,
            b'P' => {
                let (name, text) = frame::parsed(body);
                parsed.push((name, Says::of(text)));
                continue;
            }
            b'B' => {
                let statement = frame::bound(body);
                let said = parsed
                    .iter()
                    .rev()
                    .find(|(n, _)| *n == statement)
                    .map(|p| p.1);
                let said = said.or_else(|| named.iter().find(|(n, _)| n == statement).map(|p| p.1));
                bound |= said.unwrap_or_default();
                continue;
            }
            _ => continue,
        };
        if ends {
            return (end < buf.len()).then_some(end);
        }
        bound = Says::default();
    }
    None
}

/// The whole messages of `buf` from `start`: each one's type, body, and
/// where it ends.
fn messages(buf: &[u8], start: usize) -> impl Iterator<Item = (u8, &[u8], usize)> + Clone {
    let mut at = start;
    std::iter::from_fn(move || {
        let header = buf.get(at..at + 5)?;
        let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
        let end = at
            .checked_add(1 + len)
            .filter(|&end| len >= 4 && end <= buf.len())?;
        let message = (header[0], &buf[at + 5..end], end);
        at = end;
        Some(message)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(text: &str) -> Vec<u8> {
        let mut m = vec![b'Q'];
        m.extend(((text.len() + 5) as u32).to_be_bytes());
        m.extend(text.as_bytes());
        m.push(0);
        m
    }

    fn message(kind: u8, body: &[u8]) -> Vec<u8> {
        let mut m = vec![kind];
        m.extend(((body.len() + 4) as u32).to_be_bytes());
        m.extend(body);
        m
    }

    #[test]
    fn a_write_is_cut_after_the_end_it_holds() {
        let (end, next) = (
            query("ROLLBACK AND CHAIN; INSERT INTO t VALUES (1)"),
            query("COMMIT"),
        );
        let buf = [end.clone(), next.clone()].concat();
        assert_eq!(end_cut(&buf, 0, &[]), Some(end.len()));
        let buf = [query("SELECT 1"), query("COMMIT"), next.clone()].concat();
        assert_eq!(end_cut(&buf, 0, &[]), Some(buf.len() - next.len()));
        // Through the extended protocol, by a name parsed in the same write
        // or before it.
        let parse = message(b'P', b"s1\0COMMIT\0\0\0");
        let bind = message(b'B', b"\0s1\0\0\0\0\0\0\0");
        let (execute, sync) = (message(b'E', b"\0\0\0\0\0"), message(b'S', b""));
        let buf = [
            parse,
            bind.clone(),
            execute.clone(),
            sync.clone(),
            next.clone(),
        ]
        .concat();
        assert_eq!(end_cut(&buf, 0, &[]), Some(buf.len() - next.len()));
        let said = Says::of(b"ROLLBACK");
        let buf = [bind, execute, sync, next].concat();
        let named = [(b"s1".to_vec(), said)];
        assert_eq!(
            end_cut(&buf, 0, &named),
            Some(buf.len() - query("COMMIT").len())
        );
    }

    #[test]
    fn other_writes_are_not_cut() {
        let lone = query("COMMIT");
        assert_eq!(end_cut(&lone, 0, &[]), None);
        let two = [query("SELECT 1"), query("ROLLBACK TO SAVEPOINT a")].concat();
        assert_eq!(end_cut(&two, 0, &[]), None);
        let ends_last = [query("SELECT 1"), query("ROLLBACK")].concat();
        assert_eq!(end_cut(&ends_last, 0, &[]), None);
        // A message cut short at the end of the write is not read.
        let short = [query("SELECT 1"), query("COMMIT")[..6].to_vec()].concat();
        assert_eq!(end_cut(&short, 0, &[]), None);
    }
}
