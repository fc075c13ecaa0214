//! What a statement's text says about the transaction, as far as the wire
//! must know before its answer: read from a `Query`'s text or a `Parse`'s.
//! Statements are found as PostgreSQL's lexer finds them (comments,
//! literals, quoted names), never parsed further; where a reading can err
//! it errs towards "said", which makes a call say more was committed,
//! never less.

/// What the statements of a request may do to the transaction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Says {
    /// A statement ends in `AND CHAIN` (see [`chains`]).
    pub(crate) chain: bool,
    /// A statement may commit the transaction: one whose
    /// first word, past blanks and comments, is `COMMIT`, `END` or `PREPARE`
    /// (`PREPARE TRANSACTION`; `PREPARE name AS ..` reads as said too); or any
    /// statement after a `ROLLBACK` (or `ABORT`) without `AND CHAIN` in the
    /// same text, which runs outside any transaction and commits on its own.
    /// Statements are told apart at each `;` outside comments, literals and
    /// quoted names, found as PostgreSQL's lexer finds them: `--` to the end of
    /// the line (`\n` or `\r`), nested `/* .. */`, `'..'` (with `''`), `E'..'`
    /// (with backslash escapes), `".."` (with `""`), and `$tag$ .. $tag$`.
    ///
    /// For a request whose answer idem stops waiting for (a future the body
    /// dropped, still running at `COMMIT`), or that a closed connection left
    /// unanswered: cancelling it and closing the connection rolls the
    /// transaction back, unless it was a commit, which the server may run
    /// before it sees the connection end.
    pub(crate) commit: bool,
    /// A statement is a `COMMIT`, `END` or `PREPARE`: the end itself may
    /// commit (not only a statement after a `ROLLBACK`, which commits as
    /// it runs).
    pub(crate) commit_end: bool,
    /// A statement ends the transaction: `COMMIT`, `END`, `PREPARE
    /// TRANSACTION`, `ROLLBACK` or `ABORT` (not a `ROLLBACK TO` a
    /// savepoint). What the body sends after one would run outside idem's
    /// transaction (see `Wire::guard`).
    pub(crate) ends: bool,
    /// Every statement is a `ROLLBACK` or an `ABORT` (at least one): a
    /// request that writes nothing wherever it runs, idem's own rollback
    /// among them. Only ever read from a `Query`'s text.
    pub(crate) rollback_only: bool,
}

impl Says {
    /// What `text` (one or more statements) says.
    pub(super) fn of(text: &[u8]) -> Says {
        // A plain literal takes backslash escapes when
        // `standard_conforming_strings` is off, which a session may set:
        // both readings are made, and each errs towards what may write.
        let (plain, escaped) = (Reading::of(text, false), Reading::of(text, true));
        Says {
            chain: plain.chain || escaped.chain,
            commit: plain.commit || escaped.commit,
            commit_end: plain.commit_end || escaped.commit_end,
            ends: plain.ends || escaped.ends,
            rollback_only: plain.rollback_only && escaped.rollback_only,
        }
    }

    /// Whether it says anything at all.
    pub(super) fn any(self) -> bool {
        self.chain || self.commit || self.ends
    }
}

impl std::ops::BitOrAssign for Says {
    fn bitor_assign(&mut self, other: Says) {
        self.chain |= other.chain;
        self.commit |= other.commit;
        self.commit_end |= other.commit_end;
        self.ends |= other.ends;
        // Two statements: not a lone rollback any more (see `Observed`,
        // which never counts a `Sync`'s request as one).
        self.rollback_only = false;
    }
}

/// Whether a statement ends in `AND CHAIN` (past blanks and comments, in
/// any case): `COMMIT AND CHAIN`, or a `ROLLBACK AND CHAIN` (`ABORT ..`),
/// which ends the transaction and begins the next. Not `AND NO CHAIN`, which
/// ends it for good (what follows runs outside any transaction), nor a
/// `ROLLBACK TO SAVEPOINT` (of the same tag), whatever its name.
fn chains(statement: &[u8]) -> bool {
    let (mut last, mut before) = (&[][..], &[][..]);
    for word in words(statement) {
        (before, last) = (last, word);
    }
    before.eq_ignore_ascii_case(b"and") && last.eq_ignore_ascii_case(b"chain")
}

