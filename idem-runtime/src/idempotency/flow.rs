//! The claim / replay / record steps an idempotent function runs, in the
//! order `#[idempotent]` calls them. Also callable by hand (see [`Request`]).

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant};

use diesel::prelude::*;
use diesel_async::{
    AnsiTransactionManager, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection,
    TransactionManager,
};
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::store::{self, idem_requests, Claim, ClaimOrRead, Read, Record};
use super::{
    derived_key, fingerprint, validate_key, Field, IdempotencyConfig, IdempotencyError, Idempotent,
    IdempotentError, Mode, CURRENT_KEY,
};
use crate::pool::Pool;
use crate::retry::{Attempt, PreCommit, PreCommitStep};

/// One idempotent request: its key space, key, operation and fingerprint,
/// validated before anything is written.
#[derive(Debug, Clone)]
pub struct Request {
    config: IdempotencyConfig,
    scope: String,
    key: String,
    operation: String,
    fingerprint: [u8; 32],
}

/// What a step found: a new request to run, or the answer to give.
#[must_use]
pub enum Lookup<T, E> {
    /// No live record: run the body.
    New,
    /// Answer with this (a replay, or a refusal).
    Done(Result<Idempotent<T>, E>),
}

/// A row of `idem_requests` as the steps read it.
#[derive(Queryable)]
struct Stored {
    operation: String,
    fingerprint: Vec<u8>,
    state: String,
    outcome: Option<String>,
    response: Option<serde_json::Value>,
    lease_expired: Option<bool>,
    expired: bool,
}

impl Request {
    /// Validate and build a request. `key` is the caller's key (`Some(None)`:
    /// one was required but missing), or `None` to derive it from scope,
    /// operation and fingerprint.
    pub fn new(
        config: IdempotencyConfig,
        operation: &str,
        key: Option<Option<&str>>,
        scope: &impl Serialize,
        fields: &[Field],
    ) -> Result<Request, IdempotencyError> {
        let scope =
            serde_json::to_string(scope).map_err(|source| IdempotencyError::Unserializable {
                what: "the scope".to_owned(),
                source,
            })?;
        let fingerprint = fingerprint::fingerprint(fields);
        let key = match key {
            Some(Some(key)) => {
                validate_key(key)?;
                key.to_owned()
            }
            Some(None) => return Err(IdempotencyError::MissingKey),
            None => derived_key(&scope, operation, &fingerprint),
        };
        Ok(Request {
            config,
            scope,
            key,
            operation: operation.to_owned(),
            fingerprint,
        })
    }

    /// The key (given or derived).
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The scope, as stored (compact JSON of the scope values).
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// The settings.
    pub fn config(&self) -> &IdempotencyConfig {
        &self.config
    }

    /// Run `body` with [`super::current_key`] returning this request's key.
    pub fn scope_key<F: Future>(&self, body: F) -> impl Future<Output = F::Output> {
        CURRENT_KEY.scope(self.key.clone(), body)
    }

