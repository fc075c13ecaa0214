//! The connection pool every retry loop checks its attempts out of.
//!
//! A plain deadpool pool of [`AsyncPgConnection`]s, set up for what the retry
//! loop relies on: a checkout rejects a connection that is closed or still in a
//! transaction (deadpool's "fast" recycling, which costs no round trip), and each
//! new connection asks the server for untranslated error messages so that a
//! deadlock can be recognised (see [`crate::retry::RetryCause::Deadlock`]).
//!
//! # Behind a transaction pooler (PgBouncer)
//!
//! A pooler in transaction mode hands each transaction whichever server
//! connection is free, so nothing tied to a server session may outlive a
//! transaction. [`Pooler::TransactionPooling`] sets the pool up for that; its
//! documentation says what it changes and what that costs.

use std::collections::HashSet;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use diesel::connection::CacheSize;
use diesel::ConnectionError;
use diesel_async::pooled_connection::deadpool::{BuildError, Object};
use diesel_async::pooled_connection::{
    AsyncDieselConnectionManager, ManagerConfig, RecyclingMethod,
};
use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};

/// The pool type idem's retry loop takes: deadpool over diesel-async.
pub type Pool = diesel_async::pooled_connection::deadpool::Pool<AsyncPgConnection>;

/// A connection checked out of a [`Pool`].
pub type PooledConnection = Object<AsyncPgConnection>;

/// Ask for the server's messages in the C locale, where the server lets us.
///
/// diesel reports a deadlock (40P01) only by its message text, which the server
/// translates to `lc_messages`. Non-superusers may not change `lc_messages`
/// (unless granted `SET` on it, PostgreSQL 15+); the block then leaves it as it
/// is, and [`crate::retry`] documents what that costs.
const UNTRANSLATED_MESSAGES: &str = "DO $$ BEGIN SET lc_messages TO 'C'; \
     EXCEPTION WHEN insufficient_privilege THEN NULL; END $$";

/// Settings of [`build_pool_with`].
///
/// Spell out the settings you change and take the rest from `Default`:
///
/// ```
/// use idem_runtime::pool::{PoolConfig, Pooler};
/// let config = PoolConfig {
///     max_size: 8,
///     pooler: Pooler::TransactionPooling,
///     ..Default::default()
/// };
/// # let _ = config;
/// ```
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Most connections open at once. Default 16.
    pub max_size: usize,
    /// How long a checkout may wait for a free connection. Default 5 s.
    pub wait_timeout: Duration,
    /// What the pool's URL reaches: PostgreSQL, or a transaction pooler.
    /// Default [`Pooler::Direct`].
    pub pooler: Pooler,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            max_size: 16,
            wait_timeout: Duration::from_secs(5),
            pooler: Pooler::Direct,
        }
    }
}

/// What sits between a [`Pool`] and PostgreSQL.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Pooler {
    /// Nothing, or a pooler in session mode (a client keeps one server
    /// connection for as long as it stays connected). Each connection caches
    /// its prepared statements and asks for untranslated messages with a
    /// session `SET lc_messages`.
    #[default]
    Direct,
    /// A pooler in transaction mode, like PgBouncer's `pool_mode =
    /// transaction`: consecutive transactions of one connection may run on
    /// different server connections, so each connection
    ///
    /// * caches no prepared statement, since one prepared on a server
    ///   connection does not exist on the next. diesel-async then prepares
    ///   each statement where it runs and closes it right after: inside a
    ///   transaction that is always the same server connection. It costs one
    ///   more round trip per statement (Parse before Bind; the guide's
    ///   `docs/many-instances.md` has measured figures);
    /// * sets nothing for the session, since a session `SET` would stay on
    ///   whichever server connection ran it, for other clients to inherit.
    ///   So idem does not ask for untranslated messages, and a deadlock
    ///   (40P01, which diesel-async reports only by its text) is recognised,
    ///   and replayed, only when the server answers in English: keep the
    ///   server's `lc_messages` at `C` (or an English locale), or have the
    ///   pooler set it on each server connection it opens (PgBouncer:
    ///   `connect_query` in the database's entry, run as a role allowed to
    ///   set `lc_messages`). Otherwise a deadlock is returned to the caller
    ///   instead of being replayed, which is the safe direction.
    ///
    /// The time zone and client encoding diesel-async sets on connect are
    /// parameters PgBouncer tracks and restores per client, so they stay.
    /// Everything idem runs through the pool is inside a transaction, and its
    /// per-attempt settings are `SET LOCAL`, which end with it. Code of your
    /// own on a pooled connection should keep to transactions too: a
    /// statement outside one is prepared and run in separate exchanges, which
    /// the pooler may send to different server connections (`prepared
    /// statement "s1" does not exist`).
    TransactionPooling,
}

