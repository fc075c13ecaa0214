//! Every statement on `idem_requests`, each written once. Those on every
//! request of external mode (claim-or-read, read and record) are fixed
//! query fragments, so diesel caches their prepared statements (its `INSERT
//! .. ON CONFLICT DO UPDATE` and `UPDATE` builders are not cached), every
//! value a bind parameter; the rare ones (release, mark unknown, settle,
//! purge) use the query builder.
//!
//! Local mode's statements ride on the transaction's `BEGIN` and `COMMIT`
//! (see [`crate::tx`]): [`LOCK`], [`READ_TEXT`] and [`Complete`]'s, prepared
//! once per session and bound with their values in text form (bytes as
//! `\x` hex), their rows read as text.

use diesel::pg::Pg;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::sql_types::{BigInt, Binary, Bool, Jsonb, Nullable, Text};
use diesel::QueryResult;

use crate::sql::push_hex;
use crate::tx::{Prepared, Session};

/// What is left of a record's retention, in whole milliseconds (negative
/// once expired), as the database's clock sees it: a replay cache keeps an
/// entry no longer than this, so it never outlives the record it copies.
macro_rules! remaining_ms {
    () => {
        "(extract(epoch FROM expires_at - now()) * 1000)::int8"
    };
}
const REMAINING_MS: &str = remaining_ms!();

/// The columns of a record's [`Identity`], in the order it binds them.
macro_rules! identity_columns {
    () => {
        "scope, scope_label, key, operation, fingerprint"
    };
}

/// A record's `state` (the enum `idem_request_state`, migration 15).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum State {
    /// An external claim held.
    InProgress,
    /// The response stored.
    Completed,
    /// An outside call may have happened.
    Unknown,
}

impl State {
    /// The state named by `label`, as the record's `state::text` reads.
    pub(crate) fn parse(label: &str) -> Option<State> {
        match label {
            "in_progress" => Some(State::InProgress),
            "completed" => Some(State::Completed),
            "unknown" => Some(State::Unknown),
            _ => None,
        }
    }
}

/// A completed record's `outcome` (the enum `idem_request_outcome`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// The response is the function's return value.
    Ok,
    /// The response is a final error.
    Error,
}

impl Outcome {
    /// Its label in the database.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Error => "error",
        }
    }

    /// The outcome named by `label`, as the record's `outcome::text` reads.
    pub(crate) fn parse(label: &str) -> Option<Outcome> {
        match label {
            "ok" => Some(Outcome::Ok),
            "error" => Some(Outcome::Error),
            _ => None,
        }
    }
}

/// What names a record and the request it was made for: the first columns
/// of both inserts ([`Claim`], [`Complete`]), bound in one place.
#[derive(Clone, Copy)]
pub(crate) struct Identity<'a> {
    pub(crate) scope: &'a str,
    /// The scope's readable form, when short (for people, never compared).
    pub(crate) scope_label: Option<&'a str>,
    pub(crate) key: &'a str,
    pub(crate) operation: &'a str,
    pub(crate) fingerprint: &'a [u8],
}

impl<'a> Identity<'a> {
    /// The columns [`push_values`](Self::push_values) binds, in its order.
    const COLUMNS: &'static str = identity_columns!();

    fn push_values<'b>(&'b self, out: &mut AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_bind_param::<Text, _>(self.scope)?;
        out.push_sql(", ");
        out.push_bind_param::<Nullable<Text>, _>(&self.scope_label)?;
        out.push_sql(", ");
        out.push_bind_param::<Text, _>(self.key)?;
        out.push_sql(", ");
        out.push_bind_param::<Text, _>(self.operation)?;
        out.push_sql(", ");
        out.push_bind_param::<Binary, _>(self.fingerprint)
    }
}

/// The conflict clause of an insert that takes over a completed record
/// whose retention ended, with the inserted row's values (state included),
/// and leaves any live record alone.
macro_rules! take_over_expired {
    () => {
        " ON CONFLICT (scope, key) DO UPDATE SET scope_label = excluded.scope_label, \
         operation = excluded.operation, fingerprint = excluded.fingerprint, mode = excluded.mode, \
         state = excluded.state, owner = excluded.owner, outcome = NULL, response = NULL, \
         created_at = now(), updated_at = now(), expires_at = excluded.expires_at, \
         lease_until = excluded.lease_until WHERE r.state = 'completed' AND r.expires_at <= now()"
    };
}