/// The words of a statement, past blanks and comments: names and keywords
/// (a quoted name or a literal is skipped whole, and counts as no word).
fn words(statement: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut at = 0;
    std::iter::from_fn(move || loop {
        at = past_blanks_and_comments(statement, at);
        let start = at;
        match statement.get(at)? {
            b'\'' | b'"' => at = past_quoted(statement, at, false),
            &b if names(b) => {
                at += statement[at..]
                    .iter()
                    .position(|b| !names(*b))
                    .unwrap_or(statement.len() - at);
                return Some(&statement[start..at]);
            }
            _ => at += 1,
        }
    })
}

/// One reading of a text's statements (see [`Says::of`]).
struct Reading {
    chain: bool,
    commit: bool,
    commit_end: bool,
    ends: bool,
    rollback_only: bool,
}

impl Reading {
    /// `backslashes`: whether a plain literal takes backslash escapes.
    fn of(text: &[u8], backslashes: bool) -> Reading {
        let mut reading = Reading {
            chain: false,
            commit: false,
            commit_end: false,
            ends: false,
            rollback_only: true,
        };
        let (mut at, mut any, mut outside) = (0, false, false);
        loop {
            let semicolon = next_semicolon(text, at, backslashes);
            let statement = &text[at..semicolon.unwrap_or(text.len())];
            let [first, second, third] = first_words(statement);
            if !first.is_empty() {
                any = true;
                let is = |word: &[u8], w: &str| word.eq_ignore_ascii_case(w.as_bytes());
                let to = is(second, "to")
                    || (is(second, "work") || is(second, "transaction")) && is(third, "to");
                let rollback = is(first, "abort") || is(first, "rollback") && !to;
                let commits = is(first, "commit") || is(first, "end") || is(first, "prepare");
                reading.commit |= commits || outside && !rollback;
                reading.commit_end |= commits;
                let prepares_a_statement = is(first, "prepare") && !is(second, "transaction");
                reading.ends |= rollback || commits && !prepares_a_statement;
                reading.rollback_only &= rollback;
                // Only an end chains: read only there (every request's text
                // passes here), and a name elsewhere (`WHERE a AND chain`)
                // never hides what runs after a `ROLLBACK`.
                let chains = (rollback || commits) && chains(statement);
                reading.chain |= chains;
                outside |= rollback && !chains;
            }
            match semicolon {
                Some(semicolon) => at = semicolon + 1,
                None => break,
            }
        }
        reading.rollback_only &= any;
        reading
    }
}

/// The first three words of a statement, past blanks and comments (empty
/// where there are fewer).
fn first_words(statement: &[u8]) -> [&[u8]; 3] {
    let mut words: [&[u8]; 3] = [&[]; 3];
    let mut at = 0;
    for word in &mut words {
        at = past_blanks_and_comments(statement, at);
        let end = statement[at..]
            .iter()
            .position(|b| !names(*b))
            .map_or(statement.len(), |n| at + n);
        *word = &statement[at..end];
        at = end;
    }
    words
}

/// Whether PostgreSQL reads `b` as part of a name or keyword.
fn names(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b'$' || !b.is_ascii()
}

/// Where the blanks and comments from `at` end.
fn past_blanks_and_comments(text: &[u8], mut at: usize) -> usize {
    loop {
        // A vertical tab too, a blank to PostgreSQL 16 and later (an
        // error before, where reading on costs nothing).
        while text
            .get(at)
            .is_some_and(|b| b.is_ascii_whitespace() || *b == 0x0b)
        {
            at += 1;
        }
        match text.get(at..at + 2) {
            Some(b"--") | Some(b"/*") => at = past_comment(text, at),
            _ => return at,
        }
    }
}

/// The next `;` from `at` that ends a statement.
fn next_semicolon(text: &[u8], mut at: usize, backslashes: bool) -> Option<usize> {
    while let Some(&b) = text.get(at) {
        at = match b {
            b';' => return Some(at),
            b'-' | b'/' if matches!(text.get(at..at + 2), Some(b"--") | Some(b"/*")) => {
                past_comment(text, at)
            }
            b'\'' => {
                let escaped = at > 0
                    && text[at - 1].eq_ignore_ascii_case(&b'e')
                    && (at < 2 || !names(text[at - 2]));
                past_quoted(text, at, backslashes || escaped)
            }
            b'"' => past_quoted(text, at, false),
            // A dollar quote opens where a name does not go on.
            b'$' if at == 0 || !names(text[at - 1]) => past_dollar_quoted(text, at),
            _ => at + 1,
        };
    }
    None
}

