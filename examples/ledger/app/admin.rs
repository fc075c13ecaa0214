//! `--reconcile` and `--reap`: the two jobs an operator runs beside the server.
//!
//! **Reconcile** recomputes every balance from the entries (the truth) and
//! compares it with the cache; it reports drift and never fixes it: a fix is
//! a new, reviewed movement, since entries are append-only.
//!
//! **Reap** applies idem's retention to the ledger's idempotency records.
//! Retention: a completed record (its response or final error) is replayed
//! for 24 hours (`IdempotencyConfig::ttl`), after which the same key is a new
//! request; `idem::idempotency::purge_expired` deletes such records in
//! batches. Lease: the ledger's functions are in local mode, so a claim lives
//! only inside the transaction that does the work: a crashed request rolls
//! its claim back with everything else and never leaves a key held. A claim
//! in external mode (another system called) is held under a lease (default
//! 30 s); one still in progress past it is reported here as stale and marked
//! outcome unknown, never deleted, until `idem::idempotency::settle` decides it.

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idem::idempotency::{purge_expired, PurgeReport};

/// An account whose cached balance is not the sum of its entries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Drift {
    pub account_id: i64,
    pub tenant_id: i64,
    pub kind: String,
    /// `accounts.balance`.
    pub cached: i64,
    /// `Σ CREDIT − Σ DEBIT` of its entries: an `i128`, since drift can put
    /// it anywhere.
    pub from_entries: i128,
}

// Sums of bigint are numeric in PostgreSQL and can pass i64 (Σ DEBIT over a
// whole ledger does, in time): they are read as text into i128 rather than
// cast to bigint, which failed the job with "bigint out of range".
#[derive(QueryableByName)]
struct DriftRow {
    #[diesel(sql_type = BigInt)]
    account_id: i64,
    #[diesel(sql_type = BigInt)]
    tenant_id: i64,
    #[diesel(sql_type = Text)]
    kind: String,
    #[diesel(sql_type = BigInt)]
    cached: i64,
    #[diesel(sql_type = Text)]
    from_entries: String,
}

#[derive(QueryableByName)]
struct Totals {
    #[diesel(sql_type = BigInt)]
    accounts: i64,
    #[diesel(sql_type = BigInt)]
    entries: i64,
    #[diesel(sql_type = Text)]
    debits: String,
    #[diesel(sql_type = Text)]
    credits: String,
    #[diesel(sql_type = BigInt)]
    unbalanced_movements: i64,
}

/// A numeric sum, as PostgreSQL prints it, as an i128.
fn sum(text: &str) -> QueryResult<i128> {
    text.parse()
        .map_err(|e| diesel::result::Error::DeserializationError(Box::new(e)))
}

/// What `--reconcile` found, from one snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Reconciliation {
    pub accounts: i64,
    pub entries: i64,
    /// `Σ DEBIT` over every entry.
    pub debits: i128,
    /// `Σ CREDIT` over every entry.
    pub credits: i128,
    /// Movements whose own debits and credits differ.
    pub unbalanced_movements: i64,
    /// Accounts whose cache drifted from their entries.
    pub drift: Vec<Drift>,
}

impl Reconciliation {
    /// No drift, and the books balance.
    pub fn is_clean(&self) -> bool {
        self.drift.is_empty() && self.debits == self.credits && self.unbalanced_movements == 0
    }
}

const DRIFT: &str = "
    SELECT a.id AS account_id, a.tenant_id, a.kind, a.balance AS cached,
           coalesce(sum(CASE e.direction WHEN 'CREDIT' THEN e.amount ELSE -e.amount END), 0)
               ::text AS from_entries
      FROM ledger_accounts a LEFT JOIN ledger_entries e ON e.account_id = a.id
     GROUP BY a.id
    HAVING a.balance <> coalesce(sum(CASE e.direction WHEN 'CREDIT' THEN e.amount ELSE -e.amount END), 0)
     ORDER BY a.id";

const TOTALS: &str = "
    SELECT (SELECT count(*) FROM ledger_accounts) AS accounts,
           count(*) AS entries,
           coalesce(sum(amount) FILTER (WHERE direction = 'DEBIT'), 0)::text AS debits,
           coalesce(sum(amount) FILTER (WHERE direction = 'CREDIT'), 0)::text AS credits,
           (SELECT count(*) FROM (
                SELECT transfer_id FROM ledger_entries GROUP BY transfer_id
                HAVING sum(CASE direction WHEN 'CREDIT' THEN amount ELSE -amount END) <> 0) u)
               AS unbalanced_movements
      FROM ledger_entries";

/// Recompute every balance from the entries, in one read-only snapshot, and
/// report; nothing is written.
pub async fn reconcile(conn: &mut AsyncPgConnection) -> QueryResult<Reconciliation> {
    conn.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        .await?;
    let read = async {
        let drift = diesel::sql_query(DRIFT)
            .load::<DriftRow>(conn)
            .await?
            .into_iter()
            .map(|row| {
                Ok(Drift {
                    account_id: row.account_id,
                    tenant_id: row.tenant_id,
                    kind: row.kind,
                    cached: row.cached,
                    from_entries: sum(&row.from_entries)?,
                })
            })
            .collect::<QueryResult<_>>()?;
        let totals = diesel::sql_query(TOTALS).get_result::<Totals>(conn).await?;
        Ok(Reconciliation {
            accounts: totals.accounts,
            entries: totals.entries,
            debits: sum(&totals.debits)?,
            credits: sum(&totals.credits)?,
            unbalanced_movements: totals.unbalanced_movements,
            drift,
        })
    }
    .await;
    // Read only: ending it either way changes nothing.
    conn.batch_execute("ROLLBACK").await?;
    read
}

/// An idempotency record that is not completed: its first request is still
/// running past its lease, or its outcome is unknown.
#[derive(Debug, Clone, PartialEq, Eq, QueryableByName)]
pub struct HeldKey {
    #[diesel(sql_type = Text)]
    pub scope: String,
    #[diesel(sql_type = Text)]
    pub key: String,
    #[diesel(sql_type = Text)]
    pub operation: String,
    #[diesel(sql_type = Text)]
    pub state: String,
    #[diesel(sql_type = Text)]
    pub since: String,
}

/// What `--reap` did and found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reaped {
    pub purge: PurgeReport,
    /// In-progress claims past their lease when the reaper looked (now
    /// outcome unknown), and older unknown ones: each needs a decision.
    pub held: Vec<HeldKey>,
}

const STALE_OR_UNKNOWN: &str = r#"
    SELECT coalesce(scope_label, scope) AS scope, key, operation, state::text AS state,
           to_char(updated_at, 'YYYY-MM-DD"T"HH24:MI:SSOF') AS since
      FROM idem_requests
     -- The label is the readable scope (kept for short ones, as these are).
     WHERE scope_label LIKE '["ledger",%'
       AND (state = 'unknown' OR (state = 'in_progress' AND lease_until < now()))
     ORDER BY updated_at LIMIT 100"#;

/// Purge expired completed records of every scope (idem's purge is
/// global; in batches of 1000) and report the ledger's keys still held.
pub async fn reap(conn: &mut AsyncPgConnection) -> QueryResult<Reaped> {
    let held = diesel::sql_query(STALE_OR_UNKNOWN)
        .load::<HeldKey>(conn)
        .await?;
    let purge = purge_expired(conn, 1000).await?;
    Ok(Reaped { purge, held })
}
