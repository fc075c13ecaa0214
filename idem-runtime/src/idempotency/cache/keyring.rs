//! The key the cache seals its entries with, and how it follows the
//! database.
//!
//! The key is derived from a random secret the database holds
//! (`idem_cache_secret`, made by `idem::migrate`) and from what identifies
//! this database's life: its oid, the server's start time, and the records
//! table's oid and file. A database recreated or migrated from scratch has
//! a new secret; a restore, whether of files (the server starts again) or by
//! `pg_restore` (the tables are made again or truncated, the secret's row
//! written again), changes the rest. Entries sealed before any of these are
//! refused.
//!
//! A hit must not cost a database round trip, so the key is kept in memory
//! and trusted for [`CacheConfig::recheck`](super::CacheConfig::recheck):
//! past half of that it is read again in the background, past all of it the
//! next request reads it first. So an entry of a database's earlier life is
//! served at most `recheck` after the last time its key was read from it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use diesel::sql_types::{BigInt, Binary};
use diesel_async::RunQueryDsl;
use sha2::{Digest, Sha256};

use super::entry::SealKey;
use crate::pool::Pool;

/// The longest a request waits for the key to be read (checkout included)
/// before going on without the cache.
const READ_TIMEOUT: Duration = Duration::from_secs(1);

/// The secret and the marks of the database's life, in one round trip.
const READ_SQL: &str = "\
SELECT s.secret, \
       s.xmin::text::int8 AS secret_row, \
       d.oid::int8 AS database, \
       (extract(epoch FROM pg_postmaster_start_time()) * 1000000)::int8 AS started, \
       c.oid::int8 AS records, \
       pg_relation_filenode(c.oid)::int8 AS records_file \
FROM idem_cache_secret s, pg_database d, pg_class c \
WHERE d.datname = current_database() AND c.oid = 'idem_requests'::regclass";

#[derive(diesel::QueryableByName)]
struct Life {
    #[diesel(sql_type = Binary)]
    secret: Vec<u8>,
    #[diesel(sql_type = BigInt)]
    secret_row: i64,
    #[diesel(sql_type = BigInt)]
    database: i64,
    #[diesel(sql_type = BigInt)]
    started: i64,
    #[diesel(sql_type = BigInt)]
    records: i64,
    #[diesel(sql_type = BigInt)]
    records_file: i64,
}

impl Life {
    fn key(&self) -> SealKey {
        let mut hasher = Sha256::new();
        hasher.update(b"idem-cache-key-v1\0");
        hasher.update((self.secret.len() as u64).to_be_bytes());
        hasher.update(&self.secret);
        for mark in [
            self.secret_row,
            self.database,
            self.started,
            self.records,
            self.records_file,
        ] {
            hasher.update(mark.to_be_bytes());
        }
        SealKey(hasher.finalize().into())
    }
}

#[derive(Clone, Copy)]
struct Known {
    key: SealKey,
    /// When the read that found it was sent.
    read_at: Instant,
}

/// The key as last read, and the reads in flight.
#[derive(Default)]
pub(crate) struct Keyring {
    known: RwLock<Option<Known>>,
    /// One read at a time when a request must wait for it.
    reading: tokio::sync::Mutex<()>,
    /// A background read is under way.
    refreshing: AtomicBool,
    /// Until when a failed read is not tried again.
    resting_until: Mutex<Option<Instant>>,
}

impl Keyring {
    fn known(&self) -> Option<Known> {
        self.known.read().ok().and_then(|k| *k)
    }

    /// The key for a request on `pool`, trusted for `recheck`; `None` when
    /// it cannot be read now (the request goes to the database).
    pub(crate) async fn key(
        self: &Arc<Self>,
        pool: &Pool,
        recheck: Duration,
        backoff: Duration,
    ) -> Option<SealKey> {
        if let Some(known) = self.known() {
            let age = known.read_at.elapsed();
            if age < recheck {
                if age >= recheck / 2 && !self.refreshing.swap(true, Ordering::AcqRel) {
                    let (ring, pool) = (Arc::clone(self), pool.clone());
                    tokio::spawn(async move {
                        ring.read(&pool, backoff).await;
                        ring.refreshing.store(false, Ordering::Release);
                    });
                }
                return Some(known.key);
            }
        }
        let _one = self.reading.lock().await;
        if let Some(known) = self.known().filter(|k| k.read_at.elapsed() < recheck) {
            return Some(known.key);
        }
        let resting = self.resting_until.lock().ok().and_then(|g| *g);
        if resting.is_some_and(|until| Instant::now() < until) {
            return None;
        }
        self.read(pool, backoff).await
    }

    /// Read the key from the database; a failure rests for `backoff`.
    async fn read(&self, pool: &Pool, backoff: Duration) -> Option<SealKey> {
        let read_at = Instant::now();
        let read = async {
            let mut conn = pool.get().await.map_err(|e| e.to_string())?;
            // In a transaction, as everything idem runs: behind a
            // transaction pooler a bare statement's Parse and Bind may reach
            // different server connections.
            conn.build_transaction()
                .read_only()
                .run(async |conn| diesel::sql_query(READ_SQL).get_result::<Life>(conn).await)
                .await
                .map_err(|e: diesel::result::Error| e.to_string())
        };
        let failure = match tokio::time::timeout(READ_TIMEOUT, read).await {
            Ok(Ok(life)) => {
                let key = life.key();
                let before = self.known().map(|k| k.key);
                if let Ok(mut known) = self.known.write() {
                    *known = Some(Known { key, read_at });
                }
                if before.is_some_and(|b| b != key) {
                    tracing::info!("the database's secret or life changed (recreated, restored or rotated): earlier replay cache entries are refused");
                }
                return Some(key);
            }
            Ok(Err(e)) => e,
            Err(_) => format!("no answer within {READ_TIMEOUT:?}"),
        };
        if let Ok(mut until) = self.resting_until.lock() {
            *until = Some(Instant::now() + backoff);
        }
        tracing::warn!(error = %failure, ?backoff, "the replay cache's key could not be read from the database (has idem::migrate run?): requests go to the database");
        None
    }
}
