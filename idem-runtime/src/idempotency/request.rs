//! One idempotent request: its key space, key, operation and fingerprint,
//! validated before anything is written, and what a stored record means for
//! it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use diesel::prelude::*;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use serde::Serialize;
use sha2::{Digest, Sha256};

use super::store::{Claim, ClaimOrRead, HoldUnknown, Identity, Outcome, Read, State};
use super::{
    derived_key, fingerprint, validate_key, Field, IdempotencyConfig, Mode, MAX_STORED_DEPTH,
};
use crate::error::{Error, Unstorable};
use crate::sql::micros;

/// One idempotent request, validated.
#[derive(Debug, Clone)]
#[doc(hidden)]
pub struct Request {
    pub(crate) config: IdempotencyConfig,
    scope: Scope,
    key: String,
    operation: String,
    fingerprint: [u8; 32],
    /// External mode: this call's token on its claim.
    owner: [u8; 16],
}

/// A row of `idem_requests` as a request reads it.
#[derive(Queryable)]
pub(crate) struct Stored {
    pub(super) operation: String,
    pub(super) fingerprint: Vec<u8>,
    pub(super) state: String,
    pub(super) outcome: Option<String>,
    pub(super) response: Option<serde_json::Value>,
    pub(super) lease_expired: Option<bool>,
    pub(super) expired: bool,
    pub(super) owner: Option<Vec<u8>>,
    /// What is left of its retention, in ms (the database's clock).
    pub(super) remaining_ms: i64,
}

/// What a record means for a request.
pub(crate) enum Found {
    /// No live record: the request is new.
    New,
    /// This request's own claim (external mode, its answer was lost).
    Mine,
    /// A completed record: its outcome, response, and what is left of its
    /// retention in ms.
    Replay(Outcome, serde_json::Value, i64),
    /// The answer is a refusal.
    Refused(Error),
}