    fn claim(&self) -> Claim<'_> {
        Claim {
            scope: &self.scope,
            key: &self.key,
            operation: &self.operation,
            fingerprint: &self.fingerprint,
            mode: self.config.mode.as_str(),
            ttl_micros: micros(self.config.ttl),
            lease_micros: (self.config.mode == Mode::External).then(|| micros(self.config.lease)),
        }
    }

    fn read_query(&self) -> Read<'_> {
        Read {
            scope: &self.scope,
            key: &self.key,
        }
    }

    async fn read(&self, conn: &mut AsyncPgConnection) -> QueryResult<Option<Stored>> {
        self.read_query().get_result(conn).await.optional()
    }

    /// What an existing record means for this request.
    fn judge(&self, stored: Stored) -> Found {
        if stored.state == store::COMPLETED && stored.expired {
            return Found::New;
        }
        // Compare the request before anything else: a different request must
        // not even learn whether the first one finished.
        if stored.operation != self.operation || stored.fingerprint != self.fingerprint {
            return Found::Refused(IdempotencyError::FingerprintMismatch);
        }
        match stored.state.as_str() {
            store::COMPLETED => Found::Replay(stored.outcome, stored.response),
            store::IN_PROGRESS if stored.lease_expired != Some(true) => {
                Found::Refused(IdempotencyError::InProgress)
            }
            // Unknown, or in progress past its lease: never an automatic re-run.
            _ => Found::Refused(IdempotencyError::OutcomeUnknown),
        }
    }

    /// Read the record outside any transaction and answer from it, waiting
    /// up to [`IdempotencyConfig::wait`] while it is in progress. Never decides
    /// that a request is new by itself (`New` only means "no live record
    /// here now"); the claim does that. External mode answers a lost claim
    /// with it; local mode does not need it (see [`Request::claim_local`]).
    pub async fn lookup<T: DeserializeOwned, E: IdempotentError>(
        &self,
        pool: &Pool,
    ) -> Lookup<T, E> {
        let deadline = Instant::now() + self.config.wait;
        loop {
            let found = match pool.get().await {
                Ok(mut conn) => self.read(&mut conn).await,
                Err(e) => {
                    return Lookup::Done(Err(E::from(IdempotencyError::Database(pool_error(e)))))
                }
            };
            let found = match found {
                Ok(None) => Found::New,
                Ok(Some(stored)) => self.judge(stored),
                Err(e) => Found::Refused(IdempotencyError::Database(e)),
            };
            // Wait for an in-progress first request only as long as configured.
            let now = Instant::now();
            if matches!(found, Found::Refused(IdempotencyError::InProgress)) && now < deadline {
                tokio::time::sleep(Duration::from_millis(20).min(deadline - now)).await;
                continue;
            }
            return found.into_lookup();
        }
    }

    /// Local mode, first statements of an attempt, in one round trip: `BEGIN`,
    /// a read of the record, and the claim. So a new request costs no round
    /// trip and no transaction more than the bare handler (its one commit is
    /// the attempt's), and a repeated one is answered from that read, in a
    /// transaction that wrote nothing.
    ///
    /// The claim leaves a live record it sees alone (no lock). Against a
    /// concurrent first request whose claim is not committed yet, it waits for
    /// that transaction; once it committed, the record is read again (the next
    /// READ COMMITTED statement sees it) and answered.
    ///
    /// The same round trip also prepares the statement that records the
    /// outcome (run on no row), so that at the end it can be pipelined with
    /// `COMMIT`: a statement still to be prepared would be overtaken by it.
    pub async fn claim_local<T: DeserializeOwned, E: IdempotentError>(
        &self,
        attempt: &mut Attempt,
    ) -> Lookup<T, E> {
        let begin = attempt.take_deferred_begin();
        let conn: &AsyncPgConnection = attempt.conn();
        let claim = ClaimOrRead(self.claim());
        let (mut begin_conn, mut claim_conn) = (conn, conn);
        // Polled in this order, so sent in this order: BEGIN first.
        let (begun, claimed) = tokio::join!(
            async {
                match begin {
                    Some(sql) => begin_conn.batch_execute(sql).await,
                    None => Ok(()),
                }
            },
            claim.get_result::<ClaimedOrSeen>(&mut claim_conn),
        );
        let (claimed, seen) = match begun.and(claimed) {
            Ok(row) => row.split(),
            Err(e) => return Lookup::Done(Err(E::from(IdempotencyError::Database(e)))),
        };
        if claimed.is_some() {
            return Lookup::New;
        }
        // The claim found a live record: the one read before it, unless that
        // read came too early to see it.
        if let Some(stored) = seen {
            match self.judge(stored) {
                Found::New => {}
                found => return found.into_local_lookup(attempt),
            }
        }
        match self.read(attempt.conn()).await {
            Ok(Some(stored)) => self.judge(stored).into_local_lookup(attempt),
            // The owner's record vanished between the two statements (it
            // expired and was purged): a conflict the retry loop replays.
            Ok(None) => Lookup::Done(Err(E::from(IdempotencyError::Database(
                diesel::result::Error::DatabaseError(
                    diesel::result::DatabaseErrorKind::SerializationFailure,
                    Box::new(
                        "the idempotency record changed while it was being claimed".to_owned(),
                    ),
                ),
            )))),
            Err(e) => Lookup::Done(Err(E::from(IdempotencyError::Database(e)))),
        }
    }

    /// Local mode, after the body: on `Ok`, arrange for the response to be
    /// stored in the same round trip as the attempt's `COMMIT`. An error is
    /// handed back, so the loop rolls everything back, claim included (see
    /// [`Request::finish_error`] for final errors).
    pub fn record_local<T: Serialize, E: IdempotentError>(
        &self,
        attempt: &mut Attempt,
        outcome: Result<T, E>,
    ) -> Result<Idempotent<T>, E> {
        let value = outcome?;
        let response = self.response(&value).map_err(E::from)?;
        // In the COMMIT's own query: no round trip, and nothing to prepare
        // that the COMMIT could overtake. The claim row is this transaction's
        // own, so the UPDATE cannot miss it.
        attempt.before_commit(PreCommitStep::Sql(record_sql(
            &self.scope,
            &self.key,
            &response,
        )));
        Ok(Idempotent {
            value,
            replayed: false,
        })
    }

    /// Local mode, after the loop returned an error: a final error is stored
    /// under the key (its transaction, and so the body's writes, were rolled
    /// back) and replayed from now on. Should another request have claimed the
    /// key in between, its recorded outcome is the answer instead.
    pub async fn finish_error<T: DeserializeOwned, E: IdempotentError>(
        &self,
        pool: &Pool,
        err: E,
    ) -> Result<Idempotent<T>, E> {
        let Some(stored) = err.to_final() else {
            return Err(err);
        };
        let response = self.response(&stored).map_err(E::from)?;
        let mut conn = pool
            .get()
            .await
            .map_err(|e| E::from(IdempotencyError::Database(pool_error(e))))?;
        // Claim and record in one short transaction, so the record is never
        // seen in progress.
        let claim = self.claim();
        let record = Record {
            scope: &self.scope,
            key: &self.key,
            outcome: store::ERROR,
            response: &response,
        };
        let conn: &mut AsyncPgConnection = &mut conn;
        let stored = async {
            AnsiTransactionManager::begin_transaction(conn).await?;
            let written = match claim.get_result::<bool>(conn).await.optional() {
                Ok(Some(_)) => record.execute(conn).await,
                Ok(None) => Ok(0),
                Err(e) => Err(e),
            };
            match written {
                Ok(n) => AnsiTransactionManager::commit_transaction(conn)
                    .await
                    .map(|()| n),
                Err(e) => {
                    // The statement's error is the one worth reporting.
                    let _ = AnsiTransactionManager::rollback_transaction(conn).await;
                    Err(e)
                }
            }
        }
        .await;
        let inserted = stored.map_err(|e| E::from(IdempotencyError::Database(e)))?;
        if inserted == 1 {
            return Err(err);
        }
        match self.lookup::<T, E>(pool).await {
            Lookup::Done(answer) => answer,
            // Expired in between: the error stands, unrecorded.
            Lookup::New => Err(err),
        }
    }

    /// External mode, before any attempt: commit the claim with its lease.
    pub async fn claim_external<T: DeserializeOwned, E: IdempotentError>(
        &self,
        pool: &Pool,
    ) -> Lookup<T, E> {
        let mut conn = match pool.get().await {
            Ok(conn) => conn,
            Err(e) => return Lookup::Done(Err(E::from(IdempotencyError::Database(pool_error(e))))),
        };
        match self.claim().get_result::<bool>(&mut *conn).await.optional() {
            Ok(Some(_)) => Lookup::New,
            Ok(None) => {
                drop(conn);
                self.lookup(pool).await
            }
            Err(e) => Lookup::Done(Err(E::from(IdempotencyError::Database(e)))),
        }
    }

    /// External mode, inside the last attempt: store the success in the same
    /// transaction as the body's own writes.
    pub fn record_external<T: Serialize, E: IdempotentError>(
        &self,
        attempt: &mut Attempt,
        value: T,
    ) -> Result<Idempotent<T>, E> {
        let response = self.response(&value).map_err(E::from)?;
        attempt.before_commit(PreCommitStep::Statement(self.record(store::OK, response)));
        Ok(Idempotent {
            value,
            replayed: false,
        })
    }

    /// External mode, after the attempts failed: store a final error, release
    /// the claim when nothing was sent, otherwise keep it as outcome unknown.
    /// `body_ran` false: no attempt got as far as the body, so nothing can
    /// have been sent and the claim is released.
    pub async fn settle_failure<E: IdempotentError>(
        &self,
        pool: &Pool,
        err: E,
        body_ran: bool,
    ) -> E {
        use idem_requests::dsl as r;
        let mut conn = match pool.get().await {
            Ok(conn) => conn,
            Err(e) => {
                tracing::error!(key = %self.key, error = %e, "could not settle an external idempotency claim; its lease will expire into outcome unknown");
                return err;
            }
        };
        let mine = r::idem_requests
            .filter(r::scope.eq(&self.scope))
            .filter(r::key.eq(&self.key))
            .filter(r::state.ne(store::COMPLETED));
        let written = if let Some(stored) = err.to_final() {
            match self.response(&stored) {
                Ok(response) => {
                    diesel::update(mine)
                        .set((
                            r::state.eq(store::COMPLETED),
                            r::outcome.eq(store::ERROR),
                            r::response.eq(response),
                        ))
                        .execute(&mut *conn)
                        .await
                }
                Err(e) => return E::from(e),
            }
        } else if !body_ran || err.nothing_sent() {
            diesel::delete(mine).execute(&mut *conn).await
        } else {
            diesel::update(mine.filter(r::state.eq(store::IN_PROGRESS)))
                .set(r::state.eq(store::UNKNOWN))
                .execute(&mut *conn)
                .await
        };
        if let Err(e) = written {
            tracing::error!(key = %self.key, error = %e, "could not settle an external idempotency claim; its lease will expire into outcome unknown");
        }
        err
    }

    fn response(&self, value: &impl Serialize) -> Result<serde_json::Value, IdempotencyError> {
        let response =
            serde_json::to_value(value).map_err(|source| IdempotencyError::Unserializable {
                what: "the response".to_owned(),
                source,
            })?;
        let size = serde_json::to_vec(&response)
            .map(|v| v.len())
            .unwrap_or(usize::MAX);
        if size > self.config.max_response_bytes {
            return Err(IdempotencyError::ResponseTooLarge {
                size,
                limit: self.config.max_response_bytes,
            });
        }
        Ok(response)
    }

    fn record(&self, outcome: &'static str, response: serde_json::Value) -> Box<dyn PreCommit> {
        Box::new(PendingRecord {
            scope: self.scope.clone(),
            key: self.key.clone(),
            outcome,
            response,
        })
    }
}

