//! One fresh database per test.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio_postgres::error::SqlState;
use tokio_postgres::{Client, Config, NoTls};

use crate::pgbouncer::PgBouncer;
use crate::scratch::random_u32;
use crate::url::{redact, with_database};
use crate::via::shared_pgbouncer;
use crate::{server_url, HarnessError, Via};

/// Bounds every harness round trip, so a wedged server fails a test instead of hanging it.
const ROUND_TRIP_TIMEOUT: Duration = Duration::from_secs(30);

/// A database created for one test, dropped (best effort, `WITH (FORCE)`) when this value drops.
///
/// Tests that each own a database can run in parallel without seeing each
/// other's tables, rows or locks, which matters for a crate whose tests are
/// about concurrent writers.
pub struct TestDatabase {
    name: String,
    url: String,
    pool_url: String,
    bouncer: Option<&'static PgBouncer>,
    admin_url: String,
}

impl TestDatabase {
    /// Creates a fresh, uniquely named database on the server chosen by [`server_url`].
    ///
    /// Must be called inside a Tokio runtime. The first call in a process may
    /// take a few seconds when it has to start the throwaway cluster.
    pub async fn create() -> Result<TestDatabase, HarnessError> {
        // server_url may run initdb and pg_ctl; keep that off the async worker thread.
        let admin_url = match tokio::task::spawn_blocking(server_url).await {
            Ok(result) => result?,
            Err(join_error) => std::panic::resume_unwind(join_error.into_panic()),
        };
        Self::create_on(&admin_url).await
    }

    /// Creates a fresh, uniquely named database on the server at `admin_url`.
    ///
    /// `admin_url` must name a role allowed to create and drop databases; for
    /// example [`Cluster::url`](crate::Cluster::url) of a throwaway cluster.
    ///
    /// Under `IDEM_TEST_VIA=pgbouncer` ([`Via`]) it also starts, the first
    /// time for that server, the process's PgBouncer in front of it, for
    /// [`pool_url`](Self::pool_url).
    pub async fn create_on(admin_url: &str) -> Result<TestDatabase, HarnessError> {
        // Validate the URL before anything is created that would then be leaked.
        with_database(admin_url, "postgres")?;
        let bouncer = match Via::from_env()? {
            Via::Direct => None,
            Via::PgBouncer => {
                let admin_url = admin_url.to_owned();
                // Starting it blocks; keep that off the async worker thread.
                match tokio::task::spawn_blocking(move || shared_pgbouncer(&admin_url)).await {
                    Ok(result) => Some(result?),
                    Err(join_error) => std::panic::resume_unwind(join_error.into_panic()),
                }
            }
        };
        let client = connect(admin_url).await?;
        // Retried because parallel processes could, very rarely, draw the same name.
        let mut attempts_left = 3;
        loop {
            let name = unique_name();
            let statement = format!("CREATE DATABASE \"{name}\"");
            match with_timeout(&statement, client.batch_execute(&statement)).await? {
                Ok(()) => {
                    let url = with_database(admin_url, &name)?;
                    let database = TestDatabase {
                        pool_url: match bouncer {
                            Some(bouncer) => bouncer.url_for(&url)?,
                            None => url.clone(),
                        },
                        url,
                        bouncer,
                        name,
                        admin_url: admin_url.to_owned(),
                    };
                    return Ok(database);
                }
                Err(e) if e.code() == Some(&SqlState::DUPLICATE_DATABASE) && attempts_left > 1 => {
                    attempts_left -= 1;
                }
                Err(source) => return Err(HarnessError::Statement { statement, source }),
            }
        }
    }

    /// The `postgres://` URL of this database, for tokio-postgres and diesel-async alike.
    ///
    /// Always straight to the server: for a test's own connections, which
    /// set things up, observe and interfere. The code under test gets
    /// [`pool_url`](Self::pool_url).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The URL of this database for the code under test's pool: through the
    /// process's PgBouncer (transaction pooling) when [`via`](Self::via) is
    /// [`Via::PgBouncer`], else the same as [`url`](Self::url).
    pub fn pool_url(&self) -> &str {
        &self.pool_url
    }

