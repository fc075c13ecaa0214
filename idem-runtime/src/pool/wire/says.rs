//! What a statement's text says about the transaction, as far as the wire
//! must know before its answer: read from a `Query`'s text or a `Parse`'s,
//! never parsed as SQL. Each reading errs towards "said" (a word in a
//! literal or a comment reads as said), which makes a call say more was
//! committed, never less; the one exception is named at [`may_commit`].

/// What the statements of a request may do to the transaction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Says {
    /// A statement names `CHAIN` (see [`names_chain`]).
    pub(crate) chain: bool,
    /// A statement may commit (see [`may_commit`]).
    pub(crate) commit: bool,
}

impl Says {
    /// What `text` (one or more statements) says.
    pub(super) fn of(text: &[u8]) -> Says {
        Says {
            chain: names_chain(text),
            commit: may_commit(text),
        }
    }

    /// Whether it says anything at all.
    pub(super) fn any(self) -> bool {
        self.chain || self.commit
    }
}

impl std::ops::BitOrAssign for Says {
    fn bitor_assign(&mut self, other: Says) {
        self.chain |= other.chain;
        self.commit |= other.commit;
    }
}

/// Whether a statement's text holds the word `chain`, in any case: what
/// `ROLLBACK AND CHAIN` (or `ABORT AND CHAIN`) must say, and what a
/// `ROLLBACK TO SAVEPOINT` of the same tag does not, unless a name in the
/// same request says it too (then a savepoint's rollback is taken for the
/// transaction's end: the call fails, nothing commits).
fn names_chain(text: &[u8]) -> bool {
    text.windows(5).any(|w| w.eq_ignore_ascii_case(b"chain"))
}

/// Whether a statement of `text` may commit the transaction: the word
/// `COMMIT` or `PREPARE` (`PREPARE TRANSACTION`) anywhere, in any case, as
/// a word of its own (also in a literal, a comment or a quoted name); or a
/// statement beginning, after blanks and comments, with `END`. `END` ends
/// every `CASE` too, so only a statement's first word counts; statements
/// are told apart at every `;` outside a comment, also one inside a
/// literal. The exception: an `END` statement behind a literal that holds
/// `--` or `/*` is not recognised (the comment is read as opening there).
///
/// For a request whose answer idem stops waiting for (a future the body
/// dropped, still running at `COMMIT`), or that a closed connection left
/// unanswered: cancelling it and closing the connection rolls the
/// transaction back, unless it was a commit, which the server may run
/// before it sees the connection end.
fn may_commit(text: &[u8]) -> bool {
    has_word(text, b"commit") || has_word(text, b"prepare") || {
        let mut rest = text;
        loop {
            let (first, after) = first_word(rest);
            if first.eq_ignore_ascii_case(b"end") {
                break true;
            }
            match next_statement(after) {
                Some(next) => rest = next,
                None => break false,
            }
        }
    }
}

/// Whether `word` stands in `text` as a word of its own: no letter, digit,
/// `_`, `$` or non-ASCII byte (which PostgreSQL reads as part of a name)
/// right before or after it.
fn has_word(text: &[u8], word: &[u8]) -> bool {
    let part = |b: &u8| b.is_ascii_alphanumeric() || *b == b'_' || *b == b'$' || !b.is_ascii();
    (0..text.len().saturating_sub(word.len() - 1)).any(|at| {
        text[at..at + word.len()].eq_ignore_ascii_case(word)
            && (at == 0 || !part(&text[at - 1]))
            && text.get(at + word.len()).is_none_or(|b| !part(b))
    })
}

/// What follows the next `;` outside a comment, if any.
fn next_statement(mut text: &[u8]) -> Option<&[u8]> {
    loop {
        match text {
            [] => return None,
            [b';', rest @ ..] => return Some(rest),
            [b'-', b'-', ..] | [b'/', b'*', ..] => text = past_comment(text),
            [_, rest @ ..] => text = rest,
        }
    }
}

/// The first word of a statement, past blanks and comments, and what
/// follows it.
fn first_word(mut text: &[u8]) -> (&[u8], &[u8]) {
    loop {
        text = text.trim_ascii_start();
        if text.starts_with(b"--") || text.starts_with(b"/*") {
            text = past_comment(text);
        } else {
            let end = text
                .iter()
                .position(|b| !(b.is_ascii_alphanumeric() || *b == b'_'))
                .unwrap_or(text.len());
            return text.split_at(end);
        }
    }
}

/// What follows the comment `text` begins with: `--` to the end of the
/// line (a `\n` or a `\r`, as PostgreSQL reads it), `/* .. */` nested as
/// PostgreSQL nests them (nothing when it is not closed).
fn past_comment(text: &[u8]) -> &[u8] {
    match text.strip_prefix(b"--") {
        Some(rest) => {
            let end = rest
                .iter()
                .position(|b| matches!(b, b'\n' | b'\r'))
                .unwrap_or(rest.len());
            &rest[end..]
        }
        None => past_block_comment(text),
    }
}

/// What follows the block comment `text` begins with (nothing when it is
/// not closed).
fn past_block_comment(text: &[u8]) -> &[u8] {
    let mut depth = 0_usize;
    let mut at = 0;
    while at + 1 < text.len() {
        match &text[at..at + 2] {
            b"/*" => {
                depth += 1;
                at += 2;
            }
            b"*/" => {
                depth -= 1;
                at += 2;
                if depth == 0 {
                    return &text[at..];
                }
            }
            _ => at += 1,
        }
    }
    &[]
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
            // Found by a hostile pass: PostgreSQL ends `--` at `\r` too, and
            // a `;` in a comment does not end a statement.
            "-- x\rCOMMIT",
            "-- x\rEND",
            "/* x ; */COMMIT",
            "/* x ; */END",
            "SELECT 1 /* ; */; END",
            // Read as said, erring towards "committed".
            "-- COMMIT\nSELECT 1",
            "/* COMMIT */ SELECT 1",
            "/* unclosed COMMIT",
            "SELECT ';commit'",
            "SELECT 'x'; end",
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
            "ROLLBACK",
            "ROLLBACK TO SAVEPOINT a",
            "RELEASE SAVEPOINT a",
            "SAVEPOINT commit_point",
            "SELECT pg_sleep(3)",
            "SELECT 1 -- ; END",
            "SELECT 1 /* ; END */",
            "SELECT ending FROM t; SELECT endless",
            "",
        ] {
            assert!(!Says::of(text.as_bytes()).commit, "{text:?}");
        }
    }

    #[test]
    fn chain_is_read_as_before() {
        assert!(Says::of(b"ROLLBACK AND CHAIN").chain);
        assert!(!Says::of(b"ROLLBACK").chain);
    }
}
