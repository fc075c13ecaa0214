//! Idempotency records (`idem_requests`): counts, one key's record, settle,
//! purge.

use std::time::Duration;

use diesel::sql_types::{BigInt, Double, Jsonb, Nullable, Text};
use diesel_async::RunQueryDsl;
use serde::Serialize;

use super::{secs, ser_opt_secs, ser_secs, OperateError};
use crate::idempotency::{self, scope_hash, Settlement};
use crate::pool::Pool;

/// How many records are in each state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, diesel::QueryableByName)]
#[non_exhaustive]
pub struct RecordStats {
    /// Claimed, their call not finished (or its process gone).
    #[diesel(sql_type = BigInt)]
    pub in_progress: i64,
    /// Of those, the ones whose lease ran out: the next purge marks them
    /// outcome unknown.
    #[diesel(sql_type = BigInt)]
    pub lease_expired: i64,
    /// Finished, their response replayed to duplicates.
    #[diesel(sql_type = BigInt)]
    pub completed: i64,
    /// Of those, the ones past their retention: the next purge deletes them.
    #[diesel(sql_type = BigInt)]
    pub expired: i64,
    /// Outcome unknown: waiting for an operator to [`settle`] them.
    #[diesel(sql_type = BigInt)]
    pub unknown: i64,
}

/// Count the records by state.
///
/// # Errors
///
/// No connection, or what PostgreSQL said (`idem_requests` missing: not migrated).
pub async fn record_stats(pool: &Pool) -> Result<RecordStats, OperateError> {
    let mut conn = pool.get().await?;
    Ok(diesel::sql_query(
        "SELECT count(*) FILTER (WHERE state = 'in_progress') AS in_progress,
                count(*) FILTER (WHERE state = 'in_progress' AND lease_until < now()) AS lease_expired,
                count(*) FILTER (WHERE state = 'completed') AS completed,
                count(*) FILTER (WHERE state = 'completed' AND expires_at <= now()) AS expired,
                count(*) FILTER (WHERE state = 'unknown') AS unknown
         FROM idem_requests",
    )
    .get_result(&mut conn)
    .await?)
}

#[derive(diesel::QueryableByName)]
struct Row {
    #[diesel(sql_type = Text)]
    scope: String,
    #[diesel(sql_type = Nullable<Text>)]
    scope_label: Option<String>,
    #[diesel(sql_type = Text)]
    key: String,
    #[diesel(sql_type = Text)]
    operation: String,
    #[diesel(sql_type = Text)]
    fingerprint: String,
    #[diesel(sql_type = Text)]
    mode: String,
    #[diesel(sql_type = Text)]
    state: String,
    #[diesel(sql_type = Nullable<Text>)]
    outcome: Option<String>,
    #[diesel(sql_type = Nullable<Jsonb>)]
    response: Option<serde_json::Value>,
    #[diesel(sql_type = Double)]
    age: f64,
    #[diesel(sql_type = Double)]
    expires_in: f64,
    #[diesel(sql_type = Nullable<Double>)]
    lease_left: Option<f64>,
    #[diesel(sql_type = Nullable<Text>)]
    owner: Option<String>,
}

/// One key's record, as [`show_key`] reads it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct KeyRecord {
    /// The stored scope: the hex SHA-256 of the scope value's canonical encoding.
    pub scope: String,
    /// The scope value as JSON, when it was short enough to be kept.
    pub scope_label: Option<String>,
    /// The idempotency key.
    pub key: String,
    /// The operation (the function) that claimed it.
    pub operation: String,
    /// The request's fingerprint, hex.
    pub fingerprint: String,
    /// `local` or `external`.
    pub mode: String,
    /// `in_progress`, `completed` or `unknown`.
    pub state: String,
    /// `ok` or `error` once completed.
    pub outcome: Option<String>,
    /// The stored response. It may hold personal data: show it only when
    /// asked to (the CLI's `--show-response`).
    pub response: Option<serde_json::Value>,
    /// Since the record was made (in JSON, seconds).
    #[serde(serialize_with = "ser_secs")]
    pub age: Duration,
    /// Until a completed record's retention ends; zero when it has (in
    /// JSON, seconds). An `in_progress` or `unknown` record has a retention
    /// time too, but nothing acts on it: see [`KeyRecord::expired`].
    #[serde(serialize_with = "ser_secs")]
    pub expires_in: Duration,
    /// Whether the record is completed and its retention has ended: a purge
    /// may delete it, and a new call with the key takes it over. Always
    /// false for an `in_progress` or `unknown` record, whatever its
    /// retention says: no purge deletes one and no call takes one over (an
    /// `in_progress` claim becomes `unknown` when its lease runs out), so it
    /// stays until it is settled ([`settle`], `idem key settle`).
    pub expired: bool,
    /// What is left of an in-progress claim's lease; zero when it ran out
    /// (in JSON, seconds or null).
    #[serde(serialize_with = "ser_opt_secs")]
    pub lease_left: Option<Duration>,
    /// The owner token, hex: an external claim's, or the call's that held a
    /// local key after its body committed by hand.
    pub owner: Option<String>,
}