/// What the claim statement found.
pub(crate) enum Claimed {
    /// This request now owns the key.
    Owned,
    /// A record was there.
    Found(Found),
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
    ) -> Result<Request, Error> {
        let scope = Scope::of(scope)?;
        let fingerprint = fingerprint::fingerprint(fields);
        let key = match key {
            Some(Some(key)) => {
                validate_key(key)?;
                key.to_owned()
            }
            Some(None) => return Err(Error::MissingKey),
            None => derived_key(&scope.hash, operation, &fingerprint),
        };
        Ok(Request {
            config,
            scope,
            key,
            operation: operation.to_owned(),
            fingerprint,
            owner: owner_token(),
        })
    }

    /// The key (given or derived).
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The scope, as stored: the hex SHA-256 of its canonical encoding.
    pub fn scope(&self) -> &str {
        &self.scope.hash
    }

    /// The settings.
    pub fn config(&self) -> &IdempotencyConfig {
        &self.config
    }

    pub(crate) fn external(&self) -> bool {
        self.config.mode == Mode::External
    }

    /// This call's random token: its claim's owner in external mode, and
    /// in every mode what tells its event ids from those of another request
    /// that reuses the key after the record expired.
    pub(crate) fn token(&self) -> &[u8; 16] {
        &self.owner
    }

    /// The owner token of this call's claim (external mode).
    pub(crate) fn owner(&self) -> Option<&[u8]> {
        self.external().then_some(&self.owner[..])
    }

    /// The columns that name this request's record.
    pub(super) fn identity(&self) -> Identity<'_> {
        Identity {
            scope: &self.scope.hash,
            scope_label: self.scope.label.as_deref(),
            key: &self.key,
            operation: &self.operation,
            fingerprint: &self.fingerprint,
        }
    }

    /// The statement that holds this local request's key as outcome unknown.
    pub(crate) fn hold_unknown(&self) -> HoldUnknown<'_> {
        HoldUnknown {
            identity: self.identity(),
            ttl_micros: micros(self.config.ttl),
            owner: &self.owner,
        }
    }

    fn claim_statement(&self) -> Claim<'_> {
        Claim {
            identity: self.identity(),
            mode: self.config.mode.as_str(),
            ttl_micros: micros(self.config.ttl),
            lease_micros: self.external().then(|| micros(self.config.lease)),
            owner: self.owner(),
        }
    }

    /// Claim the key, or read the record that holds it, in one statement.
    ///
    /// The claim leaves a live record it sees alone (no lock). Against a
    /// concurrent first request whose claim is not committed yet, it waits for
    /// that transaction; once it committed, the record is read again (the next
    /// READ COMMITTED statement sees it).
    pub(crate) async fn claim(&self, conn: &mut AsyncPgConnection) -> QueryResult<Claimed> {
        let row: ClaimedOrSeen = ClaimOrRead(self.claim_statement()).get_result(conn).await?;
        let (claimed, seen) = row.split();
        if claimed.is_some() {
            return Ok(Claimed::Owned);
        }
        if let Some(stored) = seen {
            match self.judge(stored) {
                Found::New => {}
                found => return Ok(Claimed::Found(found)),
            }
        }
        // The read came too early to see the record the claim met.
        let stored = Read {
            scope: &self.scope.hash,
            key: &self.key,
        }
        .get_result::<Stored>(conn)
        .await
        .optional()?;
        Ok(Claimed::Found(stored.map_or(Found::New, |s| self.judge(s))))
    }

    /// The operation the record is made for.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn operation(&self) -> &str {
        &self.operation
    }

    /// The request's fingerprint.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn fingerprint(&self) -> &[u8; 32] {
        &self.fingerprint
    }

    /// The advisory lock of this scope and key: the first 8 bytes of their
    /// SHA-256 (the domain keeps it apart from other users of the digest).
    pub(super) fn lock_key(&self) -> i64 {
        lock_key(&self.scope.hash, &self.key)
    }

    /// What an existing record means for this request.
    pub(crate) fn judge(&self, stored: Stored) -> Found {
        let state = State::parse(&stored.state);
        if state == Some(State::Completed) && stored.expired {
            return Found::New;
        }
        // Compare the request before anything else: a different request must
        // not even learn whether the first one finished.
        if stored.operation != self.operation || stored.fingerprint != self.fingerprint {
            return Found::Refused(Error::FingerprintMismatch);
        }
        let mine = self.owner().is_some() && stored.owner.as_deref() == self.owner();
        match state {
            Some(State::Completed) => {
                match (
                    stored.outcome.as_deref().and_then(Outcome::parse),
                    stored.response,
                ) {
                    (Some(outcome), Some(response)) => {
                        Found::Replay(outcome, response, stored.remaining_ms)
                    }
                    // Never a replay of what the record does not say.
                    (None, _) => Found::Refused(Error::MalformedRecord {
                        reason: "completed without an outcome of ok or error",
                    }),
                    (Some(_), None) => Found::Refused(Error::MalformedRecord {
                        reason: "completed without a response",
                    }),
                }
            }
            Some(State::InProgress) if mine => Found::Mine,
            Some(State::InProgress) if stored.lease_expired != Some(true) => {
                Found::Refused(Error::InProgress)
            }
            // Unknown, or in progress past its lease: never an automatic re-run.
            Some(State::InProgress | State::Unknown) => Found::Refused(Error::OutcomeUnknown),
            None => Found::Refused(Error::MalformedRecord {
                reason: "a state other than in_progress, completed or unknown",
            }),
        }
    }

    /// The stored form of a response or final error: refused, before
    /// anything is written, when PostgreSQL could not store it or idem could
    /// not read it back (see [`Unstorable`]).
    pub(crate) fn response(&self, value: &impl Serialize) -> Result<serde_json::Value, Error> {
        let response = serde_json::to_value(value).map_err(|source| Error::Unserializable {
            what: "the response".to_owned(),
            source,
        })?;
        storable(&response, self.config.max_response_bytes)
            .map_err(Error::Unstorable)
            .map(|()| response)
    }
}

/// Whether `value` can be stored in `jsonb` and read back: no U+0000 (jsonb
/// refuses it), nesting within [`MAX_STORED_DEPTH`] (deeper, serde_json's
/// reader would refuse the stored row on every replay), and at most `limit`
/// bytes of JSON.
pub(crate) fn storable(value: &serde_json::Value, limit: usize) -> Result<(), Unstorable> {
    // Depth and NUL first: both are found without writing the JSON out.
    check_tree(value, 0)?;
    let size = serde_json::to_vec(value).map_or(usize::MAX, |v| v.len());
    if size > limit {
        return Err(Unstorable::TooLarge { size, limit });
    }
    Ok(())
}

