//! How the code under test reaches PostgreSQL in this run: directly, or
//! through PgBouncer in transaction pooling mode (`IDEM_TEST_VIA`).
//!
//! The switch routes only the URL a test gives the code under test
//! ([`TestDatabase::pool_url`](crate::TestDatabase::pool_url)). A test's own
//! side connections ([`TestDatabase::url`](crate::TestDatabase::url)) stay
//! direct: they observe and interfere (hold a lock across statements, read
//! `pg_stat_activity`, terminate a backend), which takes a session of their
//! own, and they are not what is being tested.

use std::sync::{Arc, Mutex};

use crate::pgbouncer::PgBouncer;
use crate::url::{credentials, host_port};
use crate::HarnessError;

/// The environment variable that picks the [`Via`] of a run.
pub const VIA_ENV: &str = "IDEM_TEST_VIA";

/// The way the code under test reaches the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Via {
    /// Straight to PostgreSQL (`IDEM_TEST_VIA` unset, empty or `direct`).
    #[default]
    Direct,
    /// Through one PgBouncer per test process and server, in transaction
    /// pooling mode (`IDEM_TEST_VIA=pgbouncer`); pools must then be set up
    /// for transaction pooling.
    PgBouncer,
}

impl Via {
    /// The way `IDEM_TEST_VIA` names.
    pub fn from_env() -> Result<Via, HarnessError> {
        match std::env::var(VIA_ENV) {
            Err(std::env::VarError::NotPresent) => Ok(Via::Direct),
            Ok(value) => match value.trim().to_ascii_lowercase().as_str() {
                "" | "direct" => Ok(Via::Direct),
                "pgbouncer" => Ok(Via::PgBouncer),
                _ => Err(HarnessError::InvalidVia { value }),
            },
            Err(std::env::VarError::NotUnicode(value)) => Err(HarnessError::InvalidVia {
                value: value.to_string_lossy().into_owned(),
            }),
        }
    }

    /// True for [`Via::PgBouncer`]: statements of one client may run on
    /// different server connections from one transaction to the next.
    pub fn is_transaction_pooling(self) -> bool {
        self == Via::PgBouncer
    }
}

/// One PgBouncer per server (and login user) for the whole process, started
/// on first use and stopped when the process exits.
type Shared = Vec<(String, Result<&'static PgBouncer, Arc<HarnessError>>)>;
static SHARED: Mutex<Shared> = Mutex::new(Vec::new());

/// The process's PgBouncer in front of the server of `server_url`.
/// Blocking: the first call for a server starts it.
pub(crate) fn shared_pgbouncer(server_url: &str) -> Result<&'static PgBouncer, HarnessError> {
    let key = format!(
        "{}|{:?}",
        host_port(server_url)?,
        credentials(server_url)?.0
    );
    // Held across the start, so parallel tests never start two for one server.
    let mut shared = SHARED.lock().unwrap_or_else(|p| p.into_inner());
    let entry = match shared.iter().find(|(k, _)| *k == key) {
        Some((_, entry)) => entry.clone(),
        None => {
            let started = PgBouncer::start(server_url)
                // Never dropped: stopped at exit instead, as every PgBouncer
                // still running then is.
                .map(|bouncer| &*Box::leak(Box::new(bouncer)))
                .map_err(Arc::new);
            shared.push((key, started.clone()));
            started
        }
    };
    entry.map_err(HarnessError::SharedPgBouncer)
}
