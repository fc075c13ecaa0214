//! SQL text with its values written in: literals for the statements idem
//! sends as simple queries (DDL), where no parameter can be bound; hex as
//! PostgreSQL writes it, both ways; and spans of time for `interval`
//! arithmetic.

use std::time::Duration;

/// Like PostgreSQL's `quote_literal`: single quotes doubled, and an `E''`
/// string with doubled backslashes when there is a backslash, so the result
/// means the same whatever `standard_conforming_strings` is.
pub(crate) fn quote_literal(value: &str) -> String {
    let mut out = String::with_capacity(value.len() + 3);
    push_literal(&mut out, value);
    out
}

/// [`quote_literal`], appended to `out`.
fn push_literal(out: &mut String, value: &str) {
    if value.contains('\\') {
        out.push_str("E'");
        for c in value.chars() {
            match c {
                '\'' => out.push_str("''"),
                '\\' => out.push_str("\\\\"),
                c => out.push(c),
            }
        }
    } else {
        out.push('\'');
        for c in value.chars() {
            if c == '\'' {
                out.push('\'');
            }
            out.push(c);
        }
    }
    out.push('\'');
}

/// `bytes` as lowercase hex, as `encode(.., 'hex')` writes it.
pub(crate) fn to_hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(2 * bytes.len());
    push_hex(&mut out, bytes);
    out
}

/// [`to_hex`], appended to `out`.
pub(crate) fn push_hex(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for &byte in bytes {
        out.push(char::from(DIGITS[usize::from(byte >> 4)]));
        out.push(char::from(DIGITS[usize::from(byte & 0xf)]));
    }
}

/// Lowercase hex, as `encode(.., 'hex')` writes it, back to bytes.
pub(crate) fn from_hex(text: &[u8]) -> Option<Vec<u8>> {
    fn nibble(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            b'A'..=b'F' => Some(c - b'A' + 10),
            _ => None,
        }
    }
    if text.len() % 2 != 0 {
        return None;
    }
    text.chunks(2)
        .map(|pair| Some(nibble(pair[0])? << 4 | nibble(pair[1])?))
        .collect()
}

/// The longest span idem puts into `interval` arithmetic: a thousand years.
/// A `Duration` can be far longer (to 584 billion years), and `now()` plus
/// or minus such a span is out of PostgreSQL's range (an `interval` ends
/// near 178 million years, the calendar at 4713 BC), which fails the
/// statement: a delay, lease or retention past it counts as a thousand
/// years, as good as never for every one idem keeps.
pub(crate) const LONGEST_SPAN: Duration = Duration::from_secs(1000 * 366 * 86_400);

/// `d` in whole milliseconds, at most [`LONGEST_SPAN`]: the value of
/// `$n * interval '1 millisecond'`.
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.min(LONGEST_SPAN).as_millis()).unwrap_or(i64::MAX)
}

/// `d` in whole microseconds (PostgreSQL's resolution), at most
/// [`LONGEST_SPAN`]: the value of `$n * interval '1 microsecond'`.
pub(crate) fn micros(d: Duration) -> i64 {
    i64::try_from(d.min(LONGEST_SPAN).as_micros()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_past_a_thousand_years_count_as_a_thousand() {
        assert_eq!(millis(Duration::from_millis(1500)), 1500);
        assert_eq!(micros(Duration::from_micros(7)), 7);
        assert_eq!(millis(Duration::MAX), millis(LONGEST_SPAN));
        assert_eq!(micros(Duration::MAX), micros(LONGEST_SPAN));
        assert_eq!(micros(LONGEST_SPAN), 1000 * 366 * 86_400 * 1_000_000);
    }

    #[test]
    fn literals_mean_the_same_under_either_string_setting() {
        assert_eq!(quote_literal("it's"), "'it''s'");
        assert_eq!(quote_literal(r"a\'b"), r"E'a\\''b'");
        assert_eq!(quote_literal("плов"), "'плов'");
    }

    #[test]
    fn hex_round_trips_and_refuses_what_is_not_hex() {
        assert_eq!(to_hex(&[0, 0xab, 0xff, 0x10]), "00abff10");
        assert_eq!(from_hex(to_hex(&[7, 200]).as_bytes()), Some(vec![7, 200]));
        assert_eq!(from_hex(b"00abFF"), Some(vec![0, 0xab, 0xff]));
        assert_eq!(from_hex(b""), Some(vec![]));
        assert_eq!(from_hex(b"abc"), None);
        assert_eq!(from_hex(b"zz"), None);
    }
}