/// [`storable`] without a size limit: no U+0000, nesting within
/// [`MAX_STORED_DEPTH`]. For the other JSON idem stores and reads back (an
/// outbox event, a job's payload).
pub(crate) fn storable_tree(value: &serde_json::Value) -> Result<(), Unstorable> {
    check_tree(value, 0)
}

fn check_tree(value: &serde_json::Value, depth: usize) -> Result<(), Unstorable> {
    use serde_json::Value;
    let nested = |depth: usize| {
        if depth >= MAX_STORED_DEPTH {
            Err(Unstorable::TooDeep {
                limit: MAX_STORED_DEPTH,
            })
        } else {
            Ok(depth + 1)
        }
    };
    match value {
        Value::String(s) if s.contains('\0') => Err(Unstorable::NulCharacter),
        Value::Array(items) => {
            let depth = nested(depth)?;
            items.iter().try_for_each(|item| check_tree(item, depth))
        }
        Value::Object(map) => {
            let depth = nested(depth)?;
            map.iter().try_for_each(|(key, item)| {
                if key.contains('\0') {
                    return Err(Unstorable::NulCharacter);
                }
                check_tree(item, depth)
            })
        }
        _ => Ok(()),
    }
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
    owner: Option<Vec<u8>>,
    remaining_ms: Option<i64>,
}

impl ClaimedOrSeen {
    fn split(self) -> (Option<bool>, Option<Stored>) {
        let seen = match (
            self.operation,
            self.fingerprint,
            self.state,
            self.expired,
            self.remaining_ms,
        ) {
            (
                Some(operation),
                Some(fingerprint),
                Some(state),
                Some(expired),
                Some(remaining_ms),
            ) => Some(Stored {
                operation,
                fingerprint,
                state,
                outcome: self.outcome,
                response: self.response,
                lease_expired: self.lease_expired,
                expired,
                owner: self.owner,
                remaining_ms,
            }),
            _ => None,
        };
        (self.claimed, seen)
    }
}

/// A key space as stored. The hash names it: the SHA-256 of the scope's
/// canonical encoding (the fingerprint's rules, so one logical scope is one
/// key space whatever its map order, and any size fits the primary key).
/// The label is for people reading the table: the scope's compact JSON when
/// it is short, else none.
#[derive(Debug, Clone)]
pub(crate) struct Scope {
    pub(crate) hash: String,
    pub(crate) label: Option<String>,
}

/// Longest label kept beside a scope's hash, in bytes.
const SCOPE_LABEL_MAX: usize = 200;

impl Scope {
    /// Requests and [`settle`](super::settle) both encode a scope here, so
    /// they name the same key space.
    pub(crate) fn of<S: Serialize + ?Sized>(scope: &S) -> Result<Scope, Error> {
        let canonical = fingerprint::encode_as(scope, || "the scope".to_owned())?;
        let mut hasher = Sha256::new();
        hasher.update(b"idem-scope-v1");
        hasher.update(&canonical);
        let hash = fingerprint::hex(&hasher.finalize());
        let label = serde_json::to_string(scope)
            .ok()
            .filter(|label| label.len() <= SCOPE_LABEL_MAX);
        Ok(Scope { hash, label })
    }
}

/// The advisory lock local mode takes for a stored scope and a key (tests
/// hold it from outside to stand in for a colliding request).
#[doc(hidden)]
pub fn lock_key(scope_hash: &str, key: &str) -> i64 {
    let mut hasher = Sha256::new();
    hasher.update(b"idem-lock-v1");
    hasher.update(scope_hash.as_bytes());
    hasher.update([0]);
    hasher.update(key.as_bytes());
    let digest = hasher.finalize();
    let mut first = [0; 8];
    first.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(first)
}

/// A token no other call holds: a hash of the process, the time and a
/// counter. Unguessability is not needed (the token only tells a call's own
/// claim apart), uniqueness is.
fn owner_token() -> [u8; 16] {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut hasher = Sha256::new();
    hasher.update(std::process::id().to_le_bytes());
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    hasher.update(now.as_nanos().to_le_bytes());
    hasher.update(COUNTER.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    let digest = hasher.finalize();
    let mut token = [0; 16];
    token.copy_from_slice(&digest[..16]);
    token
}
