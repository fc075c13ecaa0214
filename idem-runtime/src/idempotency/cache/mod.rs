//! A Redis front cache of replays (feature `redis`): a storm of retried
//! duplicates, absorbed before it reaches the database.
//!
//! A completed record (the operation and fingerprint it was made for,
//! whether it holds a value or a final error, and its response *as the
//! database stores it*) is copied to Redis once its transaction committed,
//! and again when a replay read it from the database. A request with a
//! cache looks there first: an entry for the same operation and fingerprint
//! is replayed without a connection being checked out. Everything else goes
//! to the database, which stays the arbiter:
//!
//! * the cache only answers what the database would answer for that scope
//!   and key: every entry is sealed (HMAC-SHA-256) over its scope, key and
//!   bytes, with a key derived from a secret the database holds
//!   (`idem_cache_secret`) and from its life (its oid, the server's start
//!   time, the records table's identity), so an entry written by someone who can only
//!   write to Redis, altered, copied under another scope or key, made by
//!   another database, or made before the database was restored, recreated
//!   or its secret rotated, is refused, and the database answers;
//! * a miss, an entry for another request (the database answers 422), an
//!   entry that cannot be read or is refused, Redis down or slower than
//!   [`CacheConfig::timeout`]: the request goes on as if there were no
//!   cache. After a failure Redis is left alone for [`CacheConfig::backoff`],
//!   so a dead Redis costs one timeout per back-off, not one per request;
//! * the cache never says a key is new, and never holds an in-progress or
//!   outcome-unknown record: only what a database replay would answer;
//! * an entry lives at most [`CacheConfig::max_ttl`], and at most half of
//!   what is left of the record's retention (by the database's clock), so it
//!   never outlives the record's retention; the time it may be served until
//!   is sealed in it, so removing its TTL in Redis does not keep it alive. A
//!   record an operator corrects or deletes by hand (`idem key settle
//!   --force`) may still be answered from an entry copied before, until it
//!   expires.
//!
//! Entries are keyed by a SHA-256 of the stored scope and the key (records
//! are one per (scope, key)), under [`CacheConfig::prefix`]; the caller's
//! key never appears in Redis.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use sha2::{Digest, Sha256};

use super::fingerprint;
use crate::pool::Pool;
use entry::Refused;
pub(crate) use entry::{now_millis, Entry};

mod entry;
mod keyring;

/// Settings of a [`ReplayCache`]; each has a documented default.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheConfig {
    /// The longest a request waits for Redis, per command, before going to
    /// the database. Default 30 ms.
    pub timeout: Duration,
    /// How long Redis is left alone after a command failed or timed out.
    /// Default 1 s.
    pub backoff: Duration,
    /// The longest an entry is kept. Default 5 min; an entry is also kept at
    /// most half of what is left of its record's retention. It is also how
    /// long a record an operator corrected or deleted by hand
    /// (`idem key settle --force`) may still be answered from its entry.
    /// Under a millisecond, no entry is written.
    pub max_ttl: Duration,
    /// Prepended to every key the cache writes. Default `idem:replay:`.
    pub prefix: String,
    /// How long the key entries are sealed with is trusted once read from
    /// the database; it is read again in the background after half of it.
    /// An entry of a database's earlier life (before a restore, a re-creation
    /// or a rotation of its secret) is served at most this long after the
    /// key was last read from it. Default 1 s. Zero reads the key from the
    /// database before every lookup, which costs what the cache saves.
    pub recheck: Duration,
}

impl CacheConfig {
    /// The defaults.
    pub fn new() -> Self {
        CacheConfig {
            timeout: Duration::from_millis(30),
            backoff: Duration::from_secs(1),
            max_ttl: Duration::from_secs(300),
            prefix: "idem:replay:".to_owned(),
            recheck: Duration::from_secs(1),
        }
    }
    /// Set [`timeout`](Self::timeout).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
    /// Set [`backoff`](Self::backoff).
    pub fn backoff(mut self, backoff: Duration) -> Self {
        self.backoff = backoff;
        self
    }
    /// Set [`max_ttl`](Self::max_ttl).
    pub fn max_ttl(mut self, max_ttl: Duration) -> Self {
        self.max_ttl = max_ttl;
        self
    }
    /// Set [`prefix`](Self::prefix).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }
    /// Set [`recheck`](Self::recheck).
    pub fn recheck(mut self, recheck: Duration) -> Self {
        self.recheck = recheck;
        self
    }
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self::new()
    }
}

