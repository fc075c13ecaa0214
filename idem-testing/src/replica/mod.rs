//! A replicated PostgreSQL for failover tests: a primary and a streaming
//! standby on loopback, built from the installed server binaries, with the
//! faults a test needs (`kill -9` of the primary, promotion of the standby,
//! the old primary back as the new standby, a synchronous standby that is
//! down).
//!
//! The binaries are found as for the throwaway cluster (`IDEM_PG_BIN`, else
//! `pg_config --bindir`, else the newest `/usr/lib/postgresql/*/bin`), and
//! must include `pg_basebackup` and `pg_rewind`. Running as root, the
//! servers run as `postgres` (or `nobody`). The nodes are called `node_a`
//! and `node_b`: that is their `application_name` as a standby, so
//! `pg_stat_replication` and `synchronous_standby_names` name them.
//!
//! Every wait is bounded (30 s unless the caller gives a bound) and fails
//! with a [`ReplicaError::Wait`] that names what was awaited; an installed
//! program (`initdb`, `pg_basebackup`, `pg_rewind`, `pg_ctl`) still running
//! after two minutes is killed, with what it started, and answered as a
//! [`HarnessError::Timeout`]. Dropping the pair, or the process's exit if
//! the pair is never dropped (kept in a `static`), stops every server by
//! its pid and deletes the directory.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use idem_testing::replica::{ReplicaPair, Replication};
//!
//! let pair = ReplicaPair::start(Replication::Sync).await?;
//! let url = pair.create_database("shop").await?;
//! // ... run the code under test against `url`, which names both nodes ...
//! pair.kill_primary().await?;
//! pair.promote_standby().await?;
//! // `url` now reaches the promoted node.
//! pair.rejoin_old_primary().await?;
//! # Ok(()) }
//! ```

mod error;
mod node;
mod process;

use std::fmt::Write as _;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub use error::ReplicaError;
use node::{find_bin_dir, make_node_dir, Node};

use crate::exit::stop_at_exit;
use crate::privilege::Runner;
use crate::scratch::{free_port, make_temp_dir};
use crate::{connect, HarnessError};

/// The bound of every wait that the caller does not bound.
pub(crate) const WAIT: Duration = Duration::from_secs(30);

/// How often to retry when another process takes a chosen port first.
const PORT_ATTEMPTS: usize = 5;

/// How long a node gets to shut down when the pair is dropped, before SIGKILL.
const DROP_GRACE: Duration = Duration::from_secs(5);

/// Whether a `COMMIT` on the primary waits for the standby.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replication {
    /// `synchronous_commit = on` with the standby named in
    /// `synchronous_standby_names`: a `COMMIT` returns once the standby has
    /// flushed its WAL, and waits (`wait_event = 'SyncRep'`) while no
    /// standby is connected, even right after a failover, until the old
    /// primary has rejoined.
    Sync,
    /// No synchronous standby: a `COMMIT` returns at once, and a killed
    /// primary may take commits with it that the standby never received.
    Async,
}

/// How [`ReplicaPair::rejoin_old_primary`] turned the old primary into a standby.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Rejoin {
    /// `pg_rewind` brought its data directory onto the new primary's timeline.
    Rewound,
    /// `pg_rewind` failed, so its data directory was replaced by a fresh
    /// `pg_basebackup`.
    Recloned {
        /// Why `pg_rewind` failed.
        rewind_error: String,
    },
}

/// A primary and a streaming standby on free loopback ports, in a
/// temporary directory; see the [module docs](self).
///
/// The fault operations take `&self`, so the pair can be shared (in an
/// `Arc`) with tasks that read its URLs, and they run one at a time.
/// [`primary_url`](Self::primary_url) and [`standby_url`](Self::standby_url)
/// follow the swaps of roles.
#[derive(Debug)]
pub struct ReplicaPair {
    replication: Replication,
    dir: PathBuf,
    runner: Arc<Runner>,
    nodes: [Node; 2],
    /// What stopping the pair needs, shared with the process's exit: a
    /// pair never dropped (kept in a `static`) is stopped then.
    teardown: Arc<Teardown>,
    /// The index in `nodes` of the primary (or, between a kill and a
    /// promotion, of the killed primary).
    primary: AtomicUsize,
    /// One fault operation at a time: each assumes the roles it found.
    ops: tokio::sync::Mutex<()>,
}

