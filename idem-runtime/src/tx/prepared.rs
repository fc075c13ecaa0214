//! Statements that ride on `BEGIN` and `COMMIT`, prepared once per session.
//!
//! What rides on them is simple-query text (see [`super::pipeline`]), which
//! PostgreSQL parses and plans at every call: for local mode's read of its
//! record that cost more than the round trip it saves (pgbench here: 0.1
//! to 0.2 of the bare handler). So each statement is an SQL `PREPARE`d one:
//! its first use on a connection writes `PREPARE name(..) AS ..;` in front
//! of the call, every use `EXECUTE name(literals)`, which the server runs
//! from its kept plan. The connection's wire counts a statement prepared
//! once the server answered its `PREPARE` (a later failure in the same
//! message does not undo it), and forgets them all at a `DEALLOCATE` or
//! `DISCARD ALL` (a body's own, say): the tag does not say which statement
//! went, so all are prepared again, under names with a new generation
//! (`idem_lock_v1_g1`), which none left over can hold. So it does at an
//! `EXECUTE` of a statement the session lost unseen (26000: dropped inside
//! a function) and at a `PREPARE` of a name the application took (42P05);
//! the call then goes round once more (see `crate::idempotency`'s call).
//!
//! Behind a transaction pooler a session's prepared statements are not this
//! client's (the next transaction may run on another server connection):
//! there the statement is written out whole, its parameters replaced by the
//! literals, and planned at every call.

use crate::pool::Wire;

/// A statement to prepare: its name (`idem_` and a version, so that no
/// application's statement and no other release's text shares it), its
/// parameter types, and its text with `$1`, `$2`, .. for them.
pub(crate) struct Prepared {
    pub(crate) name: &'static str,
    pub(crate) types: &'static str,
    pub(crate) text: &'static str,
}

/// How the statements of one ride reach the server, on one connection.
pub(crate) struct Session<'w> {
    wire: &'w Wire,
    /// Prepared in this ride, to be counted once their `PREPARE` is answered.
    preparing: Vec<&'static str>,
}

impl<'w> Session<'w> {
    pub(crate) fn new(wire: &'w Wire) -> Self {
        Session {
            wire,
            preparing: Vec::new(),
        }
    }

    /// Write a call of `statement` with `args` (literals, one per
    /// parameter) to `out`.
    pub(crate) fn call(&mut self, statement: &Prepared, args: &[&str], out: &mut String) {
        if !self.wire.keeps_session_statements() {
            substitute(statement.text, args, out);
            return;
        }
        let (prepared, generation) = self.wire.prepared(statement.name);
        let name = |out: &mut String| {
            out.push_str(statement.name);
            if generation > 0 {
                out.push_str("_g");
                out.push_str(&generation.to_string());
            }
        };
        if !prepared && !self.preparing.contains(&statement.name) {
            out.push_str("PREPARE ");
            name(out);
            out.push('(');
            out.push_str(statement.types);
            out.push_str(") AS ");
            out.push_str(statement.text);
            out.push_str("; ");
            self.preparing.push(statement.name);
        }
        out.push_str("EXECUTE ");
        name(out);
        out.push('(');
        for (i, arg) in args.iter().enumerate() {
            if i > 0 {
                out.push_str(", ");
            }
            out.push_str(arg);
        }
        out.push(')');
    }

    /// The statements this ride prepares, in the order it prepares them.
    pub(crate) fn preparing(self) -> Vec<&'static str> {
        self.preparing
    }
}

/// `text` with each `$n` replaced by `args[n - 1]`. Only idem's own
/// statement texts come here: no `$` but their parameters.
fn substitute(text: &str, args: &[&str], out: &mut String) {
    let mut rest = text;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let digits = rest[at + 1..]
            .find(|c: char| !c.is_ascii_digit())
            .map_or(rest.len() - at - 1, |n| n);
        let n: usize = rest[at + 1..at + 1 + digits]
            .parse()
            .expect("idem's statement texts number their parameters");
        out.push_str(args[n - 1]);
        rest = &rest[at + 1 + digits..];
    }
    out.push_str(rest);
}

#[cfg(test)]
mod tests {
    use super::*;

    const READ: Prepared = Prepared {
        name: "idem_test_read_v1",
        types: "text, bigint",
        text: "SELECT $1, $2, $10 FROM t WHERE a = $1",
    };

    #[test]
    fn a_statement_is_prepared_once_then_executed() {
        let wire = Wire::new(true);
        let args: Vec<String> = (1..=10).map(|n| n.to_string()).collect();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut session = Session::new(&wire);
        let mut out = String::new();
        session.call(&READ, &args[..2], &mut out);
        out.push_str("; ");
        session.call(&READ, &args[..2], &mut out);
        assert_eq!(
            out,
            "PREPARE idem_test_read_v1(text, bigint) AS SELECT $1, $2, $10 FROM t WHERE a = $1; \
             EXECUTE idem_test_read_v1(1, 2); EXECUTE idem_test_read_v1(1, 2)"
        );
        assert_eq!(session.preparing(), vec!["idem_test_read_v1"]);
    }

    #[test]
    fn after_a_deallocate_the_names_carry_a_new_generation() {
        let wire = Wire::new(true);
        wire.forget_prepared_for_test();
        let mut out = String::new();
        Session::new(&wire).call(&READ, &["'a'", "2"], &mut out);
        assert!(
            out.starts_with("PREPARE idem_test_read_v1_g1(text, bigint) AS ")
                && out.ends_with("; EXECUTE idem_test_read_v1_g1('a', 2)"),
            "{out}"
        );
    }

    #[test]
    fn behind_a_transaction_pooler_the_text_is_written_out() {
        let wire = Wire::new(false);
        let mut out = String::new();
        let args = ["'x'", "2", "3", "4", "5", "6", "7", "8", "9", "'ten'"];
        Session::new(&wire).call(&READ, &args, &mut out);
        assert_eq!(out, "SELECT 'x', 2, 'ten' FROM t WHERE a = 'x'");
    }
}