/// Where the comment at `at` ends: `--` at the end of the line (a `\n` or
/// a `\r`, as PostgreSQL reads it), `/* .. */` nested as PostgreSQL nests
/// them (the end of the text when it is not closed).
fn past_comment(text: &[u8], at: usize) -> usize {
    if text[at] == b'-' {
        return text[at..]
            .iter()
            .position(|b| matches!(b, b'\n' | b'\r'))
            .map_or(text.len(), |n| at + n);
    }
    let mut depth = 0_usize;
    let mut i = at;
    while i + 1 < text.len() {
        match &text[i..i + 2] {
            b"/*" => {
                depth += 1;
                i += 2;
            }
            b"*/" => {
                depth -= 1;
                i += 2;
                if depth == 0 {
                    return i;
                }
            }
            _ => i += 1,
        }
    }
    text.len()
}

/// Where the literal or quoted name opened by the quote at `at` ends (a
/// doubled quote stays inside; with `backslashes`, so does `\` and what it
/// escapes).
fn past_quoted(text: &[u8], at: usize, backslashes: bool) -> usize {
    let quote = text[at];
    let mut i = at + 1;
    while let Some(&b) = text.get(i) {
        let escape = backslashes && b == b'\\';
        if escape || (b == quote && text.get(i + 1) == Some(&quote)) {
            i += 2;
        } else if b == quote {
            return i + 1;
        } else {
            i += 1;
        }
    }
    text.len()
}

