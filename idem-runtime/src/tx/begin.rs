//! What a transaction's `BEGIN` says: its isolation level and its bounds
//! ([`Timeouts`]), as SQL text, or as prepared statements when statements
//! ride on it (see [`super::pipeline`]).

use std::time::Duration;

use diesel::QueryResult;

use super::{Prepared, Session};
use crate::cause::Bounds;

/// The isolation level each attempt's transaction begins with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Isolation {
    /// PostgreSQL's default. Lost updates are prevented by versioned writes
    /// (which come back `Stale`) or row locks, not by the isolation level.
    #[default]
    ReadCommitted,
    /// One snapshot for the whole transaction; a concurrent update of a row it
    /// writes raises 40001.
    RepeatableRead,
    /// Serializable snapshot isolation; write skew raises 40001.
    Serializable,
}

impl Isolation {
    pub(crate) fn begin_sql(self) -> &'static str {
        self.begin_statement().text
    }

    /// `BEGIN` as a statement prepared when statements ride on it.
    fn begin_statement(self) -> &'static Prepared {
        &BEGIN_STATEMENTS[match self {
            Isolation::ReadCommitted => 0,
            Isolation::RepeatableRead => 1,
            Isolation::Serializable => 2,
        }]
    }
}

const BEGIN_STATEMENTS: [Prepared; 3] = [
    Prepared {
        name: "idem_begin_read_committed_v1",
        text: "BEGIN ISOLATION LEVEL READ COMMITTED",
    },
    Prepared {
        name: "idem_begin_repeatable_read_v1",
        text: "BEGIN ISOLATION LEVEL REPEATABLE READ",
    },
    Prepared {
        name: "idem_begin_serializable_v1",
        text: "BEGIN ISOLATION LEVEL SERIALIZABLE",
    },
];

/// [`Timeouts`] as one prepared statement: `set_config(.., true)` is
/// `SET LOCAL`, which takes no parameter.
const BOUNDS: Prepared = Prepared {
    name: "idem_bounds_v1",
    text: "SELECT set_config('statement_timeout', $1, true), set_config('lock_timeout', $2, true)",
};

/// Sent with `BEGIN` when the connection's server has a synchronous standby.
pub(super) const SYNCHRONOUS: &str = "SET LOCAL synchronous_commit = on";

/// The server's bounds on the statements of one transaction, in whole
/// milliseconds, never 0 (which PostgreSQL reads as "no timeout").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Timeouts {
    statement_ms: u32,
    lock_ms: u32,
}

impl Timeouts {
    /// The bounds of a transaction begun with `left` before the call's
    /// deadline: every statement is cancelled once it has run that long, so
    /// none outlives the deadline by more than the time between `BEGIN` and
    /// its own start. A lock wait gives up at half of it, leaving time to back
    /// off and replay, except on the `last` attempt the budget allows, which
    /// may wait to the end (its statement timeout then comes first).
    pub(crate) fn within(left: Duration, last: bool) -> Timeouts {
        let statement_ms = left.as_millis().clamp(1, i32::MAX as u128) as u32;
        let lock_ms = if last {
            statement_ms
        } else {
            (statement_ms / 2).max(1)
        };
        Timeouts {
            statement_ms,
            lock_ms,
        }
    }

    pub(super) fn bounds(self) -> Bounds {
        Bounds {
            statement: Duration::from_millis(self.statement_ms.into()),
            lock: Duration::from_millis(self.lock_ms.into()),
        }
    }

    /// `BEGIN` and both settings as one simple query: one round trip. Only
    /// integers we formatted ourselves go into it.
    pub(super) fn begin_sql(self, isolation: Isolation) -> String {
        format!(
            "{}; SET LOCAL statement_timeout = '{}ms'; SET LOCAL lock_timeout = '{}ms'",
            isolation.begin_sql(),
            self.statement_ms,
            self.lock_ms
        )
    }

    /// What [`Timeouts::begin_sql`] does, as prepared statements, for a
    /// ride that replaces it (see [`super::pipeline`]).
    pub(super) fn write_begin(
        self,
        isolation: Isolation,
        session: &mut Session<'_>,
    ) -> QueryResult<()> {
        session.call(isolation.begin_statement(), &[])?;
        let statement = format!("{}ms", self.statement_ms);
        let lock = format!("{}ms", self.lock_ms);
        session.call(
            &BOUNDS,
            &[Some(statement.as_bytes()), Some(lock.as_bytes())],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_are_whole_milliseconds_and_never_zero() {
        let t = Timeouts::within(Duration::from_millis(300), false);
        assert_eq!((t.statement_ms, t.lock_ms), (300, 150));
        assert_eq!(
            t.begin_sql(Isolation::Serializable),
            "BEGIN ISOLATION LEVEL SERIALIZABLE; SET LOCAL statement_timeout = '300ms'; \
             SET LOCAL lock_timeout = '150ms'"
        );
        // The last attempt may wait for a lock as long as it may run.
        let t = Timeouts::within(Duration::from_millis(300), true);
        assert_eq!((t.statement_ms, t.lock_ms), (300, 300));
        // 0 would mean no timeout at all.
        for left in [
            Duration::ZERO,
            Duration::from_micros(999),
            Duration::from_millis(1),
        ] {
            let t = Timeouts::within(left, false);
            assert_eq!((t.statement_ms, t.lock_ms), (1, 1), "{left:?}");
        }
        // Beyond what the server accepts (an int of milliseconds): its largest.
        let t = Timeouts::within(Duration::MAX, false);
        assert_eq!(t.statement_ms, i32::MAX as u32);
    }
}
