//! The connection pool every retry loop checks its attempts out of.
//!
//! A deadpool pool of diesel-async [`AsyncPgConnection`]s, each of which idem
//! reads on the wire (`pool/wire.rs`): whatever diesel call a body runs a statement
//! through, the server's own word on the transaction (a failed statement's
//! SQLSTATE, a transaction left failed, a `COMMIT` answered `ROLLBACK`)
//! reaches the transaction driver. A checkout rejects a connection that is
//! closed, in a transaction, or still owed an answer (no round trip), and
//! each new connection asks the server for untranslated error messages where
//! it may (see [`crate::retry::Transient`]).
//!
//! The pool carries its settings ([`Pool::pooler`]), so the transaction
//! driver knows what sits between it and PostgreSQL.
//!
//! # Behind a transaction pooler (PgBouncer)
//!
//! A pooler in transaction mode hands each transaction whichever server
//! connection is free, so nothing tied to a server session may outlive a
//! transaction. [`Pooler::TransactionPooling`] sets the pool up for that; its
//! documentation says what it changes and what that costs.
//!
//! # What a URL may ask for
//!
//! idem's connections are plain TCP connections: a URL that asks for TLS
//! (`sslmode=require`) is refused with [`BuildError::Tls`] rather than
//! downgraded, and one that names a Unix socket directory with
//! [`BuildError::UnixSocket`] (the wire is read through tokio-postgres's TLS
//! hook, which it does not offer for Unix sockets). `sslmode=prefer`, the
//! default, connects without TLS, as diesel-async's own `establish` does.

mod identity;
mod wire;

use std::ops::{Deref, DerefMut};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use diesel::connection::CacheSize;
use diesel::ConnectionError;
use diesel_async::pooled_connection::PoolableConnection;
use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};
use tokio_postgres::config::{Host, SslMode, SslNegotiation};

pub(crate) use wire::{loses_statements, Answer, MalformedRow, Marks, Refusal, Row, Wire};

/// Ask for the server's messages in the C locale, where the server lets us.
///
/// The retry loop reads SQLSTATEs, not messages; [`crate::retry::Transient`],
/// for code that classifies a diesel error by hand, reads the message of a
/// deadlock (diesel reports no SQLSTATE for it), which the server translates
/// to `lc_messages`. Non-superusers may not change `lc_messages` (unless
/// granted `SET` on it, PostgreSQL 15+); the block then leaves it as it is.
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
    /// Whether a synchronous standby must hold what idem reports committed.
    /// Default [`Replication::Single`].
    pub replication: Replication,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            max_size: 16,
            wait_timeout: Duration::from_secs(5),
            pooler: Pooler::Direct,
            replication: Replication::Single,
        }
    }
}

/// What idem may do with a `COMMIT` that goes unanswered.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Replication {
    /// One server, or standbies no acknowledged commit depends on. A
    /// `COMMIT` unanswered within the policy's `commit_timeout` is cancelled
    /// (which aborts one still running deferred triggers, so the next
    /// attempt need not wait for it) and answered as of unknown outcome.
    #[default]
    Single,
    /// A synchronous standby (`synchronous_standby_names`) must hold every
    /// commit idem reports. PostgreSQL turns a cancelled (or abandoned)
    /// wait for the standby into a *local* commit: visible, and lost if the
    /// primary dies before the standby has it. So idem never cancels a
    /// `COMMIT`: it closes the connection and answers it as of unknown
    /// outcome, and the backend goes on waiting for the standby, its locks
    /// held, so a duplicate waits rather than replaying what the standby may
    /// not hold. Keep `client_connection_check_interval` off on such a
    /// server: it ends an abandoned wait the same way a cancel does.
    Synchronous,
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
    ///   So idem does not ask for untranslated messages. The retry loop does
    ///   not need them (it reads SQLSTATEs); [`crate::retry::Transient`] on a
    ///   diesel error recognises a deadlock only when the server answers in
    ///   English.
    ///
    /// The time zone and client encoding diesel-async sets on connect are
    /// parameters PgBouncer tracks and restores per client, so they stay.
    /// Session state your own code commits stays on the server connection
    /// too: a `SET ROLE`, `SET default_transaction_read_only = on` or `SET
    /// SESSION CHARACTERISTICS` in a body makes idem's statements fail on
    /// every later transaction that server connection runs, for any client.
    /// On a direct connection idem closes a connection whose session it sees
    /// changed that way; behind a pooler that closes only its connection to
    /// the pooler. Keep to `SET LOCAL`, or have PgBouncer reset its server
    /// connections (`server_reset_query_always = 1`).
    /// A body that ends the transaction itself (a `COMMIT` or `ROLLBACK` of
    /// its own, answered `TransactionEnded`) and pipelines a request behind
    /// it is worse off here: that request runs outside any transaction on a
    /// server connection the pooler has already taken back (PgBouncer 1.18
    /// does, at the end's idle status), so the next client given it waits
    /// behind it; and no cancel is sent through a pooler.
    /// Everything idem runs through the pool is inside a transaction, and its
    /// per-attempt settings are `SET LOCAL`, which end with it. Code of your
    /// own on a pooled connection should keep to transactions too: a
    /// statement outside one is prepared and run in separate exchanges, which
    /// the pooler may send to different server connections (`prepared
    /// statement "s1" does not exist`).
    TransactionPooling,
}