/// Where the dollar-quoted literal at `at` ends, if a tag (`$$`, `$tag$`)
/// opens one there; else just past the `$` (a parameter, `$1`).
fn past_dollar_quoted(text: &[u8], at: usize) -> usize {
    let tag_len = text[at + 1..]
        .iter()
        .position(|b| !(names(*b) && *b != b'$'))
        .map_or(text.len() - at - 1, |n| n);
    let starts_with_digit = text.get(at + 1).is_some_and(u8::is_ascii_digit);
    if starts_with_digit || text.get(at + 1 + tag_len) != Some(&b'$') {
        return at + 1;
    }
    let tag = &text[at..at + tag_len + 2];
    let body = at + tag.len();
    text[body..]
        .windows(tag.len())
        .position(|w| w == tag)
        .map_or(text.len(), |n| body + n + tag.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_that_may_commit_are_read_so() {
        for text in [
            "COMMIT",
            "commit",
            "  END",
            "end transaction",
            "COMMIT AND CHAIN",
            "PREPARE TRANSACTION 'x'",
            "SELECT 1; COMMIT",
            "SELECT 1;COMMIT;SELECT 2",
            "-- a comment\nCOMMIT",
            "/* a /* nested */ comment */ COMMIT",
            "/**/commit",
            "\tEnd Work",
            "SELECT CASE WHEN true THEN 1 END; END",
            // Found by hostile passes: PostgreSQL ends `--` at `\r` too; a
            // `;` in a comment ends nothing; a `--` or `/*` in a literal or
            // a quoted name opens no comment.
            "-- x\rCOMMIT",
            "-- x\rEND",
            "/* x ; */COMMIT",
            "/* x ; */END",
            "SELECT 1 /* ; */; END",
            "SELECT 'x --'; END",
            "SELECT '/static/*' AS b; END",
            "SELECT $$x --$$; END",
            "SELECT $tag$ ; -- $tag$; END",
            "SELECT 1 AS \"x /*\"; END",
            "SELECT 'it''s -- fine'; COMMIT",
            "SELECT E'x\\' --'; COMMIT",
            // With `standard_conforming_strings` on, 'x\' ends at its quote.
            "SELECT 'x\\'; COMMIT; --'",
            "SELECT $1; COMMIT",
        ] {
            assert!(Says::of(text.as_bytes()).commit, "{text:?}");
        }
    }

    #[test]
    fn other_statements_are_not() {
        for text in [
            "SELECT 1",
            "SELECT CASE WHEN true THEN 1 END",
            "SELECT CASE WHEN true THEN 1 END; SELECT 2",
            "INSERT INTO commits VALUES (1)",
            "SELECT committed, commit_sha, precommit FROM t",
            "SELECT pg_sleep(30), 'pre-commit check'",
            "SELECT pg_sleep(30) AS prepare",
            "INSERT INTO t VALUES (1) /* commit */",
            "-- COMMIT\nSELECT 1",
            "/* COMMIT */ SELECT 1",
            "SELECT 'a; COMMIT'",
            "SELECT $$; END$$",
            "SELECT $q$; END $q$",
            "SELECT \"x; commit\"",
            "SELECT E'a\\'; COMMIT'",
            "ROLLBACK",
            "ROLLBACK TO SAVEPOINT a",
            "RELEASE SAVEPOINT a",
            "SAVEPOINT commit_point",
            "SELECT 1 -- ; END",
            "SELECT 1 /* ; END */",
            "SELECT ending FROM t; SELECT endless",
            "SELECT a$b$c FROM t; SELECT 2",
            "",
        ] {
            assert!(!Says::of(text.as_bytes()).commit, "{text:?}");
        }
    }

    #[test]
    fn a_statement_after_a_rollback_in_the_same_text_may_commit() {
        for text in [
            "ROLLBACK; INSERT INTO t VALUES (1)",
            "abort; SELECT f()",
            "ROLLBACK WORK; UPDATE t SET a = 1",
            "/* x */ ROLLBACK /* ; */; DELETE FROM t",
        ] {
            assert!(Says::of(text.as_bytes()).commit, "{text:?}");
        }
        for text in [
            "ROLLBACK AND CHAIN; INSERT INTO t VALUES (1)",
            "ROLLBACK TO SAVEPOINT a; INSERT INTO t VALUES (1)",
            "ROLLBACK TRANSACTION TO a; INSERT INTO t VALUES (1)",
            "ROLLBACK; ROLLBACK",
        ] {
            assert!(!Says::of(text.as_bytes()).commit, "{text:?}");
        }
    }

    #[test]
    fn ends_and_lone_rollbacks_are_told() {
        let says = |text: &str| Says::of(text.as_bytes());
        for text in [
            "COMMIT",
            "end",
            "PREPARE TRANSACTION 'x'",
            "ROLLBACK",
            "rollback work",
            "ABORT",
            "ROLLBACK AND CHAIN",
            "SELECT 1; ROLLBACK",
        ] {
            assert!(says(text).ends, "{text:?}");
        }
        for text in [
            "ROLLBACK TO SAVEPOINT a",
            "rollback to a",
            "ROLLBACK WORK TO SAVEPOINT a",
            "PREPARE p AS SELECT 1",
            "SAVEPOINT a",
            "RELEASE SAVEPOINT a",
            "SELECT 'ROLLBACK'",
            "BEGIN",
        ] {
            assert!(!says(text).ends, "{text:?}");
        }
        for text in [
            "ROLLBACK",
            " abort ",
            "ROLLBACK; ROLLBACK",
            "ROLLBACK AND CHAIN",
        ] {
            assert!(says(text).rollback_only, "{text:?}");
        }
        for text in [
            "",
            "ROLLBACK; SELECT 1",
            "ROLLBACK TO SAVEPOINT a",
            "COMMIT",
            "SELECT 'x\\'; ROLLBACK; --'",
        ] {
            assert!(!says(text).rollback_only, "{text:?}");
        }
    }

    #[test]
    fn chain_is_read_as_before() {
        assert!(Says::of(b"ROLLBACK AND CHAIN").chain);
        assert!(!Says::of(b"ROLLBACK").chain);
    }

    #[test]
    fn only_and_chain_chains() {
        for text in [
            "rollback and chain",
            "ABORT WORK AND /* c */ CHAIN -- x",
            "COMMIT TRANSACTION AND\tCHAIN",
            "SELECT 1; ROLLBACK AND CHAIN",
        ] {
            assert!(Says::of(text.as_bytes()).chain, "{text:?}");
        }
        // Each of these ends the transaction for good: what follows runs
        // outside any, and commits on its own.
        for text in [
            "ROLLBACK AND NO CHAIN; INSERT INTO t VALUES (1)",
            "ROLLBACK WORK AND NO CHAIN; INSERT INTO t VALUES (1)",
            "ABORT AND NO CHAIN; INSERT INTO t VALUES (1)",
            "ROLLBACK /* break the chain */; INSERT INTO t VALUES (1)",
            "ROLLBACK -- chain\n; INSERT INTO t VALUES (1)",
            "ROLLBACK;\x0bINSERT INTO t VALUES (1)",
        ] {
            let says = Says::of(text.as_bytes());
            assert!(!says.chain && says.commit, "{text:?}");
        }
        assert!(!Says::of(b"ROLLBACK TO SAVEPOINT chain").chain);
        assert!(!Says::of(b"SELECT 1 FROM t WHERE a AND chain; ROLLBACK").chain);
        assert!(!Says::of(b"ROLLBACK TO \"and\" ").chain);
    }
}
