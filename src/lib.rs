#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

// The public surface, item by item: every item has one name, and the
// runtime's step types (the retry loop, an attempt, an idempotent call),
// which only generated code drives, are reachable only through
// `__private`.

pub use idem_macros::{idempotent, retryable, States, Versioned, VersionedChanges};

// `migrate` names both the function and its module (`idem::migrate::migrations()`).
pub use idem_runtime::{final_errors, migrate, Error, FromIdemError, Unstorable};
pub use idem_runtime::{
    CreateOnceError, Creation, NoState, Versioned, VersionedChanges, VersionedError,
};
pub use idem_runtime::{
    Deferred, IdempotencyConfig, Idempotent, IdempotentError, Isolation, Mode, NoFinalErrors,
    OnConflict, Pool, RetryCause, RetryPolicy, Transient,
};

/// Deprecated: retry and idempotency failures are one type, [`Error`].
#[deprecated(since = "0.2.0", note = "use `idem::Error`")]
pub type RetryError = Error;
/// Deprecated: retry and idempotency failures are one type, [`Error`].
#[deprecated(since = "0.2.0", note = "use `idem::Error`")]
pub type IdempotencyError = Error;

/// Building the connection pool every call checks its attempts out of.
pub mod pool {
    pub use idem_runtime::pool::{
        build_pool, build_pool_with, BuildError, Connection, Manager, Pool, PoolConfig, PoolError,
        PooledConnection, Pooler, Replication,
    };
}

/// Replaying a transaction that lost a race; see `#[retryable]`.
pub mod retry {
    pub use idem_runtime::retry::retry;
}

/// What the code inside one attempt may ask of the retry loop.
pub mod attempt {
    pub use idem_runtime::attempt::{current_attempt, lost_race};
}

/// Idempotency records outside a request: the key a body runs under, the
/// operator's settle and purge, the key and fingerprint rules.
pub mod idempotency {
    pub use idem_runtime::idempotency::{
        current_key, derived_key, fingerprint, purge_expired, scope_hash, settle, validate_key,
        Field, PurgeReport, Settlement, MAX_STORED_DEPTH, OUTCOME_UNKNOWN_MESSAGE,
    };
    /// The Redis front cache of replays (feature `redis`): see the guide's
    /// "Redis front cache" (`docs/idempotent.md`) and `#[idempotent(.., cache = ..)]`.
    #[cfg(feature = "redis")]
    pub use idem_runtime::idempotency::{CacheConfig, CacheError, CacheStats, ReplayCache};
}

/// Versioned writes beyond the derive: the typestate builders that
/// `Model::find`, `Model::update` and `Model::delete` hand out (and that
/// compile errors name), state machines (`#[derive(States)]` implements
/// [`StateMachine`](versioned::StateMachine); a `.transition(..)` answers
/// [`Transitioned`](versioned::Transitioned)), and the database-side version
/// guard.
pub mod versioned {
    pub use idem_runtime::versioned::{
        backstop, check_create_once, ChangesGiven, CreateOnce, CreateOnceModel, Delete,
        ExpectedVersion, Find, HasTenantColumn, NoChanges, NoExpectedVersion, Pending, SqlEquality,
        StateMachine, Tenant, TenantGiven, TenantMissing, Transition, TransitionChanges,
        Transitioned, Untenanted, Update, VersionGiven, VersionValue, WithChanges,
    };
}

/// The transactional outbox: [`emit`](outbox::emit) an event in the
/// business transaction, and a [`Relay`](outbox::Relay) publishes it
/// afterwards, at least once and in commit order per key (to NATS
/// JetStream with feature `nats`).
pub mod outbox {
    #[cfg(feature = "nats")]
    pub use idem_runtime::outbox::NatsPublisher;
    pub use idem_runtime::outbox::{
        delete_sent, emit, requeue, requeue_key, stats, EmitError, Event, EventId, Horizon,
        InvalidEvent, OutboxMessage, OutboxStats, PrepareError, PublishError, Published, Publisher,
        Relay, RelayError, Round,
    };
}

/// The consumer-side inbox: a message's effect and the record that it was
/// applied commit together, so a redelivered message is skipped; failing
/// messages back off and are parked as dead letters. The JetStream pull
/// loop, `Inbox::run`, needs feature `nats`.
pub mod inbox {
    #[cfg(feature = "nats")]
    pub use idem_runtime::inbox::{message_id, RunError, RunReport};
    pub use idem_runtime::inbox::{
        DeadLetter, Inbox, InboxConfig, InboxError, Outcome, MAX_ID_BYTES,
    };
}

/// The delayed compensation queue: [`enqueue`](jobs::enqueue) a job in the
/// transaction that decides to compensate, and a [`Worker`](jobs::Worker)
/// runs it later under the retry loop, its effect committed with its
/// completion; failures wait on a [`Ladder`](jobs::Ladder) (5 s, 30 s,
/// 2 min), then the job is dead until [`requeue`](jobs::requeue)d.
pub mod jobs {
    pub use idem_runtime::jobs::{
        dead, enqueue, enqueue_after, requeue, stats, DeadJob, EnqueueError, Enqueued, InvalidJob,
        Job, JobId, JobStats, Ladder, Requeued, Round, Worker, WorkerError,
    };
}

/// The operator's API (stats, dead lists, requeue, discard, settle, purge,
/// migrations, doctor) that the `idem` command line is built on.
pub use idem_runtime::operate;

#[cfg(feature = "axum")]
pub mod http;

#[cfg(feature = "admin")]
pub mod admin;

/// What generated code reaches; not a public API.
#[doc(hidden)]
pub use idem_runtime::__private;

/// The guide's pages (`docs/*.md`), compiled as doctests so their examples
/// stay true; nothing here is part of the API.
#[cfg(doctest)]
mod guide {
    #[doc = include_str!("../docs/versioned.md")]
    struct Versioned;
    #[doc = include_str!("../docs/retryable.md")]
    struct Retryable;
    #[doc = include_str!("../docs/idempotent.md")]
    struct Idempotent;
    #[doc = include_str!("../docs/ledger.md")]
    struct Ledger;
    #[doc = include_str!("../docs/messaging.md")]
    struct Messaging;
    #[doc = include_str!("../docs/jobs.md")]
    struct Jobs;
    #[doc = include_str!("../docs/orders.md")]
    struct Orders;
    #[doc = include_str!("../docs/many-instances.md")]
    struct ManyInstances;
    #[doc = include_str!("../docs/replication.md")]
    struct Replication;
    #[doc = include_str!("../docs/internals.md")]
    struct Internals;
    #[doc = include_str!("../docs/contention.md")]
    struct Contention;
}