/// Build a [`Pool`] for `database_url` with the defaults of [`PoolConfig`].
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = idem_runtime::pool::build_pool("postgres://postgres@127.0.0.1/app")?;
/// let conn = pool.get().await?;
/// # drop(conn); Ok(()) }
/// ```
pub fn build_pool(database_url: &str) -> Result<Pool, BuildError> {
    build_pool_with(database_url, &PoolConfig::default())
}

/// Build a [`Pool`] with explicit settings.
pub fn build_pool_with(database_url: &str, config: &PoolConfig) -> Result<Pool, BuildError> {
    let mut manager_config = ManagerConfig::default();
    manager_config.recycling_method = RecyclingMethod::Fast;
    let pooler = config.pooler;
    manager_config.custom_setup = Box::new(move |url| Box::pin(establish(url.to_owned(), pooler)));
    let manager = AsyncDieselConnectionManager::new_with_config(database_url, manager_config);
    let pool = Pool::builder(manager)
        .max_size(config.max_size)
        .wait_timeout(Some(config.wait_timeout))
        .create_timeout(Some(config.wait_timeout))
        .runtime(deadpool_runtime())
        .build()?;
    if pooler == Pooler::TransactionPooling {
        transaction_pooled()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(pool_id(&pool));
    }
    Ok(pool)
}

/// The pools [`build_pool_with`] set up for [`Pooler::TransactionPooling`],
/// by [`pool_id`]. Behind such a pooler a transaction must not end with a
/// statement still to be closed (see [`behind_transaction_pooler`]); nothing
/// on a pool tells its settings back, so they are remembered here. An id
/// reused by a later pool (the first one was dropped) only costs that pool
/// the pipelined `COMMIT`.
fn transaction_pooled() -> &'static Mutex<HashSet<usize>> {
    static POOLS: OnceLock<Mutex<HashSet<usize>>> = OnceLock::new();
    POOLS.get_or_init(Default::default)
}

/// A pool's identity for as long as it lives: the address of its manager,
/// which deadpool keeps behind the pool's shared state.
fn pool_id(pool: &Pool) -> usize {
    std::ptr::from_ref(pool.manager()) as usize
}

/// Whether `pool` was built for a transaction pooler. Its connections keep
/// no prepared statement: each statement is prepared and closed around its
/// run, and a close sent after `COMMIT` could reach another server
/// connection than the one holding the statement, which then stays there
/// (`prepared statement "s12" already exists` for the next client). So a
/// transaction's last statement there is not pipelined with its `COMMIT`.
pub(crate) fn behind_transaction_pooler(pool: &Pool) -> bool {
    transaction_pooled()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .contains(&pool_id(pool))
}

fn deadpool_runtime() -> deadpool::Runtime {
    deadpool::Runtime::Tokio1
}

async fn establish(url: String, pooler: Pooler) -> Result<AsyncPgConnection, ConnectionError> {
    match pooler {
        Pooler::Direct => {
            let mut conn = AsyncPgConnection::establish(&url).await?;
            conn.batch_execute(UNTRANSLATED_MESSAGES)
                .await
                .map_err(ConnectionError::CouldntSetupConfiguration)?;
            Ok(conn)
        }
        Pooler::TransactionPooling => establish_for_transaction_pooling(&url).await,
    }
}

/// diesel-async sets the time zone and client encoding of every connection
/// it makes, with prepared statements: their Parse and Bind are separate
/// exchanges, which a transaction pooler may send to different server
/// connections when no transaction is open (`prepared statement "s0" does not
/// exist`, and a statement left behind on a server connection, whose name the
/// next client with the same counter then collides with). So the connection
/// is opened here, and those statements run inside a transaction, which keeps
/// one server connection; committed, the settings stay with the session, and
/// the pooler carries them over to whichever server connection it hands the
/// client later (both are parameters PgBouncer tracks).
async fn establish_for_transaction_pooling(
    url: &str,
) -> Result<AsyncPgConnection, ConnectionError> {
    let setup = |e: diesel::result::Error| ConnectionError::CouldntSetupConfiguration(e);
    let driver_error = |e: tokio_postgres::Error| {
        ConnectionError::BadConnection(format!("could not connect: {e}"))
    };
    let (client, mut connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .map_err(driver_error)?;
    // The connection is driven by hand until diesel-async takes it over.
    tokio::select! {
        begun = client.batch_execute("BEGIN") => begun.map_err(driver_error)?,
        ended = &mut connection => {
            return Err(ConnectionError::BadConnection(match ended {
                Ok(()) => "the connection closed during set-up".to_owned(),
                Err(e) => format!("the connection failed during set-up: {e}"),
            }))
        }
    }
    let mut conn = AsyncPgConnection::try_from_client_and_connection(client, connection).await?;
    conn.set_prepared_statement_cache_size(CacheSize::Disabled);
    conn.batch_execute("COMMIT").await.map_err(setup)?;
    Ok(conn)
}
