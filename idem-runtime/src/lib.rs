#![warn(missing_docs)]
//! The runtime behind `idem`'s macros. Use it through the `idem` crate, which
//! re-exports everything here next to the macros.

pub mod attempt;
mod cause;
mod error;
pub mod idempotency;
pub mod inbox;
pub mod jobs;
pub mod migrate;
pub mod operate;
pub mod outbox;
pub mod pool;
pub mod retry;
mod sql;
mod standby;
mod tx;
pub mod versioned;

pub use error::{Error, FromIdemError, Unstorable};
#[allow(deprecated)]
pub use idempotency::IdempotencyError;
pub use idempotency::{IdempotencyConfig, Idempotent, IdempotentError, Mode, NoFinalErrors};
pub use migrate::{migrate, MigrateError, MigrationReport};
pub use pool::Pool;
#[allow(deprecated)]
pub use retry::RetryError;
pub use retry::{Deferred, Isolation, OnConflict, RetryCause, RetryPolicy, Transient};
pub use versioned::backstop::install_version_guard;
pub use versioned::{
    CreateOnceError, Creation, NoState, Versioned, VersionedChanges, VersionedError,
};

/// What generated code reaches; not a public API.
#[doc(hidden)]
pub mod __private {
    pub use crate::versioned::{
        assert_sql_equality, create_once_guard_sql, state_from_sql, state_to_sql, table_sql,
        Assignable, BypassesVersionCheck, CasUpdate, CreateOnceModel, JsonbArray, OnceGuard,
        OnceKeyNull, OnceKeyProbe, OnceKeyValue, RecordedTransition, StateMachine, TenantMissing,
        TransitionRecord, Untenanted, VersionValue,
    };

    /// Asks the compiler whether `C` may be assigned by a changeset of `M`.
    pub fn assert_assignable<M, C: Assignable<M>>() {}

    /// Asks the compiler whether `V` can hold a version.
    pub fn assert_version_type<V: VersionValue>() {}
    #[cfg(feature = "redis")]
    pub use crate::idempotency::CacheInput;
    pub use crate::idempotency::{lock_key, under_key, Call, Field, KeyInput, Request};
    pub use crate::retry::{commit, RetryLoop, Step};

    /// A by-value argument handed to each attempt again.
    #[diagnostic::on_unimplemented(
        message = "`{Self}` is passed by value to a #[retryable] fn, whose body is replayed on every attempt",
        label = "each attempt needs its own copy of this argument",
        note = "implement (or derive) `Clone` for `{Self}`, or take the argument by shared reference"
    )]
    pub trait ReplayArg: Sized {
        /// A fresh copy for the next attempt.
        fn replay(&self) -> Self;
    }
    impl<T: Clone> ReplayArg for T {
        fn replay(&self) -> Self {
            self.clone()
        }
    }

    /// idem's failure as the function's error type; the bound names the fix
    /// when the conversion is missing.
    pub fn idem_error<E: crate::FromIdemError>(e: crate::Error) -> E {
        E::from(e)
    }

    /// A fresh copy of a by-value argument for one attempt.
    pub fn replay_arg<T: ReplayArg>(value: &T) -> T {
        value.replay()
    }

    /// Names the two halves of a function's declared `Result` type, even when
    /// it is written through an alias.
    #[diagnostic::on_unimplemented(
        message = "an #[idempotent] fn returns `Result<T, E>`, not `{Self}`",
        note = "the stored response is the `T`, and `E` carries idem's errors"
    )]
    pub trait ResultParts {
        /// `T`.
        type Ok;
        /// `E`.
        type Err;
    }
    impl<T, E> ResultParts for Result<T, E> {
        type Ok = T;
        type Err = E;
    }

    /// Pins the output type of an attempt's body, so `?` inside it converts
    /// into the function's error type.
    pub fn attempt_body<T, F: core::future::Future<Output = T>>(body: F) -> F {
        body
    }

    pub use diesel;
    pub use diesel_async;
}