/// Why a [`Pool`] could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// The URL is not a PostgreSQL connection string.
    #[error("invalid database URL: {0}")]
    InvalidUrl(#[source] tokio_postgres::Error),
    /// The URL asks for TLS (`sslmode=require`), which idem's connections
    /// do not speak; refused rather than connecting without it.
    #[error("the database URL asks for TLS (sslmode=require), which idem's pool does not speak; use sslmode=disable or prefer on a trusted network, or a TLS-terminating proxy")]
    Tls,
    /// The URL names a Unix socket directory; idem's connections are TCP.
    #[error("the database URL names a Unix socket ({0}); idem's pool connects over TCP: give host=127.0.0.1 (or the server's address) instead")]
    UnixSocket(String),
    /// The URL names no server (no `host`), which would send every checkout
    /// to the default Unix socket; give `host=127.0.0.1` or the server's
    /// address.
    #[error("the database URL names no host; give the server's address, e.g. postgres://user@127.0.0.1:5432/db")]
    NoHost,
    /// deadpool refused the settings.
    #[error(transparent)]
    Pool(#[from] deadpool::managed::BuildError),
}

/// A checkout that failed: no connection in time, or none could be made.
pub type PoolError = deadpool::managed::PoolError<ConnectionError>;

/// A pool of connections to PostgreSQL (cheap to clone: clones share it).
/// Build one with [`build_pool`] or [`build_pool_with`].
#[derive(Clone)]
pub struct Pool {
    inner: deadpool::managed::Pool<Manager>,
    pooler: Pooler,
    replication: Replication,
    /// Unique in the process, shared by clones: what a replay cache keys
    /// the database it reaches by.
    id: u64,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("status", &self.inner.status())
            .field("pooler", &self.pooler)
            .finish()
    }
}

impl Pool {
    /// Check a connection out, waiting up to the pool's wait timeout.
    pub async fn get(&self) -> Result<PooledConnection, PoolError> {
        self.inner.get().await
    }

    /// A connection made as the pool makes its own, outside its slots: for
    /// a write that must not wait behind the callers queued on the pool
    /// (see `Tx::keeps_a_lost_slot`). Closed when dropped.
    pub(crate) async fn connect_outside(&self) -> Result<Connection, ConnectionError> {
        self.inner.manager().connect().await
    }

    /// How many connections the pool holds, and may hold.
    pub fn status(&self) -> deadpool::Status {
        self.inner.status()
    }

    /// What the pool's URL reaches.
    pub fn pooler(&self) -> Pooler {
        self.pooler
    }

    /// Whether a synchronous standby must hold what idem reports committed.
    pub fn replication(&self) -> Replication {
        self.replication
    }

    /// This pool (and its clones) among the process's pools.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn id(&self) -> u64 {
        self.id
    }
}

/// A connection checked out of a [`Pool`]; it dereferences to an
/// [`AsyncPgConnection`] (through [`Connection`]), and diesel-async runs
/// queries on it directly. Dropped, it goes back to the pool.
pub type PooledConnection = deadpool::managed::Object<Manager>;

/// One of a [`Pool`]'s connections: an [`AsyncPgConnection`], which it
/// dereferences to, and what the server has said on it.
pub struct Connection {
    conn: AsyncPgConnection,
    wire: Arc<Wire>,
    replication: Replication,
    /// The cancel token of the connection made here, kept apart: a body may
    /// swap `conn` for another, and the one it took away may still run a
    /// statement in idem's transaction (see `crate::tx`). Boxed: it is
    /// rarely used, and every attempt's future carries the connection.
    cancel: Box<tokio_postgres::CancelToken>,
}

impl Connection {
    /// What the server has said on this connection.
    pub(crate) fn wire(&self) -> &Wire {
        &self.wire
    }

    /// The same, shared (it outlives a borrow of the connection).
    pub(crate) fn wire_arc(&self) -> Arc<Wire> {
        Arc::clone(&self.wire)
    }

    /// Its pool's [`Replication`].
    pub(crate) fn replication(&self) -> Replication {
        self.replication
    }

