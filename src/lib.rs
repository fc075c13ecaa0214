#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

pub use idem_macros::{idempotent, retryable, Versioned, VersionedChanges};
pub use idem_runtime::*;

#[cfg(feature = "axum")]
pub mod http;