    /// How [`pool_url`](Self::pool_url) reaches the server, as
    /// `IDEM_TEST_VIA` said when this database was created. A pool for it
    /// must be set up for transaction pooling when this is
    /// [`Via::PgBouncer`].
    pub fn via(&self) -> Via {
        match self.bouncer {
            Some(_) => Via::PgBouncer,
            None => Via::Direct,
        }
    }

    /// Under [`Via::PgBouncer`], have PgBouncer close its server connections
    /// to this database (idle ones at once), which it otherwise keeps open
    /// after the code under test's pool is gone; directly, nothing to do.
    /// For a test that waits for the database's backends to exit.
    pub async fn release_server_connections(&self) -> Result<(), HarnessError> {
        match self.bouncer {
            Some(bouncer) => bouncer.close_server_connections(&self.name).await,
            None => Ok(()),
        }
    }

    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl fmt::Debug for TestDatabase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Hand-written so a password in DATABASE_URL never ends up in test output.
        f.debug_struct("TestDatabase")
            .field("name", &self.name)
            .field("url", &redact(&self.url))
            .field("pool_url", &redact(&self.pool_url))
            .finish()
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        let admin_url = self.admin_url.clone();
        let name = self.name.clone();
        // Drop cannot await, and blocking on the test's own runtime would panic or deadlock,
        // so the DROP runs on a private runtime in its own thread.
        let outcome = std::thread::Builder::new()
            .name("idem-testing-drop-db".into())
            .spawn(move || drop_database(&admin_url, &name))
            .map_err(|e| HarnessError::io("spawn a thread to drop the test database", e))
            .and_then(|handle| {
                handle.join().unwrap_or_else(|_| {
                    Err(HarnessError::io(
                        "drop the test database",
                        std::io::Error::other("the dropping thread panicked"),
                    ))
                })
            });
        if let Err(e) = outcome {
            // Best effort: a leftover database must not turn a passing test into a failing one.
            eprintln!(
                "idem-testing: could not drop test database {}: {e}",
                self.name
            );
        }
    }
}

fn drop_database(admin_url: &str, name: &str) -> Result<(), HarnessError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| HarnessError::io("build a Tokio runtime", e))?;
    runtime.block_on(async {
        let client = connect(admin_url).await?;
        // FORCE: the test may still hold connections, e.g. a pool stored in a struct dropped later.
        let statement = format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)");
        with_timeout(&statement, client.batch_execute(&statement))
            .await?
            .map_err(|source| HarnessError::Statement { statement, source })
    })
}

/// A plain tokio-postgres client for `url` (a test database's, or the
/// server's), with a bounded connect timeout, its connection driven on the
/// current runtime: for the side queries a test makes beside the code under test.
pub async fn connect(url: &str) -> Result<Client, HarnessError> {
    let mut config: Config = url.parse().map_err(|e| HarnessError::InvalidUrl {
        url: redact(url),
        reason: format!("{e}"),
    })?;
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(Duration::from_secs(10));
    }
    let (client, connection) = with_timeout("connect", config.connect(NoTls))
        .await?
        .map_err(|source| HarnessError::Connect {
            url: redact(url),
            source,
        })?;
    tokio::spawn(async move {
        // Errors surface through the client; nothing to do with them here.
        let _ = connection.await;
    });
    Ok(client)
}

async fn with_timeout<T>(
    action: &str,
    future: impl std::future::Future<Output = T>,
) -> Result<T, HarnessError> {
    tokio::time::timeout(ROUND_TRIP_TIMEOUT, future)
        .await
        .map_err(|_| HarnessError::Timeout {
            action: action.to_owned(),
            after: ROUND_TRIP_TIMEOUT,
        })
}

/// `idem_t_<pid>_<counter>_<random>`: the pid and counter keep one machine's names apart,
/// the random part covers pid reuse and other machines sharing a server.
fn unique_name() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    format!(
        "idem_t_{}_{}_{:08x}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed),
        random_u32()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_lowercase_identifiers() {
        let a = unique_name();
        let b = unique_name();
        assert_ne!(a, b);
        for name in [&a, &b] {
            assert!(name.starts_with("idem_t_"), "{name}");
            // Unquoted-identifier safe and under PostgreSQL's 63-byte limit.
            assert!(name.len() <= 63, "{name}");
            assert!(name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'));
        }
    }
}
