//! Test harness for idem: every integration test gets its own fresh database
//! on a real PostgreSQL server.
//!
//! idem's guarantees are about how PostgreSQL behaves under concurrent writers,
//! so its tests run against a real server rather than a mock, and each test
//! gets a database of its own so tests can run in parallel.
//!
//! # Which server
//!
//! 1. If `DATABASE_URL` is set (and not empty), it is the admin URL of a
//!    running server, e.g. `postgres://postgres@127.0.0.1:5432/postgres`.
//!    Test databases are created on it.
//! 2. Otherwise the first use in a process starts one throwaway cluster from
//!    the installed server binaries (`IDEM_PG_BIN`, else `pg_config --bindir`,
//!    else the newest `/usr/lib/postgresql/*/bin`) in a temporary directory,
//!    listening on a free port on 127.0.0.1. It is stopped and deleted when
//!    the process exits. When running as root, the server runs as the
//!    `postgres` user (or `nobody`), since PostgreSQL refuses to run as root.
//!
//! # Through PgBouncer
//!
//! With `IDEM_TEST_VIA=pgbouncer` ([`Via`]), [`TestDatabase::pool_url`] reaches
//! each test database through a PgBouncer in transaction pooling mode, one
//! per test process, started from the installed `pgbouncer` on first use and
//! stopped when the process exits ([`pgbouncer`]). A test gives that URL to
//! the code under test, with a pool set up for transaction pooling when
//! [`TestDatabase::via`] says so, and keeps [`TestDatabase::url`] for its own
//! side connections.
//!
//! # Nothing left behind
//!
//! Every server the harness starts for a caller (a [`Cluster`], a
//! [`replica::ReplicaPair`], a [`nats::NatsServer`] or
//! [`nats_cluster::NatsCluster`], a [`redis::RedisServer`], a
//! [`pgbouncer::PgBouncer`]) is stopped and its directory removed when it
//! is dropped, or when the process exits if it never is (kept in a
//! `static` to share it between a binary's tests). A process killed by a
//! signal runs no exit hook: what it started is left, under the temporary
//! directory's `idem-*` names. The installed PostgreSQL programs the
//! harness runs to completion (`initdb`, `pg_basebackup`, `pg_rewind`) are
//! killed after two minutes and answered as [`HarnessError::Timeout`].
//!
//! # Example
//!
//! ```no_run
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let db = idem_testing::TestDatabase::create().await?;
//! let (client, connection) = tokio_postgres::connect(db.url(), tokio_postgres::NoTls).await?;
//! tokio::spawn(connection);
//! client.batch_execute("CREATE TABLE t (id int)").await?;
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

mod bounded;
mod cluster;
mod database;
mod error;
mod exit;
pub mod nats;
pub mod nats_cluster;
pub mod pgbouncer;
mod privilege;
pub mod proxy;
pub mod redis;
pub mod replica;
mod scratch;
mod server;
pub mod stats;
mod url;
mod via;
mod waiting;
mod wire;

pub use cluster::{start_throwaway_cluster, start_throwaway_cluster_with, Cluster};
pub use database::{connect, TestDatabase};
pub use error::HarnessError;
pub use via::{Via, VIA_ENV};

/// The admin URL of the server that test databases are created on.
///
/// Returns `DATABASE_URL` when it is set; otherwise starts (once per process)
/// the throwaway cluster and returns its URL. Blocking: the first call may
/// run `initdb` and `pg_ctl`.
pub fn server_url() -> Result<String, HarnessError> {
    match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => Ok(url),
        // An empty value is how CI configs commonly spell "unset".
        Ok(_) | Err(std::env::VarError::NotPresent) => {
            cluster::shared_cluster().map(|cluster| cluster.url().to_owned())
        }
        Err(std::env::VarError::NotUnicode(_)) => Err(HarnessError::InvalidUrl {
            url: "<DATABASE_URL>".into(),
            reason: "DATABASE_URL is not valid UTF-8".into(),
        }),
    }
}