/// Why a [`ReplayCache`] could not be built.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum CacheError {
    /// The URL is not one the Redis client accepts.
    #[error("invalid Redis URL {url:?}: {reason}")]
    InvalidUrl {
        /// The URL given.
        url: String,
        /// The client's reason.
        reason: String,
    },
}

/// What the cache did since it was built, as counted by the cache itself
/// (for dashboards; tests count from Redis and the database instead).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Requests answered from Redis.
    pub hits: u64,
    /// Lookups that found no entry.
    pub misses: u64,
    /// Entries for another operation or fingerprint (the database answers).
    pub mismatches: u64,
    /// Entries that could not be read (the database answers).
    pub unreadable: u64,
    /// Entries whose seal did not verify, or whose time was past: forged,
    /// altered, copied from another scope or key, or made by another
    /// database or before a restore (the database answers).
    pub rejected: u64,
    /// Commands that failed or timed out (each starts a back-off).
    pub failures: u64,
    /// Lookups and writes skipped during a back-off, or because the key
    /// could not be read from the database.
    pub skipped: u64,
    /// Entries written.
    pub writes: u64,
}

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    mismatches: AtomicU64,
    unreadable: AtomicU64,
    rejected: AtomicU64,
    failures: AtomicU64,
    skipped: AtomicU64,
    writes: AtomicU64,
}

/// A Redis front cache of completed idempotency records. Cheap to clone
/// (one shared multiplexed connection, which reconnects by itself); build
/// one per process and hand it to `#[idempotent(.., cache = ..)]`.
///
/// The database stays the arbiter: only completed records are copied (after
/// their commit, and after a replay read one), in the form `jsonb` stored
/// them, so a replay from Redis is the database's replay byte for byte.
/// Every entry is sealed with a key derived from the database's secret and
/// life, over its scope and key: one that does not verify is refused. A
/// miss, a refused or unreadable entry, an entry made for another operation
/// or fingerprint, or Redis failing or slower than [`CacheConfig::timeout`]
/// sends the request to the database (and, after a failure, Redis is left
/// alone for [`CacheConfig::backoff`]). The cache never says a key is new,
/// and an entry lives at most `min(max_ttl, half the record's remaining
/// retention)`.
///
/// One cache serves one database (the key it seals with is that
/// database's); give each database its own cache and prefix.
///
/// ```no_run
/// # fn demo() -> Result<(), idem_runtime::idempotency::CacheError> {
/// use idem_runtime::idempotency::{CacheConfig, ReplayCache};
/// let cache = ReplayCache::with_config(
///     "redis://127.0.0.1:6379",
///     CacheConfig::new().timeout(std::time::Duration::from_millis(20)),
/// )?;
/// # let _ = cache; Ok(()) }
/// ```
#[derive(Clone)]
pub struct ReplayCache {
    inner: Arc<Inner>,
}

struct Inner {
    conn: ConnectionManager,
    config: CacheConfig,
    /// Until when Redis is left alone after a failure.
    resting_until: Mutex<Option<Instant>>,
    /// The key entries are sealed with, per pool, as read from the database
    /// the pool reaches: a request is only ever answered with an entry its
    /// own database sealed, however many databases share the cache.
    keyrings: Mutex<HashMap<u64, Arc<keyring::Keyring>>>,
    counters: Counters,
}

