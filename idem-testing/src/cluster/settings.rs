//! The caller's settings for a throwaway cluster, checked before any of it
//! is written to `postgresql.conf`: a line there that the server cannot
//! parse fails the start with an error naming a line of a file that is
//! gone by the time anyone reads it, and a newline in a name or value would
//! write a second setting nobody asked for.

use crate::HarnessError;

/// Settings the harness owns: the cluster's URL, socket, data directory and
/// clean-up depend on them, and the file directives would read settings the
/// checks here never see.
const OWNED: &[&str] = &[
    "port",
    "listen_addresses",
    "unix_socket_directories",
    "data_directory",
    "config_file",
    "hba_file",
    "ident_file",
    "include",
    "include_dir",
    "include_if_exists",
];

/// `Ok` when `(name, value)` can be written as one `name = value` line that
/// PostgreSQL reads as the caller meant, else [`HarnessError::InvalidSetting`].
pub(super) fn check(name: &str, value: &str) -> Result<(), HarnessError> {
    let refuse = |reason: &str| {
        Err(HarnessError::InvalidSetting {
            name: name.to_owned(),
            value: value.to_owned(),
            reason: reason.to_owned(),
        })
    };
    if !is_name(name) {
        return refuse(
            "a setting's name is letters, digits and `_`, beginning with a letter or `_` \
             (two such joined by a `.` for an extension's)",
        );
    }
    if OWNED.iter().any(|owned| owned.eq_ignore_ascii_case(name)) {
        return refuse(
            "the harness sets it (the cluster's URL, socket, data directory and clean-up depend on it)",
        );
    }
    match value.strip_prefix('\'') {
        _ if value.is_empty() => refuse("the value is empty (an empty string is written `''`)"),
        Some(quoted) => match closes_at_end(quoted) {
            Ok(()) => Ok(()),
            Err(reason) => refuse(reason),
        },
        None if value.chars().all(is_bare) => Ok(()),
        None => refuse(
            "a value other than a word or a number is quoted by the caller, \
             with `''` for a quote inside (\"'a b'\")",
        ),
    }
}

/// A name as `postgresql.conf` reads one: an identifier, or two joined by
/// a dot (an extension's setting, `auto_explain.log_min_duration`).
fn is_name(name: &str) -> bool {
    let mut parts = name.split('.');
    let first = parts.next().is_some_and(is_identifier);
    let second = parts.next().is_none_or(is_identifier);
    first && second && parts.next().is_none()
}

fn is_identifier(part: &str) -> bool {
    let mut chars = part.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// What `postgresql.conf` reads unquoted as one value: a word, a number
/// with its unit, a path (`-1`, `3MB`, `on`, `0.5`, `pg_catalog`).
fn is_bare(c: char) -> bool {
    c.is_ascii_alphanumeric() || "-+._:/".contains(c)
}

/// `quoted` (after the opening quote) ends with its closing quote and holds
/// no line break: `''` and a backslash escape are its own characters.
fn closes_at_end(quoted: &str) -> Result<(), &'static str> {
    if quoted.contains(['\n', '\r', '\0']) {
        return Err("a line break or NUL cannot be written in postgresql.conf");
    }
    let mut chars = quoted.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                chars.next();
            }
            '\'' if chars.as_str().starts_with('\'') => {
                chars.next();
            }
            '\'' if chars.as_str().is_empty() => return Ok(()),
            '\'' => return Err("text after the closing quote (a quote inside is written `''`)"),
            _ => {}
        }
    }
    Err("the quote is not closed")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(name: &str, value: &str) -> bool {
        matches!(check(name, value), Err(HarnessError::InvalidSetting { .. }))
    }

    #[test]
    fn words_numbers_and_quoted_strings_pass() {
        for (name, value) in [
            ("max_prepared_transactions", "4"),
            ("work_mem", "3MB"),
            ("fsync", "off"),
            ("random_page_cost", "1.5"),
            ("statement_timeout", "-1"),
            ("auto_explain.log_min_duration", "0"),
            ("search_path", "'a, \"b c\"'"),
            ("log_line_prefix", "'%m # it''s \\\\ '"),
            ("lc_messages", "''"),
        ] {
            assert!(check(name, value).is_ok(), "{name} = {value}");
        }
    }

    #[test]
    fn what_would_write_another_line_or_misparse_is_refused() {
        for (name, value) in [
            ("work_mem", "64kB\nstatement_timeout = 1"),
            ("statement_timeout = 4\nwork_mem", "128kB"),
            ("work_mem", "'64kB\nstatement_timeout = 1'"),
            ("", "1"),
            ("work_mem", ""),
            ("a=b", "1"),
            ("1abc", "1"),
            ("a.b.c", "1"),
            ("a.", "1"),
            ("search_path", "a#b"),
            ("search_path", "a b"),
            ("search_path", "'abc"),
            ("search_path", "'abc\\'"),
            ("search_path", "'a' # b"),
            ("search_path", "'a'b'"),
        ] {
            assert!(refused(name, value), "{name:?} = {value:?}");
        }
    }

    #[test]
    fn the_harness_settings_are_refused_in_any_case() {
        for name in [
            "port",
            "PORT",
            "listen_addresses",
            "data_directory",
            "include",
        ] {
            assert!(refused(name, "'x'"), "{name}");
        }
    }
}