/// Insert the claim, or take over a completed record whose retention ended;
/// returns a row only when this request now owns the key.
///
/// A live record this statement's snapshot already sees is left alone: no
/// insert is tried, so the conflict path (which locks the row, and so makes a
/// replay a writing transaction that queues behind the others) is only taken
/// against a claim not yet visible, i.e. a concurrent first request, and
/// against an expired record.
pub(crate) struct Claim<'a> {
    pub(crate) identity: Identity<'a>,
    pub(crate) mode: &'a str,
    pub(crate) ttl_micros: i64,
    /// `None` in local mode: a local claim is never visible while in progress.
    pub(crate) lease_micros: Option<i64>,
    /// External mode: the token that tells the owner's own claim apart.
    pub(crate) owner: Option<&'a [u8]>,
}

impl Claim<'_> {
    /// The INSERT, as a CTE of [`ClaimOrRead`]: its live-record test reads
    /// the `seen` CTE beside it.
    fn walk_insert<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("INSERT INTO idem_requests AS r (");
        out.push_sql(Identity::COLUMNS);
        out.push_sql(", mode, state, owner, expires_at, lease_until) SELECT ");
        self.identity.push_values(&mut out)?;
        out.push_sql(", ");
        out.push_bind_param::<Text, _>(self.mode)?;
        out.push_sql("::idem_request_mode, 'in_progress', ");
        out.push_bind_param::<Nullable<Binary>, _>(&self.owner)?;
        out.push_sql(", now() + ");
        out.push_bind_param::<BigInt, _>(&self.ttl_micros)?;
        out.push_sql(" * interval '1 microsecond', now() + ");
        out.push_bind_param::<Nullable<BigInt>, _>(&self.lease_micros)?;
        out.push_sql(
            " * interval '1 microsecond' WHERE NOT EXISTS (SELECT FROM seen l WHERE \
             (l.state <> 'completed' OR NOT l.expired))",
        );
        out.push_sql(concat!(take_over_expired!(), " RETURNING true"));
        Ok(())
    }
}

/// The claim and the read of the record it met, in one statement (one
/// statement less per request than a read beside the claim). Both see the
/// statement's snapshot: a record committed after it began is not `seen`, and
/// the caller reads again when the claim neither inserted nor saw a record.
pub(crate) struct ClaimOrRead<'a>(pub(crate) Claim<'a>);

impl QueryFragment<Pg> for ClaimOrRead<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql(
            "WITH seen AS (SELECT operation, fingerprint, state::text AS state, \
             outcome::text AS outcome, response, lease_until < now() AS lease_expired, expires_at <= now() AS expired, owner, ",
        );
        out.push_sql(REMAINING_MS);
        out.push_sql(" AS remaining_ms FROM idem_requests WHERE scope = ");
        out.push_bind_param::<Text, _>(self.0.identity.scope)?;
        out.push_sql(" AND key = ");
        out.push_bind_param::<Text, _>(self.0.identity.key)?;
        out.push_sql("), claimed AS (");
        self.0.walk_insert(out.reborrow())?;
        out.push_sql(
            " AS ok) SELECT (SELECT ok FROM claimed), seen.operation, seen.fingerprint, seen.state, \
             seen.outcome, seen.response, seen.lease_expired, seen.expired, seen.owner, \
             seen.remaining_ms FROM (SELECT 1) AS one LEFT JOIN seen ON true",
        );
        Ok(())
    }
}

impl Query for ClaimOrRead<'_> {
    type SqlType = (
        Nullable<Bool>,
        Nullable<Text>,
        Nullable<diesel::sql_types::Bytea>,
        Nullable<Text>,
        Nullable<Text>,
        Nullable<Jsonb>,
        Nullable<Bool>,
        Nullable<Bool>,
        Nullable<diesel::sql_types::Bytea>,
        Nullable<BigInt>,
    );
}

/// Store the outcome of the request that owns the key.
pub(crate) struct Record<'a> {
    pub(crate) scope: &'a str,
    pub(crate) key: &'a str,
    pub(crate) outcome: Outcome,
    pub(crate) response: &'a serde_json::Value,
    /// External mode: only the owner's own claim is completed.
    pub(crate) owner: Option<&'a [u8]>,
    /// Return the response as stored (see [`push_returning`]).
    pub(crate) returning: bool,
}

