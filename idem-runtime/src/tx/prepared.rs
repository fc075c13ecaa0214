//! Statements that ride on `BEGIN` and `COMMIT`, as extended-protocol
//! messages, prepared once per session.
//!
//! What rides is written in the protocol's extended form (see
//! [`super::pipeline`]): each statement a `Bind` of its parameters and an
//! `Execute`, the whole ended by one `Sync`. A simple query's SQL
//! `EXECUTE name(literals)` cost the server about as much again as the
//! statement itself (a second parse, a second portal): measured here, the
//! extended form of the same lock and read cost 0 to 3 µs over a bare
//! `BEGIN`, the simple query's 17 to 30. Values go as parameters, never
//! into SQL text.
//!
//! `BEGIN` and its bounds, which the replaced query sent as SQL text, are
//! prepared statements of idem's too (a `Parse` of each at every call cost
//! the server more than their execution).
//!
//! Each of idem's statements is `Parse`d under its name the first time a
//! connection sends it. The connection's wire counts it prepared once the
//! server answers that `Parse` (a later failure in the same message does
//! not undo it), and forgets them all at a `DEALLOCATE` or `DISCARD ALL` (a
//! body's own, say): the tag does not say which statement went, so all are
//! prepared again, under names with a new generation (`idem_lock_v1_g1`),
//! which none left over can hold. So it does when a `Bind` names a
//! statement the session lost unseen (26000: dropped inside a function) and
//! at a `Parse` of a name the application took (42P05); the call then goes
//! round once more (see `crate::idempotency`'s call).
//!
//! Behind a transaction pooler a session's prepared statements are not this
//! client's (the next transaction may run on another server connection):
//! there each statement is `Parse`d unnamed at every call.

use diesel::result::Error as DieselError;
use diesel::QueryResult;

use crate::pool::Wire;

/// A statement to prepare: its name (`idem_` and a version, so that no
/// application's statement and no other release's text shares it), and its
/// text with `$1`, `$2`, .. for its parameters, each of a type the text
/// fixes (a cast, or the column it is compared with or written to).
pub(crate) struct Prepared {
    pub(crate) name: &'static str,
    pub(crate) text: &'static str,
}

/// The messages of one ride, on one connection: statements, each parsed
/// (when it must be), bound and executed, in order.
pub(crate) struct Session<'w> {
    wire: &'w Wire,
    out: Vec<u8>,
    /// One per `Parse` written, in order: the statement it prepares under
    /// its name (none for an unnamed one), counted once it is answered.
    parses: Vec<Option<&'static str>>,
    statements: usize,
}

impl<'w> Session<'w> {
    pub(crate) fn new(wire: &'w Wire) -> Self {
        Session {
            wire,
            out: Vec::with_capacity(512),
            parses: Vec::new(),
            statements: 0,
        }
    }

    /// A statement of idem's own text with no parameter (`BEGIN ..`,
    /// `SET LOCAL ..`, `COMMIT`), parsed unnamed.
    pub(crate) fn plain(&mut self, sql: &str) {
        self.parse("", sql, None);
        self.bind_execute("", &[]);
    }

    /// A call of `statement` with `args`, one per parameter in PostgreSQL's
    /// text form (`None`: NULL). Refused, with nothing written, when an
    /// argument holds a NUL character, which no text value can.
    pub(crate) fn call(&mut self, statement: &Prepared, args: &[Option<&[u8]>]) -> QueryResult<()> {
        if args.iter().flatten().any(|arg| arg.contains(&0)) {
            return Err(DieselError::SerializationError(
                "idem: a value sent with BEGIN or COMMIT contains a NUL character".into(),
            ));
        }
        if !self.wire.keeps_session_statements() {
            self.parse("", statement.text, None);
            self.bind_execute("", args);
            return Ok(());
        }
        let (prepared, generation) = self.wire.prepared(statement.name);
        let name = match generation {
            0 => statement.name.to_owned(),
            n => format!("{}_g{n}", statement.name),
        };
        if !prepared && !self.parses.contains(&Some(statement.name)) {
            self.parse(&name, statement.text, Some(statement.name));
        }
        self.bind_execute(&name, args);
        Ok(())
    }

    /// The messages, ended by a `Sync`, and what their `Parse`s prepare.
    pub(crate) fn finish(mut self) -> (Vec<u8>, Vec<Option<&'static str>>) {
        message(&mut self.out, b'S', |_| {});
        (self.out, self.parses)
    }

    /// How many statements were written so far.
    pub(crate) fn statements(&self) -> usize {
        self.statements
    }

    fn parse(&mut self, name: &str, text: &str, prepares: Option<&'static str>) {
        message(&mut self.out, b'P', |body| {
            cstring(body, name.as_bytes());
            cstring(body, text.as_bytes());
            // No parameter type given: the text fixes each.
            body.extend_from_slice(&0u16.to_be_bytes());
        });
        self.parses.push(prepares);
    }

