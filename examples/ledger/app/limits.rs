//! The ledger's input limits, checked before anything is written.
//!
//! | input | limit | refused with |
//! |---|---|---|
//! | request body | [`MAX_BODY_BYTES`] (64 KiB) | 413 `body-too-large` |
//! | `amount` | 1 to [`MAX_AMOUNT`] minor units | 400 `non-positive-amount`, 422 `amount-too-large` |
//! | a balance after a movement | within `i64` | 422 `balance-overflow` |
//! | `currency` | three capital ASCII letters | 400 `invalid-currency` |
//! | `metadata` | a JSON object, at most [`MAX_METADATA_BYTES`] as compact JSON, [`MAX_METADATA_DEPTH`] levels, no U+0000 | 422 `invalid-metadata` |
//!
//! Whatever of the input a refusal quotes is cut to [`MAX_ECHO_CHARS`]
//! characters, control characters escaped.

use serde_json::Value;

/// The largest request body read, in bytes. The largest valid request is a
/// few KiB (metadata is at most 4 KiB); anything near this is not a ledger
/// request.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// The largest amount one movement carries, in minor units: 10^12 cents is
/// ten billion of a currency, more than any wallet moves at once, and
/// 9 million such movements still fit a balance.
pub const MAX_AMOUNT: i64 = 1_000_000_000_000;

/// The largest metadata, in bytes of compact JSON.
pub const MAX_METADATA_BYTES: usize = 4096;

/// The deepest metadata: the object itself is level 1. Metadata is labels,
/// not documents; the bound also keeps the stored response (the account, in
/// its idempotency record) well inside what JSON parsers accept.
pub const MAX_METADATA_DEPTH: usize = 32;

/// How much of a refused input a problem quotes.
pub const MAX_ECHO_CHARS: usize = 64;

/// `input` as a refusal may quote it: at most [`MAX_ECHO_CHARS`]
/// characters, then `…`, with control and invisible characters escaped
/// (`\u{0}`), so that a quote is short, printable and storable (PostgreSQL
/// text and jsonb refuse U+0000).
pub fn echo(input: &str) -> String {
    elide(input, MAX_ECHO_CHARS, 0)
}

/// `text` with at most `head` characters from its start and `tail` from its
/// end, `…` for what is left out, escaped as [`echo`] does: for messages
/// (serde's) that quote the input in their middle and say where in it they
/// failed at their end.
pub fn elide(text: &str, head: usize, tail: usize) -> String {
    let count = text.chars().count();
    let mut out = String::new();
    let mut push = |c: char| {
        if c.is_control() || is_invisible(c) {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    };
    if count <= head + tail {
        text.chars().for_each(&mut push);
    } else {
        text.chars().take(head).for_each(&mut push);
        push('…');
        text.chars().skip(count - tail).for_each(&mut push);
    }
    out
}

/// Characters that hide or reorder text: a quote with them would not read
/// as what was sent.
fn is_invisible(c: char) -> bool {
    matches!(c, '\u{00AD}' | '\u{200B}'..='\u{200F}' | '\u{202A}'..='\u{202E}' | '\u{2060}'..='\u{206F}' | '\u{FEFF}')
}

/// An ISO 4217-style code: three capital ASCII letters.
pub fn valid_currency(currency: &str) -> bool {
    currency.len() == 3 && currency.bytes().all(|b| b.is_ascii_uppercase())
}

/// Why `metadata` cannot be stored, written for the client; `None` when it
/// can.
pub fn metadata_fault(metadata: &Value) -> Option<String> {
    let kind = match metadata {
        Value::Object(_) => None,
        Value::Array(_) => Some("an array"),
        Value::String(_) => Some("a string"),
        Value::Number(_) => Some("a number"),
        Value::Bool(_) => Some("a boolean"),
        Value::Null => Some("null"),
    };
    if let Some(kind) = kind {
        return Some(format!(
            "metadata must be a JSON object, like {{\"name\": \"savings\"}}, not {kind}"
        ));
    }
    if depth(metadata) > MAX_METADATA_DEPTH {
        return Some(format!(
            "metadata nests more than {MAX_METADATA_DEPTH} levels of objects and arrays; flatten it"
        ));
    }
    if has_nul(metadata) {
        return Some(
            "metadata contains the character U+0000 (NUL) in a key or a string, which cannot be \
             stored; remove it"
                .to_owned(),
        );
    }
    let bytes = serde_json::to_vec(metadata).map_or(usize::MAX, |json| json.len());
    if bytes > MAX_METADATA_BYTES {
        return Some(format!(
            "metadata is {bytes} bytes as compact JSON; at most {MAX_METADATA_BYTES} are accepted"
        ));
    }
    None
}

/// Levels of objects and arrays; a scalar is 0. serde_json parses at most
/// 128 levels, so the recursion is bounded.
fn depth(value: &Value) -> usize {
    match value {
        Value::Object(map) => 1 + map.values().map(depth).max().unwrap_or(0),
        Value::Array(items) => 1 + items.iter().map(depth).max().unwrap_or(0),
        _ => 0,
    }
}

fn has_nul(value: &Value) -> bool {
    match value {
        Value::String(s) => s.contains('\0'),
        Value::Object(map) => map.iter().any(|(k, v)| k.contains('\0') || has_nul(v)),
        Value::Array(items) => items.iter().any(has_nul),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn echo_is_short_and_printable() {
        assert_eq!(echo("EUR"), "EUR");
        assert_eq!(echo("E\0R"), "E\\u{0}R");
        let long = echo(&"x".repeat(10_000));
        assert_eq!(long.chars().count(), MAX_ECHO_CHARS + 1);
        assert!(long.ends_with('…'));
        assert_eq!(elide("abcdefgh", 2, 3), "ab…fgh");
        assert_eq!(elide("abcde", 2, 3), "abcde");
    }

    #[test]
    fn metadata_limits() {
        assert_eq!(metadata_fault(&json!({ "name": "savings" })), None);
        assert!(metadata_fault(&json!([])).is_some());
        assert!(metadata_fault(&json!({ "a": [{ "b": "\u{0}" }] })).is_some());
        let deep = (1..MAX_METADATA_DEPTH).fold(json!({}), |inner, _| json!({ "a": inner }));
        assert_eq!(metadata_fault(&deep), None);
        assert!(metadata_fault(&json!({ "a": deep })).is_some());
    }
}