impl QueryFragment<Pg> for Record<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("UPDATE idem_requests SET state = 'completed', outcome = ");
        out.push_bind_param::<Text, _>(self.outcome.as_str())?;
        out.push_sql("::idem_request_outcome, response = ");
        out.push_bind_param::<Jsonb, _>(self.response)?;
        out.push_sql(", updated_at = now(), lease_until = NULL WHERE scope = ");
        out.push_bind_param::<Text, _>(self.scope)?;
        out.push_sql(" AND key = ");
        out.push_bind_param::<Text, _>(self.key)?;
        out.push_sql(" AND state <> 'completed' AND owner IS NOT DISTINCT FROM ");
        out.push_bind_param::<Nullable<Binary>, _>(&self.owner)?;
        push_returning(self.returning, out)
    }
}

/// Local mode: the one write of a new request, sent with `COMMIT` (in one
/// round trip): the completed record, inserted (or taking over a record
/// whose retention ended). Duplicates never reach it concurrently, as they
/// queue on the advisory lock first. It never writes nothing, so that the `COMMIT`
/// behind it cannot commit the body without it: a record of the key that
/// appeared after the read (an external claim, which does not queue on the
/// lock, or under a snapshot isolation a duplicate committed after the
/// snapshot) fails the insert with a unique violation, or with 40001 under
/// SERIALIZABLE, and a takeover with [`RECORD_TAKEN`]. The attempt is then
/// replayed, and its read finds the record.
pub(crate) struct Complete<'a> {
    pub(crate) identity: Identity<'a>,
    pub(crate) outcome: Outcome,
    pub(crate) response: &'a serde_json::Value,
    pub(crate) ttl_micros: i64,
    /// The read found an expired record of the key, to take over. Otherwise
    /// a plain INSERT (no speculative insertion: less work and WAL), which a
    /// record that appeared meanwhile fails with a unique violation.
    pub(crate) takeover: bool,
    /// Return the response as stored (see [`push_returning`]).
    pub(crate) returning: bool,
}

/// [`Complete`]'s statement: an `INSERT` of its row, or a takeover of an
/// expired record, each with or without `RETURNING` the response (as text,
/// as all of a ride's results are). Each parameter takes its column's type.
///
/// It fails, and with it the transaction before its `COMMIT` runs, when
/// the session has a temporary table named `idem_requests` (a body's own,
/// which comes first in the search path and would take the record away
/// with it): an enum's input refuses the label that says why. (A lookup of
/// the name, not of the table the `INSERT` resolved: a catalog read per
/// record cost 0.06 of the bare handler.)
macro_rules! complete_statement {
    ($name:literal, $tail:expr) => {
        Prepared {
            name: $name,
            text: concat!(
                "INSERT INTO idem_requests AS r (",
                identity_columns!(),
                ", mode, state, outcome, response, expires_at) VALUES ($1, $2, $3, $4, $5, \
                 CASE WHEN pg_catalog.to_regclass('pg_temp.idem_requests') IS NOT NULL \
                 THEN 'idem: idem_requests is a temporary table here; the record would go with it' \
                 ELSE 'local' END::idem_request_mode, \
                 'completed', $6, $7, now() + $8::int8 * interval '1 microsecond')",
                $tail
            ),
        }
    };
}

/// A takeover of an expired record, which raises instead of writing nothing.
macro_rules! takeover {
    () => {
        " ON CONFLICT (scope, key) DO UPDATE SET \
         scope_label = excluded.scope_label, operation = excluded.operation, \
         fingerprint = excluded.fingerprint, mode = excluded.mode, \
         owner = NULL, outcome = excluded.outcome, response = excluded.response, \
         created_at = now(), updated_at = now(), expires_at = excluded.expires_at, \
         lease_until = NULL, state = CASE WHEN r.state = 'completed' AND r.expires_at <= now() \
         THEN 'completed' ELSE idem_record_taken()::idem_request_state END"
    };
}

const COMPLETE: [Prepared; 4] = [
    complete_statement!("idem_complete_v1", ""),
    complete_statement!("idem_complete_returning_v1", " RETURNING response::text"),
    complete_statement!("idem_take_over_v1", takeover!()),
    complete_statement!(
        "idem_take_over_returning_v1",
        concat!(takeover!(), " RETURNING response::text")
    ),
];

