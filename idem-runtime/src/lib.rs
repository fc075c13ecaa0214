//! The runtime behind `idem`'s macros. Use it through the `idem` crate, which
//! re-exports everything here next to the macros.

pub mod attempt;
pub mod etag;
pub mod versioned;

pub use versioned::{NoState, Versioned, VersionedChanges, VersionedError};

/// What generated code reaches; not a public API.
#[doc(hidden)]
pub mod __private {
    pub use crate::versioned::{
        Assignable, BypassesVersionCheck, CasUpdate, TenantMissing, Untenanted, VersionValue,
    };

    /// Asks the compiler whether `C` may be assigned by a changeset of `M`.
    pub fn assert_assignable<M, C: Assignable<M>>() {}

    /// Asks the compiler whether `V` can hold a version.
    pub fn assert_version_type<V: VersionValue>() {}
    pub use diesel;
    pub use diesel_async;
}