/// The record of `key` under the scope value `scope` (the value the
/// function's `scope = ..` gives, e.g. `serde_json::json!([7])` for
/// `(7_i64,)`; `()`/`null` for none). `None` when there is none.
///
/// # Errors
///
/// A scope that cannot be encoded, no connection, or what PostgreSQL said.
pub async fn show_key<S: Serialize + ?Sized>(
    pool: &Pool,
    scope: &S,
    key: &str,
) -> Result<Option<KeyRecord>, OperateError> {
    let scope = scope_hash(scope)?;
    let mut conn = pool.get().await?;
    let rows: Vec<Row> = diesel::sql_query(
        "SELECT scope, scope_label, key, operation, encode(fingerprint, 'hex') AS fingerprint,
                mode::text AS mode, state::text AS state, outcome::text AS outcome, response,
                extract(epoch FROM now() - created_at)::float8 AS age,
                extract(epoch FROM expires_at - now())::float8 AS expires_in,
                extract(epoch FROM lease_until - now())::float8 AS lease_left,
                encode(owner, 'hex') AS owner
         FROM idem_requests WHERE scope = $1 AND key = $2",
    )
    .bind::<Text, _>(&scope)
    .bind::<Text, _>(key)
    .load(&mut conn)
    .await?;
    Ok(rows.into_iter().next().map(|r| KeyRecord {
        expired: r.state == "completed" && r.expires_in <= 0.0,
        scope: r.scope,
        scope_label: r.scope_label,
        key: r.key,
        operation: r.operation,
        fingerprint: r.fingerprint,
        mode: r.mode,
        state: r.state,
        outcome: r.outcome,
        response: r.response,
        age: secs(r.age),
        expires_in: secs(r.expires_in),
        lease_left: r.lease_left.map(secs),
        owner: r.owner,
    }))
}

/// [`idempotency::settle`]: decide an outcome-unknown (or stuck
/// in-progress) record. Returns whether there was such a record.
///
/// # Errors
///
/// As [`idempotency::settle`].
pub async fn settle<S: Serialize + ?Sized>(
    pool: &Pool,
    scope: &S,
    key: &str,
    settlement: Settlement,
) -> Result<bool, OperateError> {
    Ok(idempotency::settle(pool, scope, key, settlement).await?)
}

/// What [`settle_forced`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Forced {
    /// An in-progress or outcome-unknown record was settled, as [`settle`]
    /// settles it.
    Settled,
    /// A completed record: its stored response replaced
    /// ([`Settlement::Completed`]) or the record deleted
    /// ([`Settlement::Released`], the key is new again).
    Overwritten,
    /// No record of the key.
    NotFound,
}

/// [`settle`] whatever the record's state: an in-progress or
/// outcome-unknown record is settled as [`settle`] settles it (a live
/// claim too: its request may still be calling the target), and a
/// completed one, which [`settle`] leaves alone, is corrected:
/// [`Settlement::Completed`] replaces its stored response (outcome `ok`),
/// [`Settlement::Released`] deletes it, so the next call with the key runs
/// as new.
///
/// The response must deserialize as the function's return type (the `T`
/// of the `#[idempotent]` fn's `Result<T, E>`), or every replay fails; a
/// Redis replay cache may answer with the response it copied before
/// until its entry expires (at most `CacheConfig::max_ttl`).
///
/// # Errors
///
/// As [`settle`]; no connection, or what PostgreSQL said.
pub async fn settle_forced<S: Serialize + ?Sized>(
    pool: &Pool,
    scope: &S,
    key: &str,
    settlement: Settlement,
) -> Result<Forced, OperateError> {
    // First as `settle`, which also checks that a response can be stored.
    if settle(pool, scope, key, settlement.clone()).await? {
        return Ok(Forced::Settled);
    }
    let scope = scope_hash(scope)?;
    let mut conn = pool.get().await?;
    let n =
        match settlement {
            Settlement::Completed(response) => {
                diesel::sql_query(
                    "UPDATE idem_requests SET outcome = 'ok', response = $3, updated_at = now()
                 WHERE scope = $1 AND key = $2 AND state = 'completed'",
                )
                .bind::<Text, _>(&scope)
                .bind::<Text, _>(key)
                .bind::<Jsonb, _>(&response)
                .execute(&mut conn)
                .await?
            }
            Settlement::Released => diesel::sql_query(
                "DELETE FROM idem_requests WHERE scope = $1 AND key = $2 AND state = 'completed'",
            )
            .bind::<Text, _>(&scope)
            .bind::<Text, _>(key)
            .execute(&mut conn)
            .await?,
        };
    Ok(if n == 1 {
        Forced::Overwritten
    } else {
        Forced::NotFound
    })
}

/// What [`purge_expired`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[non_exhaustive]
pub struct PurgeView {
    /// Completed records past their retention, deleted.
    pub deleted: u64,
    /// In-progress records whose lease ran out, now outcome unknown.
    pub marked_unknown: u64,
    /// Records in outcome unknown, kept until settled.
    pub unknown: u64,
    /// Outbox events sent longer ago than the retention given, deleted
    /// (0 when none was given).
    pub outbox_sent_deleted: u64,
}

/// [`idempotency::purge_expired`], `batch` rows per statement; with
/// `outbox_retention`, also [`outbox::delete_sent`](crate::outbox::delete_sent)
/// of events sent longer ago than that.
///
/// # Errors
///
/// No connection, or what PostgreSQL said; the batches deleted before stay deleted.
pub async fn purge_expired(
    pool: &Pool,
    batch: i64,
    outbox_retention: Option<Duration>,
) -> Result<PurgeView, OperateError> {
    if batch < 1 {
        return Err(OperateError::Invalid(format!(
            "the batch size must be at least 1, not {batch}"
        )));
    }
    let mut conn = pool.get().await?;
    let report = idempotency::purge_expired(&mut conn, batch).await?;
    let outbox_sent_deleted = match outbox_retention {
        Some(keep) => {
            let batch = u32::try_from(batch).unwrap_or(u32::MAX);
            crate::outbox::delete_sent(&mut conn, keep, batch).await? as u64
        }
        None => 0,
    };
    Ok(PurgeView {
        deleted: report.deleted,
        marked_unknown: report.marked_unknown,
        unknown: report.unknown,
        outbox_sent_deleted,
    })
}
