//! A throwaway PgBouncer in transaction pooling mode, in front of a running
//! PostgreSQL server: the pooler most deployments of many application
//! processes put between them and the server.
//!
//! It is started from the installed program (`IDEM_PGBOUNCER`, else
//! `pgbouncer` on `PATH` or in the system directories) with a generated
//! configuration in a private temporary directory, listens on a free port on
//! 127.0.0.1, and is stopped (and the directory deleted) when the value
//! drops. One wildcard database entry forwards every database name to the
//! server, so every fresh [`TestDatabase`](crate::TestDatabase) is reachable
//! through it without a reload.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use idem_testing::pgbouncer::PgBouncer;
//! let db = idem_testing::TestDatabase::create().await?;
//! let bouncer = tokio::task::spawn_blocking(|| PgBouncer::start(&idem_testing::server_url()?))
//!     .await??;
//! let url = bouncer.url_for(db.url())?; // the same database, through PgBouncer
//! # let _ = url; Ok(()) }
//! ```

use std::fmt::Write as _;
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::exit::stop_at_exit;
use crate::privilege::{find_program, Runner};
use crate::scratch::{free_port, make_temp_dir};
use crate::url::{credentials, host_port, with_host_port};
use crate::HarnessError;

/// How often to retry when another process takes the chosen port first.
const PORT_ATTEMPTS: usize = 5;
/// How long PgBouncer may take to listen.
const START_TIMEOUT: Duration = Duration::from_secs(15);

/// Runs on every server connection PgBouncer opens; what a deployment of
/// idem behind PgBouncer sets there (each a no-op where the server refuses):
///
/// * untranslated messages: idem recognises a deadlock by its message, and
///   behind transaction pooling its pool may not set `lc_messages` for the
///   session itself (`idem::pool::Pooler::TransactionPooling`);
/// * `client_connection_check_interval` (PostgreSQL 14+): a call dropped
///   while its statement runs closes its connection, and PgBouncer then
///   closes the server connection, but a cancel request that arrives after
///   the client is gone finds nothing to cancel at PgBouncer. Without the
///   check, the backend notices the closed socket only when the statement
///   ends, holding its transaction's locks until then.
const CONNECT_QUERY: &str = "DO $$ BEGIN SET lc_messages TO 'C'; \
     EXCEPTION WHEN insufficient_privilege THEN NULL; END $$; \
     DO $$ BEGIN SET client_connection_check_interval TO '1s'; \
     EXCEPTION WHEN undefined_object THEN NULL; END $$";

/// Sizes of a [`PgBouncer`].
#[derive(Debug, Clone)]
pub struct PgBouncerSettings {
    /// Server connections per database and user (`default_pool_size`).
    /// Default 40: more than any test's pool, so no test waits on PgBouncer
    /// for a server connection its own pool would have had.
    pub pool_size: u32,
    /// Client connections PgBouncer accepts in all (`max_client_conn`).
    /// Default 500 (each takes a file descriptor).
    pub max_client_conn: u32,
}

impl Default for PgBouncerSettings {
    fn default() -> Self {
        PgBouncerSettings {
            pool_size: 40,
            max_client_conn: 500,
        }
    }
}

/// A running PgBouncer (`pool_mode = transaction`); stopped when dropped,
/// or at the process's exit.
#[derive(Debug)]
pub struct PgBouncer {
    port: u16,
    // Shared with the process's exit, which stops one never dropped.
    running: Arc<Running>,
}

/// The program and its directory, which the process's exit stops and
/// removes if no drop did.
#[derive(Debug)]
struct Running {
    dir: PathBuf,
    child: Mutex<Option<Child>>,
    // Shared between Drop and an atexit hook, which only has `&self`.
    shut_down: AtomicBool,
}

impl PgBouncer {
    /// Start one in front of the server `server_url` names, with the default
    /// [`PgBouncerSettings`]. Blocking: waits until it listens.
    pub fn start(server_url: &str) -> Result<PgBouncer, HarnessError> {
        PgBouncer::start_with(server_url, &PgBouncerSettings::default())
    }

    /// Start one in front of the server `server_url` names.
    ///
    /// PgBouncer logs in to the server as the URL's user (with its password,
    /// if it has one) whatever user a client names: it accepts every client
    /// without a password (`auth_type = any`), and listens on 127.0.0.1 only.
    pub fn start_with(
        server_url: &str,
        settings: &PgBouncerSettings,
    ) -> Result<PgBouncer, HarnessError> {
        let program = find_pgbouncer()?;
        let bin_dir = program.parent().map(Path::to_path_buf).unwrap_or_default();
        let runner = Runner::for_bin_dir(bin_dir)?;
        let databases = database_entry(server_url)?;
        let dir = make_temp_dir("idem-pgbouncer")?;
        // From here on, Drop owns the cleanup of the directory and the process.
        let mut bouncer = PgBouncer {
            port: 0,
            running: Arc::new(Running {
                dir,
                child: Mutex::new(None),
                shut_down: AtomicBool::new(false),
            }),
        };
        let running = &bouncer.running;
        runner.give_dir(&running.dir)?;
        for attempt in 1..=PORT_ATTEMPTS {
            let port = free_port()?;
            let config = running.config(&databases, port, settings);
            let config_path = running.dir.join("pgbouncer.ini");
            fs::write(&config_path, config)
                .map_err(|e| HarnessError::io(format!("write {}", config_path.display()), e))?;
            match running.spawn(&runner, &program, &config_path, port) {
                Ok(()) => {
                    stop_at_exit(running, Running::shut_down);
                    bouncer.port = port;
                    return Ok(bouncer);
                }
                Err(HarnessError::PgBouncerDidNotStart { log, .. })
                    if attempt < PORT_ATTEMPTS && log.contains("Address already in use") =>
                {
                    continue
                }
                Err(e) => return Err(e),
            }
        }
        unreachable!("the last attempt returns")
    }