    /// The cancel token of the connection this one was made with, whatever
    /// `AsyncPgConnection` it holds now.
    pub(crate) fn made_with(&self) -> tokio_postgres::CancelToken {
        (*self.cancel).clone()
    }

    /// Whether the `AsyncPgConnection` it holds still talks to the session
    /// its wire watches: not when a body swapped in a connection of its own
    /// through the `&mut` it was lent (see [`identity`]). Nothing is sent.
    /// True when the server gave no key to compare (none seen on the wire).
    pub(crate) fn holds_its_session(&self) -> bool {
        match self.wire.backend_key() {
            Some(key) => identity::backend_key(&self.conn) == Some(key),
            None => true,
        }
    }
}

/// The server session `conn` talks to, as its cancel token names it (see
/// [`identity`]); nothing is sent. For a caller that writes more through a
/// connection after lending it to a body: the same before and after, or the
/// body swapped in one of its own, where a write would run outside the
/// attempt's transaction.
pub(crate) fn session_of(conn: &AsyncPgConnection) -> Option<[u8; 8]> {
    identity::backend_key(conn)
}

impl Deref for Connection {
    type Target = AsyncPgConnection;
    fn deref(&self) -> &AsyncPgConnection {
        &self.conn
    }
}

impl DerefMut for Connection {
    fn deref_mut(&mut self) -> &mut AsyncPgConnection {
        &mut self.conn
    }
}

/// How long a checkout waits for a returned connection's answers still on
/// their way (see `Manager::recycle`).
const SETTLE: Duration = Duration::from_millis(100);

/// Makes and recycles a [`Pool`]'s connections (deadpool's manager).
pub struct Manager {
    config: tokio_postgres::Config,
    pooler: Pooler,
    replication: Replication,
}

impl Manager {
    /// A new connection, set up (see [`Manager`]'s `create`).
    async fn connect(&self) -> Result<Connection, ConnectionError> {
        let wire = Arc::new(Wire::new(self.pooler == Pooler::Direct));
        let observe = wire::Observe(Arc::clone(&wire));
        // tokio-postgres says only "db error" at the top; the server's
        // reason (no such database, authentication failed) is its source.
        let driver_error = |e: tokio_postgres::Error| {
            let mut reason = e.to_string();
            let mut source = std::error::Error::source(&e);
            while let Some(cause) = source {
                reason = format!("{reason}: {cause}");
                source = cause.source();
            }
            ConnectionError::BadConnection(format!("could not connect: {reason}"))
        };
        let (client, mut connection) = self.config.connect(observe).await.map_err(driver_error)?;
        let conn = match self.pooler {
            Pooler::Direct => {
                let mut conn =
                    AsyncPgConnection::try_from_client_and_connection(client, connection).await?;
                conn.batch_execute(UNTRANSLATED_MESSAGES)
                    .await
                    .map_err(ConnectionError::CouldntSetupConfiguration)?;
                conn
            }
            // diesel-async sets the time zone and client encoding of every
            // connection it makes, with prepared statements: their Parse and
            // Bind are separate exchanges, which a transaction pooler may
            // send to different server connections when no transaction is
            // open (`prepared statement "s0" does not exist`, and a statement
            // left behind on a server connection, whose name the next client
            // with the same counter then collides with). So they run inside a
            // transaction, which keeps one server connection; committed, the
            // settings stay with the session, and the pooler carries them
            // over to whichever server connection it hands the client later
            // (both are parameters PgBouncer tracks).
            Pooler::TransactionPooling => {
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
                let mut conn =
                    AsyncPgConnection::try_from_client_and_connection(client, connection).await?;
                conn.set_prepared_statement_cache_size(CacheSize::Disabled);
                conn.batch_execute("COMMIT")
                    .await
                    .map_err(ConnectionError::CouldntSetupConfiguration)?;
                conn
            }
        };
        if self.pooler == Pooler::Direct {
            wire.stops_with(conn.cancel_token());
        }
        Ok(Connection {
            cancel: Box::new(conn.cancel_token()),
            conn,
            wire,
            replication: self.replication,
        })
    }
}

impl deadpool::managed::Manager for Manager {
    type Type = Connection;
    type Error = ConnectionError;

    /// Boxed: a connection's set-up is a large future (tokio-postgres's
    /// connect, diesel-async's set-up), which deadpool keeps inline in every
    /// checkout's: 9.8 KB, copied whole at each move of every attempt's
    /// future, though a checkout from a warm pool never runs it.
    async fn create(&self) -> Result<Connection, ConnectionError> {
        Box::pin(self.connect()).await
    }