impl std::fmt::Debug for ReplayCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplayCache")
            .field("config", &self.inner.config)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl ReplayCache {
    /// A cache on the Redis at `url` (`redis://host:port[/db]`), with the
    /// default [`CacheConfig`]. Nothing is connected yet: the first request
    /// connects, and a Redis that is down only costs the back-off.
    pub fn new(url: &str) -> Result<ReplayCache, CacheError> {
        Self::with_config(url, CacheConfig::new())
    }

    /// A cache on the Redis at `url` with `config`.
    pub fn with_config(url: &str, config: CacheConfig) -> Result<ReplayCache, CacheError> {
        let invalid = |e: redis::RedisError| CacheError::InvalidUrl {
            url: url.to_owned(),
            reason: e.to_string(),
        };
        let client = redis::Client::open(url).map_err(invalid)?;
        // One try per command and no retry loop of the client's own: the
        // caller's timeout and back-off decide when Redis is tried again.
        let manager = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(config.timeout))
            .set_response_timeout(Some(config.timeout))
            .set_number_of_retries(0);
        let conn = client
            .get_connection_manager_lazy(manager)
            .map_err(invalid)?;
        Ok(ReplayCache {
            inner: Arc::new(Inner {
                conn,
                config,
                resting_until: Mutex::new(None),
                keyrings: Mutex::default(),
                counters: Counters::default(),
            }),
        })
    }

    /// Its settings.
    pub fn config(&self) -> &CacheConfig {
        &self.inner.config
    }

    /// What it did so far.
    pub fn stats(&self) -> CacheStats {
        let c = &self.inner.counters;
        let get = |n: &AtomicU64| n.load(Ordering::Relaxed);
        CacheStats {
            hits: get(&c.hits),
            misses: get(&c.misses),
            mismatches: get(&c.mismatches),
            unreadable: get(&c.unreadable),
            rejected: get(&c.rejected),
            failures: get(&c.failures),
            skipped: get(&c.skipped),
            writes: get(&c.writes),
        }
    }

    /// The Redis key of the record of `key` in the stored scope `scope`.
    pub fn redis_key(&self, scope: &str, key: &str) -> String {
        let mut hasher = Sha256::new();
        hasher.update(b"idem-replay-v1");
        hasher.update(scope.as_bytes());
        hasher.update([0]);
        hasher.update(key.as_bytes());
        format!(
            "{}{}",
            self.inner.config.prefix,
            fingerprint::hex(&hasher.finalize())
        )
    }

    /// Read the key entries are sealed with from `pool`'s database now,
    /// rather than at the first request that uses the cache with this pool
    /// (one small query; later reads happen in the background). Returns
    /// whether it could be read: without `idem::migrate`'s migration 12, or
    /// with the database down, the cache is not used with this pool until it
    /// can.
    ///
    /// ```no_run
    /// # async fn demo(pool: idem_runtime::Pool) -> Result<(), idem_runtime::idempotency::CacheError> {
    /// let cache = idem_runtime::idempotency::ReplayCache::new("redis://127.0.0.1:6379")?;
    /// if !cache.prepare(&pool).await {
    ///     eprintln!("replay cache off until the database answers");
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn prepare(&self, pool: &Pool) -> bool {
        self.seal_key(pool).await.is_some()
    }

    /// The key to seal with for a request on `pool`, if it can be had.
    async fn seal_key(&self, pool: &Pool) -> Option<entry::SealKey> {
        let config = &self.inner.config;
        let keyring = {
            let mut keyrings = self.inner.keyrings.lock().ok()?;
            // Pools are few and live as long as the process; a pool dropped
            // leaves one small entry behind.
            Arc::clone(keyrings.entry(pool.id()).or_default())
        };
        let key = keyring.key(pool, config.recheck, config.backoff).await;
        if key.is_none() {
            self.count(|c| &c.skipped);
        }
        key
    }

    /// The entry of a record, if Redis answers in time and has one that
    /// verifies for this scope and key. At most `limit` bytes are read: a
    /// larger value is no entry this cache wrote (see [`Self::store`]).
    pub(crate) async fn lookup(
        &self,
        pool: &Pool,
        scope: &str,
        key: &str,
        limit: usize,
    ) -> Option<Entry> {
        let seal = self.seal_key(pool).await?;
        let mut conn = self.inner.conn.clone();
        // GETRANGE, not GET: a huge value planted under the key costs one
        // bounded read, not a transfer that outlasts the timeout and sends
        // every request to the database.
        let get = redis::cmd("GETRANGE")
            .arg(self.redis_key(scope, key))
            .arg(0)
            .arg(limit)
            .to_owned();
        let bytes: Vec<u8> = match self
            .guarded(async move { get.query_async(&mut conn).await })
            .await
        {
            Answer::Done(bytes) => bytes,
            Answer::Unusable => {
                self.count(|c| &c.rejected);
                return None;
            }
            Answer::Unavailable => return None,
        };
        if bytes.is_empty() {
            self.count(|c| &c.misses);
            return None;
        }
        if bytes.len() > limit {
            self.count(|c| &c.rejected);
            return None;
        }
        match Entry::open(&bytes, &seal, scope, key, now_millis()) {
            Ok(entry) => Some(entry),
            Err(Refused::Unreadable) => {
                self.count(|c| &c.unreadable);
                None
            }
            Err(Refused::Rejected) => {
                self.count(|c| &c.rejected);
                tracing::warn!(redis_key = %self.redis_key(scope, key), "a replay cache entry failed its check (forged, altered, copied, or from another database or an earlier life of this one): the database answers");
                None
            }
        }
    }

    /// Keep `entry` for at most half of `remaining` (the record's retention
    /// left) and [`CacheConfig::max_ttl`], sealed for this scope and key;
    /// not at all when it is over `limit` bytes, which a lookup would not
    /// read.
    pub(crate) async fn store(
        &self,
        pool: &Pool,
        scope: &str,
        key: &str,
        entry: &Entry,
        remaining: Duration,
        limit: usize,
    ) {
        let ttl = self.inner.config.max_ttl.min(remaining / 2);
        let millis = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        if millis == 0 {
            return;
        }
        let Some(seal) = self.seal_key(pool).await else {
            return;
        };
        let sealed = entry.seal(&seal, scope, key, now_millis().saturating_add(millis));
        if sealed.len() > limit {
            return;
        }
        let mut conn = self.inner.conn.clone();
        let set = redis::cmd("SET")
            .arg(self.redis_key(scope, key))
            .arg(sealed)
            .arg("PX")
            .arg(millis)
            .to_owned();
        let written: Answer<()> = self
            .guarded(async move { set.query_async(&mut conn).await })
            .await;
        if let Answer::Done(()) = written {
            self.count(|c| &c.writes);
        }
    }

    pub(crate) fn hit(&self) {
        self.count(|c| &c.hits);
    }

    pub(crate) fn mismatch(&self) {
        self.count(|c| &c.mismatches);
    }

    pub(crate) fn unreadable(&self) {
        self.count(|c| &c.unreadable);
    }

    fn count(&self, counter: impl FnOnce(&Counters) -> &AtomicU64) {
        counter(&self.inner.counters).fetch_add(1, Ordering::Relaxed);
    }

    /// Run one command within the timeout, unless Redis is resting. A
    /// failure of Redis starts its rest; an error about the one key (a value
    /// of another type planted there) does not: it would let one forged key
    /// turn the cache off for every other.
    async fn guarded<T>(
        &self,
        command: impl std::future::Future<Output = redis::RedisResult<T>>,
    ) -> Answer<T> {
        let resting = self.inner.resting_until.lock().map(|g| *g).ok().flatten();
        if resting.is_some_and(|until| Instant::now() < until) {
            self.count(|c| &c.skipped);
            return Answer::Unavailable;
        }
        let failure = match tokio::time::timeout(self.inner.config.timeout, command).await {
            Ok(Ok(value)) => return Answer::Done(value),
            Ok(Err(e)) if of_the_key(&e) => {
                tracing::warn!(error = %e, "a replay cache entry is not a value the cache wrote: the database answers");
                return Answer::Unusable;
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {:?}", self.inner.config.timeout),
        };
        self.count(|c| &c.failures);
        let backoff = self.inner.config.backoff;
        if let Ok(mut until) = self.inner.resting_until.lock() {
            *until = Some(Instant::now() + backoff);
        }
        tracing::warn!(error = %failure, ?backoff, "the replay cache is unavailable: requests go to the database");
        Answer::Unavailable
    }
}