    /// The port it listens on, on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The directory holding its configuration, log and pid file.
    pub fn dir(&self) -> &Path {
        &self.running.dir
    }

    /// `url` (a database on the server this PgBouncer fronts) as reached
    /// through this PgBouncer: the same user, database and parameters.
    pub fn url_for(&self, url: &str) -> Result<String, HarnessError> {
        with_host_port(url, &format!("127.0.0.1:{}", self.port))
    }

    /// Have PgBouncer close its server connections to `database`: idle ones
    /// at once, busy ones when their transaction ends (its admin console's
    /// `RECONNECT`). Server connections otherwise outlive the clients that
    /// used them, for later clients; a test that waits for a database's
    /// backends to exit needs this.
    pub async fn close_server_connections(&self, database: &str) -> Result<(), HarnessError> {
        // Admin commands take a bare name; test databases' names are plain.
        if database.is_empty()
            || !database
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_')
        {
            return Err(HarnessError::InvalidUrl {
                url: database.to_owned(),
                reason: "not a plain database name".into(),
            });
        }
        let admin = crate::connect(&format!(
            "postgres://pgbouncer@127.0.0.1:{}/pgbouncer",
            self.port
        ))
        .await?;
        let statement = format!("RECONNECT {database}");
        admin
            .batch_execute(&statement)
            .await
            .map_err(|source| HarnessError::Statement { statement, source })
    }

    /// What PgBouncer logged so far (empty if the log cannot be read).
    pub fn log(&self) -> String {
        self.running.log()
    }

    /// Stops PgBouncer and deletes its directory; safe to call more than once.
    pub(crate) fn shut_down(&self) {
        self.running.shut_down();
    }
}

impl Running {
    fn log(&self) -> String {
        let mut log = fs::read_to_string(self.dir.join("pgbouncer.log")).unwrap_or_default();
        // What it wrote before it could open its log file (a bad setting).
        log.push_str(&fs::read_to_string(self.dir.join("stderr.log")).unwrap_or_default());
        log
    }

    fn config(&self, databases: &str, port: u16, settings: &PgBouncerSettings) -> String {
        let dir = self.dir.display();
        let mut config = String::from("[databases]\n");
        let _ = writeln!(config, "* = {databases}");
        config.push_str("\n[pgbouncer]\n");
        for (name, value) in [
            ("listen_addr", "127.0.0.1".to_owned()),
            ("listen_port", port.to_string()),
            // No unix socket: a fixed /tmp/.s.PGSQL.<port> would collide.
            ("unix_socket_dir", String::new()),
            ("auth_type", "any".to_owned()),
            // The admin console's user, for close_server_connections.
            ("admin_users", "pgbouncer".to_owned()),
            ("pool_mode", "transaction".to_owned()),
            ("default_pool_size", settings.pool_size.to_string()),
            ("max_client_conn", settings.max_client_conn.to_string()),
            // Startup parameters some drivers send and PgBouncer cannot track.
            (
                "ignore_startup_parameters",
                "extra_float_digits,options".to_owned(),
            ),
            ("log_connections", "0".to_owned()),
            ("log_disconnections", "0".to_owned()),
            ("logfile", format!("{dir}/pgbouncer.log")),
            ("pidfile", format!("{dir}/pgbouncer.pid")),
        ] {
            let _ = writeln!(config, "{name} = {value}");
        }
        config
    }