impl ReplicaPair {
    /// Starts a primary (`initdb`) and a standby (`pg_basebackup -R` of it),
    /// and returns once the standby streams (and, with
    /// [`Replication::Sync`], is the synchronous one).
    ///
    /// Takes a few seconds. Must be called inside a Tokio runtime.
    pub async fn start(replication: Replication) -> Result<ReplicaPair, ReplicaError> {
        let pair = blocking(move || {
            let runner = Runner::for_bin_dir(find_bin_dir()?)?;
            let dir = make_temp_dir("idem-replica")?;
            let nodes = [
                Node::new("node_a", dir.join("node_a")),
                Node::new("node_b", dir.join("node_b")),
            ];
            let teardown = Arc::new(Teardown {
                dir: dir.clone(),
                nodes: nodes.clone(),
            });
            stop_at_exit(&teardown, Teardown::run);
            // From here on, Drop owns the cleanup of whatever the next steps leave behind.
            let pair = ReplicaPair {
                replication,
                nodes,
                teardown,
                dir,
                runner: Arc::new(runner),
                primary: AtomicUsize::new(0),
                ops: tokio::sync::Mutex::new(()),
            };
            pair.build()?;
            Ok(pair)
        })
        .await?;
        pair.wait_streaming(1).await?;
        Ok(pair)
    }

    fn build(&self) -> Result<(), ReplicaError> {
        self.runner.give_dir(&self.dir)?;
        for node in &self.nodes {
            make_node_dir(&self.runner, &node.dir)?;
        }
        self.nodes[0].initdb(&self.runner)?;
        self.nodes[0].append_settings(&shared_settings(self.replication))?;
        self.start_on_free_port(0)?;
        let (primary, standby) = (&self.nodes[0], &self.nodes[1]);
        standby.clone_from(&self.runner, primary)?;
        self.start_on_free_port(1)
    }

    /// Starts node `i` on a new free port, again when another process took it first.
    fn start_on_free_port(&self, i: usize) -> Result<(), ReplicaError> {
        for attempt in 1..=PORT_ATTEMPTS {
            let port = free_port()?;
            if port == self.nodes[1 - i].port() {
                continue;
            }
            self.nodes[i].set_port(port);
            let log_len = self.nodes[i].log_len();
            match self.nodes[i].start(&self.runner) {
                Err(_) if attempt < PORT_ATTEMPTS && self.nodes[i].port_was_taken(log_len) => {}
                result => return result,
            }
        }
        Err(ReplicaError::WrongState {
            operation: "start a node",
            reason: format!("no free port after {PORT_ATTEMPTS} attempts"),
        })
    }

    /// How the standby is kept in step.
    pub fn replication(&self) -> Replication {
        self.replication
    }