struct PendingRecord {
    scope: String,
    key: String,
    outcome: &'static str,
    response: serde_json::Value,
}

impl PreCommit for PendingRecord {
    fn run<'c>(
        self: Box<Self>,
        conn: &'c AsyncPgConnection,
    ) -> Pin<Box<dyn Future<Output = QueryResult<()>> + Send + 'c>> {
        Box::pin(async move {
            let this = *self;
            let record = Record {
                scope: &this.scope,
                key: &this.key,
                outcome: this.outcome,
                response: &this.response,
            };
            let mut conn = conn;
            match record.execute(&mut conn).await? {
                1 => Ok(()),
                // The claim is gone (settled by hand meanwhile): do not commit
                // an effect whose record cannot be kept.
                _ => Err(diesel::result::Error::NotFound),
            }
        })
    }
}

fn replay<T: DeserializeOwned, E: IdempotentError>(
    outcome: Option<&str>,
    response: Option<serde_json::Value>,
) -> Result<Idempotent<T>, E> {
    let response = response.unwrap_or(serde_json::Value::Null);
    match outcome {
        Some(store::ERROR) => match serde_json::from_value::<E::Final>(response) {
            Ok(stored) => Err(E::from_final(stored)),
            Err(e) => Err(E::from(IdempotencyError::UnreadableResponse(e))),
        },
        _ => match serde_json::from_value::<T>(response) {
            Ok(value) => Ok(Idempotent {
                value,
                replayed: true,
            }),
            Err(e) => Err(E::from(IdempotencyError::UnreadableResponse(e))),
        },
    }
}

