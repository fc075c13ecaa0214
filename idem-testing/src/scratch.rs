//! Scratch space for throwaway servers: private temporary directories, free
//! ports, and names no other process will draw.

use std::collections::hash_map::RandomState;
use std::fs::DirBuilder;
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::net::TcpListener;
use std::os::unix::fs::DirBuilderExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::HarnessError;

/// A TCP port on 127.0.0.1 that was free a moment ago (the caller retries
/// when another process takes it first).
pub(crate) fn free_port() -> Result<u16, HarnessError> {
    TcpListener::bind(("127.0.0.1", 0))
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .map_err(|e| HarnessError::io("find a free TCP port on 127.0.0.1", e))
}

/// A new private directory `<temp>/<prefix>-<pid>-<n>-<random>`.
pub(crate) fn make_temp_dir(prefix: &str) -> Result<PathBuf, HarnessError> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let base = std::env::temp_dir();
    loop {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir = base.join(format!(
            "{prefix}-{}-{n}-{:08x}",
            std::process::id(),
            random_u32()
        ));
        // 0700: the directory may hold a trust-auth socket.
        match DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => {
                return Err(HarnessError::io(
                    format!("create a directory in {}", base.display()),
                    e,
                ))
            }
        }
    }
}

/// Enough randomness for unique names without pulling in a random number crate.
pub(crate) fn random_u32() -> u32 {
    let mut hasher = RandomState::new().build_hasher();
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    hasher.write_u128(nanos);
    hasher.write_u32(std::process::id());
    hasher.finish() as u32
}