    /// The temporary directory: a directory per node with its data
    /// directory and its `server.log`.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn primary_node(&self) -> &Node {
        &self.nodes[self.primary.load(Ordering::SeqCst)]
    }

    fn standby_node(&self) -> &Node {
        &self.nodes[1 - self.primary.load(Ordering::SeqCst)]
    }

    /// The database `postgres` on both nodes, for a client that must find
    /// whichever is writable:
    /// `postgres://postgres@127.0.0.1:PA,127.0.0.1:PB/postgres?target_session_attrs=read-write`.
    /// tokio-postgres tries the hosts in order and keeps the first that
    /// accepts writes.
    pub fn url(&self) -> String {
        self.url_for("postgres")
    }

    /// [`url`](Self::url) for another database.
    pub fn url_for(&self, database: &str) -> String {
        let [a, b] = &self.nodes;
        // connect_timeout: a host that does not answer must not keep the client from the other.
        format!(
            "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/{database}\
             ?target_session_attrs=read-write&connect_timeout=10",
            a.port(),
            b.port()
        )
    }

    /// The database `postgres` on the current primary alone (role
    /// `postgres`, trust authentication). After
    /// [`kill_primary`](Self::kill_primary) it names the killed node until
    /// [`promote_standby`](Self::promote_standby).
    pub fn primary_url(&self) -> String {
        self.primary_url_for("postgres")
    }

    /// [`primary_url`](Self::primary_url) for another database.
    pub fn primary_url_for(&self, database: &str) -> String {
        self.primary_node().url(database)
    }

    /// The database `postgres` on the current standby alone (read only).
    pub fn standby_url(&self) -> String {
        self.standby_url_for("postgres")
    }

    /// [`standby_url`](Self::standby_url) for another database.
    pub fn standby_url_for(&self, database: &str) -> String {
        self.standby_node().url(database)
    }

    /// The name of the current primary (`node_a` or `node_b`).
    pub fn primary_name(&self) -> &'static str {
        self.primary_node().name
    }

    /// The name of the current standby, its `application_name` in the
    /// primary's `pg_stat_replication`.
    pub fn standby_name(&self) -> &'static str {
        self.standby_node().name
    }

    /// Creates `database` on the primary, waits until the standby has it
    /// (when the standby runs), and returns [`url_for`](Self::url_for) it.
    ///
    /// With [`Replication::Sync`] this waits for a standby, like any commit.
    pub async fn create_database(&self, database: &str) -> Result<String, ReplicaError> {
        let statement = format!("CREATE DATABASE \"{}\"", database.replace('"', "\"\""));
        execute(&self.primary_url(), &statement).await?;
        if self.standby_node().is_running() {
            self.wait_caught_up(WAIT).await?;
        }
        Ok(self.url_for(database))
    }

    /// SIGKILLs the primary's postmaster and every process it started, at
    /// once, as a crashed host loses them, and returns when none of them
    /// runs and its port is free. Its clients see their connections break.
    pub async fn kill_primary(&self) -> Result<(), ReplicaError> {
        let _op = self.ops.lock().await;
        let node = self.primary_node().clone();
        blocking(move || node.kill()).await
    }

    /// Promotes the standby (`pg_ctl promote`), waits until
    /// `pg_is_in_recovery()` is false on it, and makes it the primary.
    ///
    /// Usually after [`kill_primary`](Self::kill_primary); with the old
    /// primary still running there are two primaries until
    /// [`rejoin_old_primary`](Self::rejoin_old_primary). With
    /// [`Replication::Sync`], commits on the promoted node wait until the
    /// old primary has rejoined as its standby.
    pub async fn promote_standby(&self) -> Result<(), ReplicaError> {
        let _op = self.ops.lock().await;
        let standby = self.standby_node().clone();
        if !standby.is_running() {
            return Err(ReplicaError::WrongState {
                operation: "promote the standby",
                reason: format!("{} does not run", standby.name),
            });
        }
        let runner = Arc::clone(&self.runner);
        let promoted = standby.clone();
        blocking(move || promoted.promote(&runner)).await?;
        let url = standby.url("postgres");
        poll(
            format!("{} to leave recovery", standby.name),
            WAIT,
            || async {
                let in_recovery = query_text(&url, "SELECT pg_is_in_recovery()::text").await?;
                Ok((in_recovery == "false").then_some(()))
            },
        )
        .await?;
        self.primary.fetch_xor(1, Ordering::SeqCst);
        Ok(())
    }

    /// Makes the old primary a standby of the new one and waits until it
    /// streams (and, with [`Replication::Sync`], is synchronous), so the
    /// kill / promote / rejoin cycle can repeat.
    ///
    /// `pg_rewind` first (the pair runs with `wal_log_hints = on` and
    /// `full_page_writes = on` for it); when it fails, a fresh
    /// `pg_basebackup -R`. A still running old primary is stopped first.
    pub async fn rejoin_old_primary(&self) -> Result<Rejoin, ReplicaError> {
        let _op = self.ops.lock().await;
        let (primary, old) = (self.primary_node().clone(), self.standby_node().clone());
        let primary_url = primary.url("postgres");
        let in_recovery = query_text(&primary_url, "SELECT pg_is_in_recovery()::text")
            .await
            .map_err(|reason| ReplicaError::WrongState {
                operation: "rejoin the old primary",
                reason: format!("the primary {} does not answer: {reason}", primary.name),
            })?;
        if in_recovery != "false" {
            return Err(ReplicaError::WrongState {
                operation: "rejoin the old primary",
                reason: format!("{} is not promoted yet", primary.name),
            });
        }
        // pg_rewind reads the source's timeline from its control file, which
        // a promotion updates only at the next checkpoint.
        execute(&primary_url, "CHECKPOINT").await?;
        let runner = Arc::clone(&self.runner);
        let i = self.primary.load(Ordering::SeqCst);
        let rejoin = blocking(move || {
            old.stop(libc::SIGINT, WAIT)?;
            let rejoin = match old.rewind_from(&runner, &primary) {
                Ok(()) => Rejoin::Rewound,
                Err(e) => {
                    old.clone_from(&runner, &primary)?;
                    let rewind_error = match e {
                        // Its stderr says why; the server log adds nothing here.
                        ReplicaError::Program { stderr, .. } => stderr,
                        other => other.to_string(),
                    };
                    Rejoin::Recloned { rewind_error }
                }
            };
            old.start(&runner)?;
            Ok(rejoin)
        })
        .await?;
        self.wait_streaming(1 - i).await?;
        Ok(rejoin)
    }

    /// Stops the standby (fast shutdown, by signal to its postmaster): with
    /// [`Replication::Sync`] every `COMMIT` on the primary then waits.
    pub async fn stop_standby(&self) -> Result<(), ReplicaError> {
        let _op = self.ops.lock().await;
        let node = self.standby_node().clone();
        blocking(move || node.stop(libc::SIGINT, WAIT)).await
    }

    /// Starts the stopped standby again and waits until it streams (and,
    /// with [`Replication::Sync`], is synchronous, which releases the
    /// waiting commits). When the primary is not running (killed while the
    /// standby was down, before a promotion), it waits only until the
    /// standby answers, in recovery, with what it had received.
    pub async fn start_standby(&self) -> Result<(), ReplicaError> {
        let _op = self.ops.lock().await;
        let node = self.standby_node().clone();
        let runner = Arc::clone(&self.runner);
        let url = node.url("postgres");
        let name = node.name;
        blocking(move || node.start(&runner)).await?;
        if self.primary_node().is_running() {
            return self
                .wait_streaming(1 - self.primary.load(Ordering::SeqCst))
                .await;
        }
        poll(format!("{name} to answer in recovery"), WAIT, || async {
            let in_recovery = query_text(&url, "SELECT pg_is_in_recovery()::text").await?;
            Ok((in_recovery == "true").then_some(()))
        })
        .await
    }

    /// Waits until the standby has replayed everything the primary had
    /// written when this was called (`pg_last_wal_replay_lsn()` on the
    /// standby ≥ `pg_current_wal_lsn()` on the primary), so what committed
    /// on the primary is visible on the standby.
    pub async fn wait_caught_up(&self, timeout: Duration) -> Result<(), ReplicaError> {
        let primary_url = self.primary_url();
        let standby_url = self.standby_url();
        let target = query_text(&primary_url, "SELECT pg_current_wal_lsn()::text")
            .await
            .map_err(|reason| ReplicaError::WrongState {
                operation: "wait for the standby to catch up",
                reason: format!("the primary does not answer: {reason}"),
            })?;
        let sql = format!("SELECT COALESCE(pg_last_wal_replay_lsn()::text, 'none') || ' ' || (pg_last_wal_replay_lsn() >= '{target}'::pg_lsn)::text");
        let awaited = format!("{} to replay up to {target}", self.standby_name());
        poll(awaited, timeout, || async {
            let seen = query_text(&standby_url, &sql).await?;
            if seen.ends_with(" true") {
                Ok(Some(()))
            } else {
                Err(seen)
            }
        })
        .await
    }

    /// Waits until node `i` streams from the primary, as the synchronous
    /// standby when the pair is synchronous.
    async fn wait_streaming(&self, i: usize) -> Result<(), ReplicaError> {
        let name = self.nodes[i].name;
        let primary_url = self.nodes[1 - i].url("postgres");
        let sql = format!(
            "SELECT COALESCE((SELECT state || ' ' || sync_state FROM pg_stat_replication \
             WHERE application_name = '{name}' LIMIT 1), 'not connected')"
        );
        let wanted = match self.replication {
            Replication::Sync => "streaming sync",
            Replication::Async => "streaming async",
        };
        let awaited = format!(
            "{name} to stream from {} ({wanted})",
            self.nodes[1 - i].name
        );
        poll(awaited, WAIT, || async {
            let seen = query_text(&primary_url, &sql).await?;
            if seen == wanted {
                Ok(Some(()))
            } else {
                Err(seen)
            }
        })
        .await
    }
}