/// The local-mode record of a completed request, as SQL text.
///
/// Every value is dollar-quoted with a tag that does not occur in it (nor
/// straddles its end), so the quoted string means exactly the value: there is
/// no escaping to get wrong, whatever the key, scope or response contain.
fn record_sql(scope: &str, key: &str, response: &serde_json::Value) -> String {
    format!(
        "UPDATE idem_requests SET state = 'completed', outcome = 'ok', response = {}::jsonb, \
         updated_at = now(), lease_until = NULL WHERE scope = {} AND key = {} AND state <> 'completed'",
        dollar_quote(&response.to_string()),
        dollar_quote(scope),
        dollar_quote(key),
    )
}

fn dollar_quote(value: &str) -> String {
    (0u64..)
        .map(|n| format!("$idem{n}$"))
        .find(|tag| format!("{value}{tag}").find(tag.as_str()) == Some(value.len()))
        .map(|tag| format!("{tag}{value}{tag}"))
        .expect("some tag is absent from any finite string")
}

/// The row [`ClaimOrRead`] returns: whether the claim inserted, and the
/// record it saw, if any.
#[derive(Queryable)]
struct ClaimedOrSeen {
    claimed: Option<bool>,
    operation: Option<String>,
    fingerprint: Option<Vec<u8>>,
    state: Option<String>,
    outcome: Option<String>,
    response: Option<serde_json::Value>,
    lease_expired: Option<bool>,
    expired: Option<bool>,
}

