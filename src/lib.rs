#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

pub use idem_macros::{retryable, Versioned, VersionedChanges};
pub use idem_runtime::*;