    /// Start the process and wait until its log says it listens on `port`
    /// (a connection test could reach another process that took the port).
    fn spawn(
        &self,
        runner: &Runner,
        program: &Path,
        config: &Path,
        port: u16,
    ) -> Result<(), HarnessError> {
        let _ = fs::remove_file(self.dir.join("pgbouncer.log"));
        let stderr = File::create(self.dir.join("stderr.log"))
            .map_err(|e| HarnessError::io("create PgBouncer's stderr log", e))?;
        let name = program
            .file_name()
            .map(|n| n.to_string_lossy().into_owned());
        let child = runner
            .command(name.as_deref().unwrap_or("pgbouncer"), &self.dir)
            .arg(config)
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .map_err(|e| HarnessError::io(format!("run {}", program.display()), e))?;
        *self.child.lock().unwrap_or_else(|p| p.into_inner()) = Some(child);
        let listening = format!("listening on 127.0.0.1:{port}");
        let until = Instant::now() + START_TIMEOUT;
        loop {
            // Its pid too: stopping it signals that pid (see stop_process),
            // and the pid file may be written after the log line.
            if self.log().contains(&listening) && self.pid().is_some() {
                return Ok(());
            }
            let exited = self
                .child
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .as_mut()
                .and_then(|child| child.try_wait().ok().flatten());
            let detail = match exited {
                Some(status) => format!("pgbouncer exited with {status}"),
                None if Instant::now() > until => {
                    self.stop_process();
                    format!("pgbouncer did not listen within {START_TIMEOUT:?}")
                }
                None => {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            return Err(HarnessError::PgBouncerDidNotStart {
                detail,
                log: self.log(),
            });
        }
    }

    /// SIGTERM (PgBouncer's immediate shutdown) to the pid it wrote, then
    /// reap the child; SIGKILL if it lingers.
    fn stop_process(&self) {
        let Some(mut child) = self.child.lock().unwrap_or_else(|p| p.into_inner()).take() else {
            return;
        };
        // The child may be runuser, which does not pass signals on: signal
        // PgBouncer itself (after a failed start, once it has said who it is).
        let until = Instant::now() + Duration::from_secs(1);
        let mut pid = self.pid();
        while pid.is_none() && Instant::now() < until && matches!(child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(10));
            pid = self.pid();
        }
        let signal = |sig| {
            if let Some(pid) = pid {
                // SAFETY: plain syscall; the pid was written by this PgBouncer.
                unsafe {
                    libc::kill(pid, sig);
                }
            }
        };
        signal(libc::SIGTERM);
        let until = Instant::now() + Duration::from_secs(5);
        while Instant::now() < until {
            if matches!(child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        signal(libc::SIGKILL);
        let _ = child.kill();
        let _ = child.wait();
    }

    /// The pid PgBouncer wrote, once it has.
    fn pid(&self) -> Option<libc::pid_t> {
        fs::read_to_string(self.dir.join("pgbouncer.pid"))
            .ok()
            .and_then(|text| text.trim().parse::<libc::pid_t>().ok())
            .filter(|pid| *pid > 0)
    }

    /// Stops PgBouncer and deletes its directory; safe to call more than once.
    fn shut_down(&self) {
        if self.shut_down.swap(true, Ordering::SeqCst) {
            return;
        }
        self.stop_process();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        self.shut_down();
    }
}

/// `IDEM_PGBOUNCER`, else `pgbouncer` on `PATH` or in the system directories.
fn find_pgbouncer() -> Result<PathBuf, HarnessError> {
    if let Some(path) = std::env::var_os("IDEM_PGBOUNCER").filter(|v| !v.is_empty()) {
        let path = PathBuf::from(path);
        // An explicit choice that is wrong should fail loudly, not fall back.
        return if path.is_file() {
            Ok(path)
        } else {
            Err(HarnessError::NoPgBouncer {
                searched: format!("IDEM_PGBOUNCER={}", path.display()),
            })
        };
    }
    find_program("pgbouncer").ok_or_else(|| HarnessError::NoPgBouncer {
        searched: "PATH, /usr/sbin, /sbin, /usr/bin, /bin".into(),
    })
}

/// The wildcard entry's connection string: every database name goes to the
/// server, logged in as the URL's user.
fn database_entry(server_url: &str) -> Result<String, HarnessError> {
    let upstream = host_port(server_url)?;
    let (host, port) = upstream
        .rsplit_once(':')
        .map(|(host, port)| (host.trim_start_matches('[').trim_end_matches(']'), port))
        .unwrap_or((upstream.as_str(), "5432"));
    let (user, password) = credentials(server_url)?;
    let mut entry = format!(
        "host={} port={} user={}",
        quote(host),
        quote(port),
        quote(user.as_deref().unwrap_or("postgres"))
    );
    if let Some(password) = password {
        let _ = write!(entry, " password={}", quote(&password));
    }
    let _ = write!(entry, " connect_query={}", quote(CONNECT_QUERY));
    Ok(entry)
}

/// A PgBouncer connection-string value: single quotes, inner ones doubled.
fn quote(value: &str) -> String {
    format!("'{}'", value.replace('\'', "''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_entry_logs_in_as_the_urls_user() {
        let entry = database_entry("postgres://app:it's@db.local:6543/x").unwrap();
        assert!(
            entry.starts_with("host='db.local' port='6543' user='app' password='it''s' "),
            "{entry}"
        );
        assert!(entry.contains("connect_query='DO $$ BEGIN SET lc_messages TO ''C''; "));
        let entry = database_entry("postgres://127.0.0.1/x").unwrap();
        assert!(
            entry.starts_with("host='127.0.0.1' port='5432' user='postgres' connect_query="),
            "{entry}"
        );
    }
}