impl Drop for ReplicaPair {
    fn drop(&mut self) {
        self.teardown.run();
    }
}

/// The nodes (clones share each one's port and pid) and the directory.
#[derive(Debug)]
struct Teardown {
    dir: PathBuf,
    nodes: [Node; 2],
}

impl Teardown {
    /// Stops both servers and removes the directory; again, it does nothing.
    fn run(&self) {
        for node in &self.nodes {
            // SIGQUIT: immediate shutdown; nothing in a test pair is worth a checkpoint.
            if let Err(e) = node.stop(libc::SIGQUIT, DROP_GRACE) {
                eprintln!("idem-testing: could not stop {}: {e}", node.name);
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The settings both nodes share. They live in postgresql.conf, which every
/// clone and rewind copies, so each holds whichever node is primary.
fn shared_settings(replication: Replication) -> String {
    let standbys = match replication {
        // Both names: a primary never waits for itself, so this names the
        // other node whichever it is, before and after every swap.
        Replication::Sync => "node_a, node_b",
        Replication::Async => "",
    };
    let settings = [
        // A SIGKILLed server loses nothing without fsync: the kernel still
        // holds its writes (only a host crash would lose them).
        ("fsync", "off"),
        ("synchronous_commit", "on"),
        ("synchronous_standby_names", &format!("'{standbys}'")),
        // pg_rewind refuses to run without both.
        ("full_page_writes", "on"),
        ("wal_log_hints", "on"),
        // Keeps the WAL that pg_rewind and a restarted standby need.
        ("wal_keep_size", "'256MB'"),
        // A standby looks for its primary again after 1 s rather than 5 s.
        ("wal_retrieve_retry_interval", "'1s'"),
        ("shared_buffers", "'32MB'"),
        ("max_connections", "100"),
        // Tests may match on error texts; keep them untranslated.
        ("lc_messages", "'C'"),
        ("listen_addresses", "'127.0.0.1'"),
    ];
    let mut text = String::from("\n# idem-testing replica pair\n");
    for (name, value) in settings {
        let _ = writeln!(text, "{name} = {value}");
    }
    text
}

/// Runs `f` on the blocking pool: it runs the installed programs and waits for processes.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ReplicaError> + Send + 'static,
) -> Result<T, ReplicaError> {
    crate::waiting::blocking(f).await
}

/// Calls `probe` until it returns `Ok(Some(_))` or `timeout` runs out; an
/// `Err` or `Ok(None)` is a "not yet", and the last `Err` is reported.
async fn poll<T, F, Fut>(awaited: String, timeout: Duration, probe: F) -> Result<T, ReplicaError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>, String>>,
{
    crate::waiting::poll(timeout, probe)
        .await
        .map_err(|last| ReplicaError::Wait {
            awaited,
            after: timeout,
            last,
        })
}

/// The one text value `sql` returns on `url`, or why not.
async fn query_text(url: &str, sql: &str) -> Result<String, String> {
    let client = connect(url).await.map_err(|e| e.to_string())?;
    let row = tokio::time::timeout(WAIT, client.query_one(sql, &[]))
        .await
        .map_err(|_| format!("`{sql}` did not answer within {WAIT:?}"))?
        .map_err(|e| format!("`{sql}`: {e}"))?;
    row.try_get(0).map_err(|e| format!("`{sql}`: {e}"))
}

/// Runs `statement` on `url`, bounded.
async fn execute(url: &str, statement: &str) -> Result<(), ReplicaError> {
    let client = connect(url).await?;
    match tokio::time::timeout(WAIT, client.batch_execute(statement)).await {
        Ok(result) => result.map_err(|source| {
            HarnessError::Statement {
                statement: statement.to_owned(),
                source,
            }
            .into()
        }),
        Err(_) => Err(HarnessError::Timeout {
            action: format!("`{statement}`"),
            after: WAIT,
        }
        .into()),
    }
}
