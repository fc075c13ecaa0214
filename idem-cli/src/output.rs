//! Tables for people, JSON for scripts, written to stdout without a panic.

use std::io::Write as _;
use std::time::Duration;

use serde::Serialize;

use crate::args::Cli;

/// Writing to stdout failed. A reader that stopped reading (`| head`,
/// `EPIPE`) is no error of ours: `main` exits 0 for it; anything else (a
/// full disk) is one line on stderr and exit 1.
#[derive(Debug, thiserror::Error)]
#[error("could not write the output: {0}")]
pub struct OutputError(#[from] pub std::io::Error);

/// Writes `text` to the locked stdout and flushes it.
pub fn write_out(text: &str) -> Result<(), OutputError> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()?;
    Ok(())
}

/// What a command prints: JSON for `--json` (serde escapes every control
/// character), else the text, every control character in it but the line
/// ends shown escaped ([`clean_lines`]).
pub fn emit<T: Serialize>(
    cli: &Cli,
    value: &T,
    text: impl FnOnce() -> String,
) -> Result<(), Box<dyn std::error::Error>> {
    if cli.json {
        let mut doc = serde_json::to_string_pretty(value)?;
        doc.push('\n');
        write_out(&doc)?;
    } else {
        write_out(&clean_lines(&text()))?;
    }
    Ok(())
}

/// Whether `c` must not reach a terminal as it is: a control character
/// (C0, DEL, C1: ESC starts the sequences that clear the screen or set
/// the title, CR overwrites a line, BEL rings), or a bidirectional
/// override or isolate, which reorders what follows it on the line.
fn hidden(c: char) -> bool {
    c.is_control() || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// `c` as it is printed: itself, or escaped as `\u{1b}`.
fn shown(c: char, out: &mut String) {
    if hidden(c) {
        out.extend(c.escape_unicode());
    } else {
        out.push(c);
    }
}

/// A value from the database as one piece of text: every control
/// character (line ends too) escaped, so stored data cannot drive the
/// terminal or forge lines.
pub fn clean(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        shown(c, &mut out);
    }
    out
}

/// A whole output: the line ends kept, every other control character
/// escaped (a second guard behind [`clean`] on each value).
pub fn clean_lines(s: &str) -> String {
    s.split('\n').map(clean).collect::<Vec<_>>().join("\n")
}

/// `3m12s`, `2h5m`, `4d2h`: a duration as a person reads it.
pub fn dur(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{:.1}s", d.as_secs_f64()),
        60..3600 => format!("{}m{}s", s / 60, s % 60),
        3600..86_400 => format!("{}h{}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{}h", s / 86_400, s % 86_400 / 3600),
    }
}

/// An optional duration, `-` for none.
pub fn opt_dur(d: Option<Duration>) -> String {
    d.map_or_else(|| "-".to_owned(), dur)
}

/// Columns aligned on the widest cell; `(none)` for no rows. Every cell
/// is [`clean`]ed.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    if rows.is_empty() {
        return "(none)\n".to_owned();
    }
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|row| row.iter().map(|cell| clean(cell)).collect())
        .collect();
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let parts: Vec<String> = cells
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        out.push_str(parts.join("  ").trim_end());
        out.push('\n');
    };
    line(&mut headers.iter().copied());
    for row in &rows {
        line(&mut row.iter().map(String::as_str));
    }
    out
}

/// `name: value` lines, the names aligned; every value [`clean`]ed.
pub fn fields(pairs: &[(&str, String)]) -> String {
    let w = pairs.iter().map(|(k, _)| k.len()).max().unwrap_or(0) + 1;
    pairs
        .iter()
        .map(|(k, v)| format!("{:<w$} {}\n", format!("{k}:"), clean(v)))
        .collect()
}

/// One line of text, cut to `max` characters: runs of spaces folded into
/// one, control characters escaped (never cut in the middle).
pub fn short(s: &str, max: usize) -> String {
    let mut pieces: Vec<String> = Vec::new();
    for c in s
        .trim_matches(|c: char| c.is_whitespace() && !hidden(c))
        .chars()
    {
        if c.is_whitespace() && !hidden(c) {
            if pieces.last().is_some_and(|p| p != " ") {
                pieces.push(" ".to_owned());
            }
            continue;
        }
        let mut piece = String::new();
        shown(c, &mut piece);
        pieces.push(piece);
    }
    let width = |p: &String| p.chars().count();
    if pieces.iter().map(width).sum::<usize>() <= max {
        return pieces.concat();
    }
    let mut cut = String::new();
    let mut used = 0;
    for p in &pieces {
        if used + width(p) > max.saturating_sub(1) {
            break;
        }
        used += width(p);
        cut.push_str(p);
    }
    format!("{}…", cut.trim_end())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_shown_escaped() {
        assert_eq!(
            clean("a\u{1b}[2Jb\u{7}\r\n"),
            "a\\u{1b}[2Jb\\u{7}\\u{d}\\u{a}"
        );
        assert_eq!(
            clean("x\u{9b}y\u{202e}z\u{7f}"),
            "x\\u{9b}y\\u{202e}z\\u{7f}"
        );
        assert_eq!(clean("plain é"), "plain é");
        assert_eq!(clean_lines("a\u{1b}\nb\r\n"), "a\\u{1b}\nb\\u{d}\n");
        assert_eq!(short("  a  \t b\u{1b}[2J  ", 60), "a \\u{9} b\\u{1b}[2J");
        assert_eq!(short("one two three", 8), "one two…");
        // An escape is never cut in half.
        assert_eq!(short("ab\u{1b}cdef", 6), "ab…");
        let table = table(&["k"], &[vec!["x\ny\u{1b}".to_owned()]]);
        assert_eq!(table, "k\nx\\u{a}y\\u{1b}\n");
    }
}