impl ClaimedOrSeen {
    fn split(self) -> (Option<bool>, Option<Stored>) {
        let seen = match (self.operation, self.fingerprint, self.state, self.expired) {
            (Some(operation), Some(fingerprint), Some(state), Some(expired)) => Some(Stored {
                operation,
                fingerprint,
                state,
                outcome: self.outcome,
                response: self.response,
                lease_expired: self.lease_expired,
                expired,
            }),
            _ => None,
        };
        (self.claimed, seen)
    }
}

/// What a record means for a request, before it is turned into the caller's error type.
enum Found {
    New,
    Replay(Option<String>, Option<serde_json::Value>),
    Refused(IdempotencyError),
}

impl Found {
    /// A replay wrote nothing: its attempt can end in the background.
    fn into_local_lookup<T: DeserializeOwned, E: IdempotentError>(
        self,
        attempt: &mut Attempt,
    ) -> Lookup<T, E> {
        if let Found::Replay(..) = self {
            attempt.mark_read_only();
        }
        self.into_lookup()
    }

    fn into_lookup<T: DeserializeOwned, E: IdempotentError>(self) -> Lookup<T, E> {
        match self {
            Found::New => Lookup::New,
            Found::Replay(outcome, response) => Lookup::Done(replay(outcome.as_deref(), response)),
            Found::Refused(err) => Lookup::Done(Err(E::from(err))),
        }
    }
}

fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

fn pool_error(e: diesel_async::pooled_connection::deadpool::PoolError) -> diesel::result::Error {
    diesel::result::Error::DatabaseError(
        diesel::result::DatabaseErrorKind::UnableToSendCommand,
        Box::new(format!("could not check out a connection: {e}")),
    )
}