    async fn recycle(
        &self,
        obj: &mut Connection,
        _: &deadpool::managed::Metrics,
    ) -> deadpool::managed::RecycleResult<ConnectionError> {
        // No round trip: what the server last said is enough. A connection
        // still owed an answer is given a moment (`get_result` and `first`
        // drop their row stream once they have their row, before the
        // statement's last messages are read); one whose statement still
        // runs (its future was dropped) is not idle, whatever diesel-async's
        // transaction manager believes.
        if std::thread::panicking() || obj.conn.is_broken() || !obj.wire.idle(SETTLE).await {
            return Err(deadpool::managed::RecycleError::message(
                "closed, in a transaction, or still owed an answer",
            ));
        }
        // A session whose client encoding someone changed reads the values
        // idem binds (see `crate::tx`) in another encoding.
        if obj.wire.foreign_encoding().is_some() {
            return Err(deadpool::managed::RecycleError::message(
                "its client_encoding is no longer UTF8",
            ));
        }
        // Session state a body committed (a read-only default, another
        // session user) would refuse idem's statements on every later call.
        // One not reported (`SET ROLE` by a user without superuser rights)
        // shows as the last transaction failing for rights or as read-only:
        // such a connection goes too, at the cost of a new one.
        if let Some(drift) = obj.wire.session_drift() {
            return Err(deadpool::managed::RecycleError::message(drift));
        }
        if obj.wire.refused_for_session() {
            return Err(deadpool::managed::RecycleError::message(
                "its last transaction failed for rights or as read-only",
            ));
        }
        // A connection a body swapped in for its own: the one taken away,
        // wherever it is, goes too (see `Wire::sever`).
        if !obj.holds_its_session() {
            obj.wire.sever();
            return Err(deadpool::managed::RecycleError::message(
                "it is not the session it was made with (a body swapped it)",
            ));
        }
        Ok(())
    }
}

/// What a cancel request for one of a pool's connections connects through:
/// the same pass-through "TLS" as the connection itself, as its cancel
/// token carries the connection's settings (see the module docs).
pub(crate) fn cancel_connector() -> wire::Observe {
    wire::Observe(Arc::default())
}

/// Send a cancel request for the statement `token`'s backend runs, on a
/// connection of its own, without waiting. Best effort: without a Tokio
/// runtime, or when the server refuses a cancel request without TLS, the
/// statement runs to its end.
pub(crate) fn cancel(token: tokio_postgres::CancelToken) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(async move {
            if let Err(err) = token.cancel_query(cancel_connector()).await {
                tracing::debug!(error = %err, "could not cancel the abandoned transaction's statement");
            }
        });
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

/// Build a [`Pool`] with explicit settings. No connection is made yet: a
/// URL that cannot be used is refused here, a server that cannot be reached
/// at the first checkout.
pub fn build_pool_with(database_url: &str, config: &PoolConfig) -> Result<Pool, BuildError> {
    let mut pg = tokio_postgres::Config::from_str(database_url).map_err(BuildError::InvalidUrl)?;
    if pg.get_ssl_mode() == SslMode::Require || pg.get_ssl_negotiation() == SslNegotiation::Direct {
        return Err(BuildError::Tls);
    }
    if let Some(Host::Unix(path)) = pg.get_hosts().iter().find(|h| matches!(h, Host::Unix(_))) {
        return Err(BuildError::UnixSocket(path.display().to_string()));
    }
    if pg.get_hosts().is_empty() && pg.get_hostaddrs().is_empty() {
        return Err(BuildError::NoHost);
    }
    // See the module docs: the observer enters as the "TLS" stream.
    pg.ssl_mode(SslMode::Require)
        .ssl_negotiation(SslNegotiation::Direct);
    let manager = Manager {
        config: pg,
        pooler: config.pooler,
        replication: config.replication,
    };
    let inner = deadpool::managed::Pool::builder(manager)
        .max_size(config.max_size)
        .wait_timeout(Some(config.wait_timeout))
        .create_timeout(Some(config.wait_timeout))
        .runtime(deadpool::Runtime::Tokio1)
        .build()?;
    static POOLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    Ok(Pool {
        inner,
        pooler: config.pooler,
        replication: config.replication,
        id: POOLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_idem_cannot_honour_are_refused() {
        let tls = build_pool("postgres://u@127.0.0.1/x?sslmode=require").unwrap_err();
        assert!(matches!(tls, BuildError::Tls), "{tls}");
        let unix = build_pool("postgres://u@/x?host=/var/run/postgresql").unwrap_err();
        assert!(matches!(unix, BuildError::UnixSocket(_)), "{unix}");
        assert!(matches!(
            build_pool("not a url at all"),
            Err(BuildError::InvalidUrl(_))
        ));
        for no_host in ["", "postgres://postgres@/postgres", "user=postgres"] {
            assert!(
                matches!(build_pool(no_host), Err(BuildError::NoHost)),
                "{no_host:?}"
            );
        }
    }
}
