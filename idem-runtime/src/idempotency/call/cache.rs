//! The replay cache's part in a call: answering from it before any
//! database work, and copying the completed record to it after.

use serde::de::DeserializeOwned;

use super::{replay, Call};
use crate::idempotency::store::Outcome;
use crate::idempotency::{Idempotent, IdempotentError};
use crate::pool::Pool;

impl<E> Call<E> {
    /// Read replays from `cache` first, and copy completed records to it.
    #[cfg(feature = "redis")]
    pub fn set_cache(&mut self, cache: Option<&super::super::ReplayCache>) {
        self.cache = cache.cloned();
    }

    /// The answer from the replay cache, before any database work: only an
    /// entry for this very request (operation and fingerprint), readable as
    /// `V` or as a final error. Anything else is `None`, and the database
    /// answers.
    #[cfg(feature = "redis")]
    pub async fn cached<V: DeserializeOwned>(&self, pool: &Pool) -> Option<Result<Idempotent<V>, E>>
    where
        E: IdempotentError,
    {
        let cache = self.cache.as_ref()?;
        let entry = cache
            .lookup(
                pool,
                self.request.scope(),
                self.request.key(),
                self.cache_entry_limit(),
            )
            .await?;
        if entry.operation != self.request.operation()
            || entry.fingerprint != *self.request.fingerprint()
        {
            cache.mismatch();
            return None;
        }
        let outcome = if entry.error {
            Outcome::Error
        } else {
            Outcome::Ok
        };
        // The same reading as a replay from the database, of the same JSON.
        let read = serde_json::from_slice(&entry.response)
            .ok()
            .and_then(|response| replay::<V, E>(outcome, response).ok());
        let Some(read) = read else {
            cache.unreadable();
            return None;
        };
        cache.hit();
        Some(match read {
            Ok(value) => Ok(Idempotent {
                value,
                replayed: true,
            }),
            Err(stored) => Err(E::from_final(stored)),
        })
    }

    /// Copy the record this call ended with to the cache.
    #[cfg(feature = "redis")]
    pub(super) async fn fill_cache(&mut self, pool: &Pool) {
        let (Some(cache), Some(done)) = (&self.cache, self.completed.take()) else {
            return;
        };
        // The JSON of the stored value: read back, it is that value again,
        // as a database replay reads it.
        let Ok(response) = serde_json::to_vec(&done.response) else {
            return;
        };
        let entry = super::super::cache::Entry {
            error: done.error,
            operation: self.request.operation().to_owned(),
            fingerprint: *self.request.fingerprint(),
            response,
        };
        let (scope, key) = (self.request.scope(), self.request.key());
        let limit = self.cache_entry_limit();
        cache
            .store(pool, scope, key, &entry, done.remaining, limit)
            .await;
    }

    /// The most bytes a cache entry of this call may hold: its response's
    /// limit, with room for `jsonb`'s longer forms (`1e300` is stored with
    /// its 301 digits) and the entry's own fields.
    #[cfg(feature = "redis")]
    fn cache_entry_limit(&self) -> usize {
        self.request
            .config
            .max_response_bytes
            .saturating_mul(4)
            .saturating_add(64 * 1024)
    }
}
