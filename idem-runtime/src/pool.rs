//! The connection pool every retry loop checks its attempts out of.
//!
//! A plain deadpool pool of [`AsyncPgConnection`]s, set up for what the retry
//! loop relies on: a checkout rejects a connection that is closed or still in a
//! transaction (deadpool's "fast" recycling, which costs no round trip), and each
//! new connection asks the server for untranslated error messages so that a
//! deadlock can be recognised (see [`crate::retry::RetryCause::Deadlock`]).

use std::time::Duration;

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

/// Settings of [`build_pool`].
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Most connections open at once. Default 16.
    pub max_size: usize,
    /// How long a checkout may wait for a free connection. Default 5 s.
    pub wait_timeout: Duration,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            max_size: 16,
            wait_timeout: Duration::from_secs(5),
        }
    }
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
    manager_config.custom_setup = Box::new(|url| Box::pin(establish(url.to_owned())));
    let manager = AsyncDieselConnectionManager::new_with_config(database_url, manager_config);
    Pool::builder(manager)
        .max_size(config.max_size)
        .wait_timeout(Some(config.wait_timeout))
        .create_timeout(Some(config.wait_timeout))
        .runtime(deadpool_runtime())
        .build()
}

fn deadpool_runtime() -> deadpool::Runtime {
    deadpool::Runtime::Tokio1
}

async fn establish(url: String) -> Result<AsyncPgConnection, ConnectionError> {
    let mut conn = AsyncPgConnection::establish(&url).await?;
    conn.batch_execute(UNTRANSLATED_MESSAGES)
        .await
        .map_err(ConnectionError::CouldntSetupConfiguration)?;
    Ok(conn)
}
