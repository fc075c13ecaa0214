//! The form of an entry in Redis, and its seal.
//!
//! An entry is only a copy of what the database would answer, and Redis is
//! not trusted to keep it honest: anyone who can write there (another
//! service sharing it, a snapshot restored from another environment) could
//! otherwise replace a response or copy one tenant's entry under another's
//! key. So every entry carries an HMAC-SHA-256 over its scope, its key and
//! all its bytes, under a key derived from the database's own secret and
//! life ([`super::keyring`]), and the time until which it may be served. An
//! entry that does not verify is not read at all.

use std::time::{SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// A completed record as the cache keeps it.
pub(crate) struct Entry {
    pub(crate) error: bool,
    pub(crate) operation: String,
    pub(crate) fingerprint: [u8; 32],
    /// The stored response's JSON.
    pub(crate) response: Vec<u8>,
}

/// The key entries are sealed with: what [`super::keyring`] derives from
/// the database.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct SealKey(pub(crate) [u8; 32]);

/// Why a value found in Redis is not served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// Not an entry of this format (an older idem, a truncated value).
    Unreadable,
    /// Its seal does not verify (forged, altered, copied from another scope
    /// or key, made by another database or before a restore or rotation),
    /// or its time is past (a TTL removed in Redis).
    Rejected,
}

/// The first bytes of every entry: a format version, so another format is
/// read as a miss rather than misread.
const MAGIC: &[u8; 4] = b"idr2";
/// The seal's length, at the end of the entry.
const TAG: usize = 32;
/// MAGIC, the error flag, the fingerprint, the deadline, the operation's length.
const HEAD: usize = 4 + 1 + 32 + 8 + 4;

type HmacSha256 = Hmac<Sha256>;

/// The MAC over the entry's bytes and the scope and key it is served for.
/// Both are length-prefixed, so no two (scope, key) pairs share an input.
fn mac(key: &SealKey, scope: &str, record_key: &str, body: &[u8]) -> HmacSha256 {
    let mut mac = HmacSha256::new_from_slice(&key.0).expect("HMAC takes a key of any length");
    mac.update(b"idem-replay-v2\0");
    for part in [scope.as_bytes(), record_key.as_bytes()] {
        mac.update(&(part.len() as u64).to_be_bytes());
        mac.update(part);
    }
    mac.update(body);
    mac
}

/// Milliseconds since the Unix epoch, by this process's clock.
pub(crate) fn now_millis() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Entry {
    /// The bytes to keep in Redis for the record (`scope`, `record_key`),
    /// served until `valid_until` (ms since the epoch), sealed with `key`.
    pub(crate) fn seal(
        &self,
        key: &SealKey,
        scope: &str,
        record_key: &str,
        valid_until: u64,
    ) -> Vec<u8> {
        let op = self.operation.as_bytes();
        let mut out = Vec::with_capacity(HEAD + op.len() + self.response.len() + TAG);
        out.extend_from_slice(MAGIC);
        out.push(u8::from(self.error));
        out.extend_from_slice(&self.fingerprint);
        out.extend_from_slice(&valid_until.to_be_bytes());
        out.extend_from_slice(&(op.len() as u32).to_be_bytes());
        out.extend_from_slice(op);
        out.extend_from_slice(&self.response);
        let tag = mac(key, scope, record_key, &out).finalize().into_bytes();
        out.extend_from_slice(&tag);
        out
    }

    /// The entry in `bytes`, if it was sealed with `key` for (`scope`,
    /// `record_key`) and its time is not past at `now` (ms since the
    /// epoch). The seal is checked before anything is read.
    pub(crate) fn open(
        bytes: &[u8],
        key: &SealKey,
        scope: &str,
        record_key: &str,
        now: u64,
    ) -> Result<Entry, Refused> {
        if !bytes.starts_with(MAGIC) || bytes.len() < HEAD + TAG {
            return Err(Refused::Unreadable);
        }
        let (body, tag) = bytes.split_at(bytes.len() - TAG);
        // Constant time: a forger learns nothing from how long it took.
        mac(key, scope, record_key, body)
            .verify_slice(tag)
            .map_err(|_| Refused::Rejected)?;
        let field = |at: usize, len: usize| body.get(at..at + len).ok_or(Refused::Unreadable);
        let error = match body[4] {
            0 => false,
            1 => true,
            _ => return Err(Refused::Unreadable),
        };
        let fingerprint: [u8; 32] = field(5, 32)?.try_into().map_err(|_| Refused::Unreadable)?;
        let until = u64::from_be_bytes(field(37, 8)?.try_into().map_err(|_| Refused::Unreadable)?);
        if until <= now {
            return Err(Refused::Rejected);
        }
        let len = u32::from_be_bytes(field(45, 4)?.try_into().map_err(|_| Refused::Unreadable)?);
        let operation =
            std::str::from_utf8(field(HEAD, len as usize)?).map_err(|_| Refused::Unreadable)?;
        Ok(Entry {
            error,
            fingerprint,
            operation: operation.to_owned(),
            response: body[HEAD + len as usize..].to_vec(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: SealKey = SealKey([9; 32]);

    fn entry() -> Entry {
        Entry {
            error: true,
            operation: "payments::pay".to_owned(),
            fingerprint: [7; 32],
            response: br#"{"a": 0.0}"#.to_vec(),
        }
    }

    #[test]
    fn a_sealed_entry_opens_for_its_own_record_only() {
        let sealed = entry().seal(&KEY, "scope-a", "k1", 2_000);
        let back = Entry::open(&sealed, &KEY, "scope-a", "k1", 1_000).expect("opens");
        assert!(back.error);
        assert_eq!(back.operation, "payments::pay");
        assert_eq!(back.fingerprint, [7; 32]);
        assert_eq!(back.response, entry().response);

        let refused = |bytes: &[u8], key: &SealKey, scope: &str, k: &str, now: u64| {
            Entry::open(bytes, key, scope, k, now).err()
        };
        let rejected = Some(Refused::Rejected);
        assert_eq!(refused(&sealed, &KEY, "scope-b", "k1", 1_000), rejected);
        assert_eq!(refused(&sealed, &KEY, "scope-a", "k2", 1_000), rejected);
        // The length prefixes: moving a byte between scope and key changes the input.
        assert_eq!(refused(&sealed, &KEY, "scope-", "ak1", 1_000), rejected);
        assert_eq!(
            refused(&sealed, &SealKey([8; 32]), "scope-a", "k1", 1_000),
            rejected
        );
        assert_eq!(
            refused(&sealed, &KEY, "scope-a", "k1", 2_000),
            rejected,
            "past its time"
        );
        for at in [4, 5, 40, HEAD + 3, sealed.len() - 40, sealed.len() - 1] {
            let mut altered = sealed.clone();
            altered[at] ^= 1;
            assert_eq!(
                refused(&altered, &KEY, "scope-a", "k1", 1_000),
                rejected,
                "byte {at}"
            );
        }
        let mut other = sealed.clone();
        other[3] = b'1';
        assert_eq!(
            refused(&other, &KEY, "scope-a", "k1", 1_000),
            Some(Refused::Unreadable)
        );
        assert_eq!(
            refused(&sealed[..HEAD], &KEY, "scope-a", "k1", 1_000),
            Some(Refused::Unreadable)
        );
    }
}