/// What [`purge_expired`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PurgeReport {
    /// Completed records past their retention, deleted.
    pub deleted: u64,
    /// In-progress records whose lease ran out, now marked outcome unknown.
    pub marked_unknown: u64,
    /// Records in outcome unknown, kept until settled.
    pub unknown: u64,
}

/// Delete completed records past their retention, `batch` rows per
/// statement; mark in-progress records whose lease ran out as outcome
/// unknown. In-progress and unknown records are never deleted.
pub async fn purge_expired(conn: &mut AsyncPgConnection, batch: i64) -> QueryResult<PurgeReport> {
    use diesel::dsl::now;
    use idem_requests::dsl as r;
    let mut report = PurgeReport::default();
    loop {
        let deleted = diesel::sql_query(PURGE_BATCH)
            .bind::<diesel::sql_types::BigInt, _>(batch.max(1))
            .execute(conn)
            .await? as u64;
        report.deleted += deleted;
        if deleted == 0 {
            break;
        }
    }
    report.marked_unknown = diesel::update(
        r::idem_requests
            .filter(r::state.eq(store::IN_PROGRESS))
            .filter(r::lease_until.lt(now)),
    )
    .set(r::state.eq(store::UNKNOWN))
    .execute(conn)
    .await? as u64;
    report.unknown = r::idem_requests
        .filter(r::state.eq(store::UNKNOWN))
        .count()
        .get_result::<i64>(conn)
        .await? as u64;
    Ok(report)
}

/// One batch of expired completed records; `SKIP LOCKED` so a purge never
/// waits on, or blocks, a request taking over an expired key.
const PURGE_BATCH: &str = "DELETE FROM idem_requests WHERE ctid = ANY (ARRAY( \
     SELECT ctid FROM idem_requests WHERE state = 'completed' AND expires_at <= now() \
     LIMIT $1 FOR UPDATE SKIP LOCKED))";

/// How [`settle`] decides a record whose outcome was unknown.
#[derive(Debug, Clone)]
pub enum Settlement {
    /// The target system did it: store this response and replay it from now on.
    Completed(serde_json::Value),
    /// The target system did not: release the key, so a retry runs again.
    Released,
}

/// Decide an outcome-unknown (or stuck in-progress) record after checking
/// with the target system. Returns false when there was no such record.
pub async fn settle(
    conn: &mut AsyncPgConnection,
    scope: &str,
    key: &str,
    settlement: Settlement,
) -> QueryResult<bool> {
    use idem_requests::dsl as r;
    let target = r::idem_requests
        .filter(r::scope.eq(scope))
        .filter(r::key.eq(key))
        .filter(r::state.ne(store::COMPLETED));
    let n = match settlement {
        Settlement::Completed(response) => {
            diesel::update(target)
                .set((
                    r::state.eq(store::COMPLETED),
                    r::outcome.eq(store::OK),
                    r::response.eq(response),
                ))
                .execute(conn)
                .await?
        }
        Settlement::Released => diesel::delete(target).execute(conn).await?,
    };
    Ok(n == 1)
}

#[cfg(test)]
mod tests {
    use super::dollar_quote;

    /// What PostgreSQL reads back from a dollar-quoted literal: the text up to
    /// the first occurrence of the closing tag.
    fn unquote(quoted: &str) -> &str {
        let tag_end = quoted[1..].find('$').expect("opening tag") + 2;
        let tag = &quoted[..tag_end];
        let body = &quoted[tag_end..];
        &body[..body.find(tag).expect("closing tag")]
    }

    #[test]
    fn dollar_quoting_round_trips_whatever_the_text() {
        for value in [
            "",
            "plain",
            "it's \"quoted\" \\ back",
            "$idem0$",
            "ends with $idem0",
            "ends with $idem0$idem1",
            "$$ $idem1$ $idem0$ $",
            "'; DROP TABLE idem_requests; --",
        ] {
            assert_eq!(unquote(&dollar_quote(value)), value, "{value:?}");
        }
    }
}
