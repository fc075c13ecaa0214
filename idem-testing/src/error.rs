use std::io;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::sync::Arc;
use std::time::Duration;

/// Why the harness could not provide a server or a database.
///
/// The variants carry the evidence needed to fix the machine (stderr of
/// `initdb`, the server log, the directories searched), because a test that
/// fails here is mostly failing for an environmental reason; the caller's
/// own mistakes have variants of their own ([`HarnessError::InvalidSetting`],
/// [`HarnessError::InvalidUrl`], [`HarnessError::InvalidVia`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HarnessError {
    /// Neither `DATABASE_URL` nor usable server binaries were available.
    #[error(
        "no PostgreSQL server binaries (initdb, pg_ctl, postgres) found; searched: {searched}. \
         Install the PostgreSQL server (`apt-get install postgresql`), set IDEM_PG_BIN to its \
         bin directory, or set DATABASE_URL to a running server"
    )]
    NoServerBinaries {
        /// The places that were looked at, in order.
        searched: String,
    },

    /// Running as root, but no account exists that the server may run as.
    #[error(
        "running as root, but neither a `postgres` nor a `nobody` user exists \
         to run the PostgreSQL server as (it refuses to run as root)"
    )]
    NoUnprivilegedUser,

    /// Running as root, but neither `runuser` nor `setpriv` was found.
    #[error("running as root, but neither `runuser` nor `setpriv` was found to drop privileges")]
    NoPrivilegeDropTool,

    /// A filesystem or process operation failed.
    #[error("{action}: {source}")]
    Io {
        /// What was being attempted.
        action: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },

    /// `initdb` exited unsuccessfully.
    #[error("initdb failed ({status}) for {data_dir}: {stderr}")]
    InitdbFailed {
        /// The exit status of `initdb` (or of the privilege-dropping wrapper).
        status: ExitStatus,
        /// The data directory that was being initialised.
        data_dir: PathBuf,
        /// Everything `initdb` wrote to stderr.
        stderr: String,
    },

    /// A setting given to [`crate::start_throwaway_cluster_with`] cannot be
    /// written as the one line of `postgresql.conf` it was meant as, or is
    /// one the harness owns; nothing was started or written.
    #[error("the setting {name:?} = {value:?} was refused: {reason}")]
    InvalidSetting {
        /// The setting's name, as given.
        name: String,
        /// Its value, as given.
        value: String,
        /// What is wrong with it.
        reason: String,
    },

    /// `pg_ctl start` did not bring the server up.
    #[error("the PostgreSQL server did not start: {detail}\n--- server log ---\n{log}")]
    ServerDidNotStart {
        /// What `pg_ctl` reported.
        detail: String,
        /// The server's log file.
        log: String,
    },

    /// A server URL could not be used.
    #[error("invalid server URL {url:?}: {reason}")]
    InvalidUrl {
        /// The URL, with any password masked.
        url: String,
        /// What is wrong with it.
        reason: String,
    },

    /// Connecting to the server failed.
    #[error("could not connect to {url}: {source}")]
    Connect {
        /// The URL, with any password masked.
        url: String,
        /// The driver's error.
        #[source]
        source: tokio_postgres::Error,
    },

    /// A statement the harness issued failed.
    #[error("`{statement}` failed: {source}")]
    Statement {
        /// The statement.
        statement: String,
        /// The driver's error.
        #[source]
        source: tokio_postgres::Error,
    },

    /// The server did not answer in time.
    #[error("{action} timed out after {after:?}")]
    Timeout {
        /// What was being attempted.
        action: String,
        /// How long the harness waited.
        after: Duration,
    },

    /// The fault-injection proxy could not listen.
    #[error("the test proxy could not start: {0}")]
    Proxy(String),

    /// No `pgbouncer` program was found.
    #[error(
        "no pgbouncer program found; searched: {searched}. Install PgBouncer \
         (apt-get install pgbouncer) or set IDEM_PGBOUNCER to the program"
    )]
    NoPgBouncer {
        /// The places that were looked at, in order.
        searched: String,
    },

    /// PgBouncer did not come up.
    #[error("PgBouncer did not start: {detail}\n--- PgBouncer log ---\n{log}")]
    PgBouncerDidNotStart {
        /// What went wrong.
        detail: String,
        /// PgBouncer's log and standard error.
        log: String,
    },

    /// `IDEM_TEST_VIA` names no known way to the server.
    #[error("IDEM_TEST_VIA={value:?}: expected `direct` or `pgbouncer`")]
    InvalidVia {
        /// The variable's value.
        value: String,
    },

    /// Starting the per-process PgBouncer failed earlier; every later caller gets the same cause.
    #[error("the shared test PgBouncer could not be started: {0}")]
    SharedPgBouncer(#[source] Arc<HarnessError>),

    /// Starting the per-process cluster failed earlier; every later caller gets the same cause.
    #[error("the shared test cluster could not be started: {0}")]
    SharedCluster(#[source] Arc<HarnessError>),
}

impl HarnessError {
    pub(crate) fn io(action: impl Into<String>, source: io::Error) -> Self {
        HarnessError::Io {
            action: action.into(),
            source,
        }
    }
}