/// What a Redis command came to.
enum Answer<T> {
    Done(T),
    /// Redis answered, with an error about the key: nothing to serve, and
    /// no reason to leave Redis alone.
    Unusable,
    /// Redis failed, timed out, or is resting.
    Unavailable,
}

/// Whether Redis refused the command because of what the key holds (a hash
/// or a list where a string should be), rather than failing.
fn of_the_key(e: &redis::RedisError) -> bool {
    e.code() == Some("WRONGTYPE") || e.kind() == redis::ErrorKind::UnexpectedReturnType
}

/// A value usable as `cache = ..` in `#[idempotent]`: a [`ReplayCache`], a
/// reference to one, an `Arc` of one, or an `Option` of these (`None`: no
/// cache for this call).
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a replay cache",
    label = "`cache = ..` takes this",
    note = "give `cache = ` an `idem::idempotency::ReplayCache` (or a reference, an `Arc` or an `Option` of one)"
)]
pub trait CacheInput {
    /// The cache, if there is one.
    fn replay_cache(&self) -> Option<&ReplayCache>;
}

impl CacheInput for ReplayCache {
    fn replay_cache(&self) -> Option<&ReplayCache> {
        Some(self)
    }
}
impl<T: CacheInput + ?Sized> CacheInput for &T {
    fn replay_cache(&self) -> Option<&ReplayCache> {
        (**self).replay_cache()
    }
}
impl<T: CacheInput + ?Sized> CacheInput for Arc<T> {
    fn replay_cache(&self) -> Option<&ReplayCache> {
        (**self).replay_cache()
    }
}
impl<T: CacheInput> CacheInput for Option<T> {
    fn replay_cache(&self) -> Option<&ReplayCache> {
        self.as_ref().and_then(CacheInput::replay_cache)
    }
}