impl Complete<'_> {
    /// The statement's call, to ride on `COMMIT` (see [`crate::tx`]).
    pub(crate) fn write(&self, session: &mut Session<'_>) -> QueryResult<()> {
        let response = self.response.to_string();
        let mut fingerprint = String::with_capacity(2 + 2 * self.identity.fingerprint.len());
        fingerprint.push_str("\\x");
        push_hex(&mut fingerprint, self.identity.fingerprint);
        let ttl = self.ttl_micros.to_string();
        let statement = &COMPLETE[usize::from(self.takeover) * 2 + usize::from(self.returning)];
        session.call(
            statement,
            &[
                Some(self.identity.scope.as_bytes()),
                self.identity.scope_label.map(str::as_bytes),
                Some(self.identity.key.as_bytes()),
                Some(self.identity.operation.as_bytes()),
                Some(fingerprint.as_bytes()),
                Some(self.outcome.as_str().as_bytes()),
                Some(response.as_bytes()),
                Some(ttl.as_bytes()),
            ],
        )
    }
}

/// Local mode's first statements: duplicates of one key queue on the lock
/// for the rest of the transaction (its key is a 64-bit hash of scope and
/// key: a collision only makes two unrelated requests wait for each other),
/// then the read of the record, each column as text (bytes in hex, which
/// reads the same whatever `bytea_output` says).
pub(crate) const LOCK: Prepared = Prepared {
    name: "idem_lock_v1",
    text: "SELECT pg_advisory_xact_lock($1::int8)",
};

/// See [`LOCK`].
pub(crate) const READ_TEXT: Prepared = Prepared {
    name: "idem_read_v1",
    text: concat!(
        "SELECT operation, encode(fingerprint, 'hex'), state::text, outcome::text, \
         response::text, lease_until < now(), expires_at <= now(), encode(owner, 'hex'), ",
        remaining_ms!(),
        " FROM idem_requests WHERE scope = $1 AND key = $2"
    ),
};

/// How [`Complete`] refuses to write nothing (SQLSTATE IDR01, migration 9):
/// its message starts with this (diesel reports no SQLSTATE of its own).
pub(crate) const RECORD_TAKEN: &str = "idem: record taken:";

/// Whether `err` is [`Complete`] meeting a live record of its key: the
/// primary key's unique violation, or a takeover's [`RECORD_TAKEN`].
pub(crate) fn record_taken(err: &diesel::result::Error) -> bool {
    use diesel::result::{DatabaseErrorKind, Error};
    match err {
        Error::DatabaseError(DatabaseErrorKind::UniqueViolation, info) => {
            info.constraint_name() == Some("idem_requests_pkey")
        }
        Error::DatabaseError(_, info) => info.message().starts_with(RECORD_TAKEN),
        _ => false,
    }
}

/// The two writes of a completed record ([`Complete`], [`Record`]) can hand
/// back the response *as stored*: `jsonb` normalizes what it keeps (`-0.0`
/// becomes `0.0`, `1e300` its digits, keys reordered), and a replay answers
/// from the stored form, so a replay cache must copy that form, not the
/// value the body returned. Only asked for when a cache will keep it (a
/// second statement text, prepared once per connection like the first).
fn push_returning(returning: bool, mut out: AstPass<'_, '_, Pg>) -> QueryResult<()> {
    if returning {
        out.push_sql(" RETURNING response");
    }
    Ok(())
}

impl Query for Record<'_> {
    type SqlType = Jsonb;
}

/// Read the record of a key, with whether its lease and its retention ran out.
pub(crate) struct Read<'a> {
    pub(crate) scope: &'a str,
    pub(crate) key: &'a str,
}

impl QueryFragment<Pg> for Read<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql(
            "SELECT operation, fingerprint, state::text, outcome::text, response, \
             lease_until < now(), expires_at <= now(), owner, ",
        );
        out.push_sql(REMAINING_MS);
        out.push_sql(" FROM idem_requests WHERE scope = ");
        out.push_bind_param::<Text, _>(self.scope)?;
        out.push_sql(" AND key = ");
        out.push_bind_param::<Text, _>(self.key)?;
        Ok(())
    }
}