    fn bind_execute(&mut self, statement: &str, args: &[Option<&[u8]>]) {
        message(&mut self.out, b'B', |body| {
            cstring(body, b"");
            cstring(body, statement.as_bytes());
            // Parameters and results all in text form.
            body.extend_from_slice(&0u16.to_be_bytes());
            body.extend_from_slice(&(args.len() as u16).to_be_bytes());
            for arg in args {
                match arg {
                    Some(value) => {
                        body.extend_from_slice(&(value.len() as i32).to_be_bytes());
                        body.extend_from_slice(value);
                    }
                    None => body.extend_from_slice(&(-1i32).to_be_bytes()),
                }
            }
            body.extend_from_slice(&0u16.to_be_bytes());
        });
        message(&mut self.out, b'E', |body| {
            cstring(body, b"");
            // No row limit.
            body.extend_from_slice(&0u32.to_be_bytes());
        });
        self.statements += 1;
    }
}

/// A frontend message of type `kind`: its length, counting itself, then the
/// body `write` appends.
fn message(out: &mut Vec<u8>, kind: u8, write: impl FnOnce(&mut Vec<u8>)) {
    out.push(kind);
    let at = out.len();
    out.extend_from_slice(&[0; 4]);
    write(out);
    let len = (out.len() - at) as u32;
    out[at..at + 4].copy_from_slice(&len.to_be_bytes());
}

fn cstring(out: &mut Vec<u8>, text: &[u8]) {
    out.extend_from_slice(text);
    out.push(0);
}

#[cfg(test)]
mod tests {
    use super::*;

    const READ: Prepared = Prepared {
        name: "idem_test_read_v1",
        text: "SELECT $1, $2::int8 FROM t WHERE a = $1",
    };

    /// The messages' types and, for `Parse` and `Bind`, their statement's name.
    fn shape(messages: &[u8]) -> Vec<String> {
        let mut out = Vec::new();
        let mut rest = messages;
        while let Some(&kind) = rest.first() {
            let len = u32::from_be_bytes(rest[1..5].try_into().unwrap()) as usize;
            let body = &rest[5..1 + len];
            let name = |body: &[u8]| {
                let end = body.iter().position(|&b| b == 0).unwrap();
                String::from_utf8(body[..end].to_vec()).unwrap()
            };
            out.push(match kind {
                b'P' => format!("P {}", name(body)),
                b'B' => {
                    let portal = name(body).len();
                    format!("B {}", name(&body[portal + 1..]))
                }
                other => (other as char).to_string(),
            });
            rest = &rest[1 + len..];
        }
        out
    }

    #[test]
    fn a_statement_is_prepared_once_then_bound() {
        let wire = Wire::new(true);
        let mut session = Session::new(&wire);
        session.plain("BEGIN");
        session.call(&READ, &[Some(b"x"), Some(b"2")]).unwrap();
        session.call(&READ, &[Some(b"y"), None]).unwrap();
        assert_eq!(session.statements(), 3);
        let (messages, parses) = session.finish();
        assert_eq!(
            shape(&messages),
            [
                "P ",
                "B ",
                "E",
                "P idem_test_read_v1",
                "B idem_test_read_v1",
                "E",
                "B idem_test_read_v1",
                "E",
                "S"
            ]
        );
        assert_eq!(parses, [None, Some("idem_test_read_v1")]);
    }

    #[test]
    fn after_a_deallocate_the_names_carry_a_new_generation() {
        let wire = Wire::new(true);
        wire.forget_prepared_for_test();
        let mut session = Session::new(&wire);
        session.call(&READ, &[Some(b"a"), Some(b"2")]).unwrap();
        let (messages, _) = session.finish();
        assert_eq!(
            shape(&messages),
            ["P idem_test_read_v1_g1", "B idem_test_read_v1_g1", "E", "S"]
        );
    }

    #[test]
    fn behind_a_transaction_pooler_each_call_is_parsed_unnamed() {
        let wire = Wire::new(false);
        let mut session = Session::new(&wire);
        session.call(&READ, &[Some(b"x"), Some(b"2")]).unwrap();
        let (messages, parses) = session.finish();
        assert_eq!(shape(&messages), ["P ", "B ", "E", "S"]);
        assert_eq!(parses, [None]);
    }

    #[test]
    fn a_nul_in_a_value_is_refused_before_anything_is_written() {
        let wire = Wire::new(true);
        let mut session = Session::new(&wire);
        assert!(session.call(&READ, &[Some(b"a\0b"), None]).is_err());
        assert_eq!(session.statements(), 0);
        assert_eq!(shape(&session.finish().0), ["S"]);
    }
}
