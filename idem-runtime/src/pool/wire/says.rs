//! What a statement's text says about the transaction, as far as the wire
//! must know before its answer: read from a `Query`'s text or a `Parse`'s,
//! never parsed as SQL. Either reading errs only one way (a word in a
//! literal or a name reads as said), which makes a call say more was
//! committed, never less.

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

/// Whether a statement of `text` may commit the transaction: one that
/// begins (after blanks and comments) with `COMMIT`, `END` or `PREPARE`
/// (`PREPARE TRANSACTION`, and `PREPARE name AS ..` too, which commits
/// nothing). Statements are told apart at every `;`, also one inside a
/// literal: more statements are read, never fewer.
///
/// For a request whose answer idem stops waiting for (a future the body
/// dropped, still running at `COMMIT`): cancelling it and closing the
/// connection rolls the transaction back, unless it was a commit, which the
/// server may run before it sees the connection end.
fn may_commit(text: &[u8]) -> bool {
    text.split(|b| *b == b';').any(|statement| {
        let first = first_word(statement);
        [&b"commit"[..], b"end", b"prepare"]
            .iter()
            .any(|word| first.eq_ignore_ascii_case(word))
    })
}

/// The first word of a statement, past blanks and comments (`--` to the end
/// of the line, `/* .. */` nested as PostgreSQL nests them).
fn first_word(mut text: &[u8]) -> &[u8] {
    loop {
        text = text.trim_ascii_start();
        if let Some(rest) = text.strip_prefix(b"--") {
            let end = rest.iter().position(|b| *b == b'\n').unwrap_or(rest.len());
            text = &rest[end..];
        } else if text.starts_with(b"/*") {
            text = past_block_comment(text);
        } else {
            let end = text
                .iter()
                .position(|b| !(b.is_ascii_alphanumeric() || *b == b'_'))
                .unwrap_or(text.len());
            return &text[..end];
        }
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
        ] {
            assert!(Says::of(text.as_bytes()).commit, "{text:?}");
        }
    }

    #[test]
    fn other_statements_are_not() {
        for text in [
            "SELECT 1",
            "SELECT CASE WHEN true THEN 1 END",
            "INSERT INTO commits VALUES (1)",
            "ROLLBACK",
            "ROLLBACK TO SAVEPOINT a",
            "RELEASE SAVEPOINT a",
            "SAVEPOINT commit_point",
            "SELECT pg_sleep(3)",
            "-- COMMIT\nSELECT 1",
            "/* COMMIT */ SELECT 1",
            "/* unclosed COMMIT",
            "",
        ] {
            assert!(!Says::of(text.as_bytes()).commit, "{text:?}");
        }
    }

    #[test]
    fn a_semicolon_in_a_literal_reads_as_more_statements() {
        assert!(Says::of(b"SELECT ';commit'").commit);
    }

    #[test]
    fn chain_is_read_as_before() {
        assert!(Says::of(b"ROLLBACK AND CHAIN").chain);
        assert!(!Says::of(b"ROLLBACK").chain);
    }
}