impl Query for Read<'_> {
    type SqlType = (
        Text,
        diesel::sql_types::Bytea,
        Text,
        Nullable<Text>,
        Nullable<Jsonb>,
        Nullable<Bool>,
        Bool,
        Nullable<diesel::sql_types::Bytea>,
        BigInt,
    );
}

macro_rules! cacheable_by_sql {
    ($($t:ident),*) => {$(
        // Not 'static (binds borrow), so diesel caches by the SQL text, which is fixed.
        impl QueryId for $t<'_> {
            type QueryId = ();
            const HAS_STATIC_QUERY_ID: bool = false;
        }
    )*};
}
cacheable_by_sql!(ClaimOrRead, Record, Read, HoldUnknown);

/// Release a claim that is not completed (its request never left, or an
/// operator found the target did nothing): the key is new again. `$3`: the
/// owner's token, or NULL for any holder.
pub(crate) const RELEASE: &str = "DELETE FROM idem_requests WHERE scope = $1 AND key = $2 \
     AND state <> 'completed' AND ($3::bytea IS NULL OR owner = $3)";

/// The owner's in-progress claim becomes outcome unknown: its request may
/// have reached the target.
pub(crate) const MARK_UNKNOWN: &str = "UPDATE idem_requests SET state = 'unknown', \
     updated_at = now() WHERE scope = $1 AND key = $2 AND state = 'in_progress' AND owner = $3";

/// Local mode: hold a key whose body ended the transaction itself and
/// committed (or may have) what it wrote: its record rides on idem's own
/// `COMMIT`, which never ran, so without this a repeat of the key would run
/// the body again. The key is held as outcome unknown, as an external
/// claim is after an outside call may have run, until an operator settles
/// it. A live record of the key (a duplicate that ran once the body's
/// `COMMIT` released the advisory lock) is left as it is; an expired
/// completed one is taken over. The hold carries the call's token as its
/// owner, so that the same call holding again (dropped while its first hold
/// was unanswered) finds its own hold and writes it once more, where the
/// hold of another request is left alone: a hold that writes nothing means
/// that request ran.
#[derive(Clone, Copy)]
pub(crate) struct HoldUnknown<'a> {
    pub(crate) identity: Identity<'a>,
    pub(crate) ttl_micros: i64,
    pub(crate) owner: &'a [u8; 16],
}

impl QueryFragment<Pg> for HoldUnknown<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("INSERT INTO idem_requests AS r (");
        out.push_sql(Identity::COLUMNS);
        out.push_sql(", mode, state, owner, expires_at, lease_until) VALUES (");
        self.identity.push_values(&mut out)?;
        out.push_sql(", 'local', 'unknown', ");
        out.push_bind_param::<Binary, _>(&self.owner[..])?;
        out.push_sql(", now() + ");
        out.push_bind_param::<BigInt, _>(&self.ttl_micros)?;
        out.push_sql(" * interval '1 microsecond', NULL)");
        out.push_sql(concat!(
            take_over_expired!(),
            " OR (r.state = 'unknown' AND r.mode = 'local' AND r.owner = excluded.owner)"
        ));
        Ok(())
    }
}

/// An operator's decision that the target did it: store the response.
pub(crate) const SETTLE_COMPLETED: &str = "UPDATE idem_requests SET state = 'completed', \
     outcome = 'ok', response = $3, updated_at = now(), lease_until = NULL \
     WHERE scope = $1 AND key = $2 AND state <> 'completed'";

/// One batch of expired completed records; `SKIP LOCKED` so a purge never
/// waits on, or blocks, a request taking over an expired key.
pub(crate) const PURGE_BATCH: &str = "DELETE FROM idem_requests WHERE ctid = ANY (ARRAY( \
     SELECT ctid FROM idem_requests WHERE state = 'completed' AND expires_at <= now() \
     LIMIT $1 FOR UPDATE SKIP LOCKED))";

/// In-progress claims whose lease ran out become outcome unknown.
pub(crate) const EXPIRE_LEASES: &str = "UPDATE idem_requests SET state = 'unknown', \
     updated_at = now() WHERE state = 'in_progress' AND lease_until < now()";

/// How many records wait to be settled.
pub(crate) const COUNT_UNKNOWN: &str =
    "SELECT count(*) AS n FROM idem_requests WHERE state = 'unknown'";
