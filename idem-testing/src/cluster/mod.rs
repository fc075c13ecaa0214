//! Throwaway PostgreSQL clusters built from the locally installed server binaries.

use std::ffi::OsStr;
use std::fmt::Write as _;
use std::fs::{self, OpenOptions};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use crate::bounded::{output_within, PROGRAM_BOUND};
use crate::exit::stop_at_exit;
use crate::privilege::Runner;
use crate::scratch::{free_port, make_temp_dir};
use crate::HarnessError;

mod settings;

/// Settings that trade durability for speed; a test cluster is deleted anyway.
const TEST_SETTINGS: &[(&str, &str)] = &[
    ("fsync", "off"),
    ("synchronous_commit", "off"),
    ("full_page_writes", "off"),
    // Concurrency tests open many connections at once, across parallel tests.
    ("max_connections", "300"),
    // Tests may match on error texts; keep them untranslated.
    ("lc_messages", "'C'"),
    ("listen_addresses", "'127.0.0.1'"),
];

/// How often to retry when another process grabs the chosen port before the server binds it.
const PORT_ATTEMPTS: usize = 5;

/// A PostgreSQL cluster in a temporary directory, owned by this process.
///
/// Dropping it stops the server (`pg_ctl stop -m immediate`, nothing in it is
/// worth a clean shutdown) and deletes the directory; so does the process's
/// exit, for a cluster never dropped (one kept in a `static` to share it
/// between a test binary's tests).
#[derive(Debug)]
pub struct Cluster {
    owned: Arc<Owned>,
    port: u16,
    url: String,
}

/// What the cluster leaves on the machine, shared with the process's exit
/// hook, which stops a cluster still alive then.
#[derive(Debug)]
struct Owned {
    dir: PathBuf,
    data_dir: PathBuf,
    runner: Runner,
    // Shared between Drop and the atexit hook, which only has `&self`.
    shut_down: AtomicBool,
}

impl Cluster {
    /// The admin URL (user `postgres`, database `postgres`, trust auth over TCP).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The TCP port the server listens on, on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The temporary directory holding the data directory, the server log and the unix socket.
    pub fn dir(&self) -> &Path {
        &self.owned.dir
    }

    /// The data directory (`PGDATA`).
    pub fn data_dir(&self) -> &Path {
        &self.owned.data_dir
    }

    /// The directory the server binaries were taken from.
    pub fn bin_dir(&self) -> &Path {
        &self.owned.runner.bin_dir
    }

    fn start(settings: &[(&str, &str)]) -> Result<Cluster, HarnessError> {
        // Before anything is made: a refused setting leaves nothing behind.
        for (name, value) in settings {
            settings::check(name, value)?;
        }
        let runner = Runner::for_bin_dir(find_bin_dir()?)?;
        let dir = make_temp_dir("idem-pg")?;
        // From here on, Drop owns the cleanup of whatever the remaining steps leave behind.
        let cluster = Cluster {
            owned: Arc::new(Owned {
                data_dir: dir.join("data"),
                dir,
                runner,
                shut_down: AtomicBool::new(false),
            }),
            port: 0,
            url: String::new(),
        };
        cluster.finish_start(settings)
    }

    fn finish_start(mut self, settings: &[(&str, &str)]) -> Result<Cluster, HarnessError> {
        let owned = &self.owned;
        // The server creates its data dir, socket and log in here.
        owned.runner.give_dir(&owned.dir)?;
        owned.initdb()?;
        let mut conf = owned.base_settings();
        for (name, value) in settings {
            let _ = writeln!(conf, "{name} = {value}");
        }
        owned.append_settings(&conf)?;
        for attempt in 1..=PORT_ATTEMPTS {
            let port = free_port()?;
            // Later lines win in postgresql.conf, so a retry simply appends a new port.
            owned.append_settings(&format!("port = {port}\n"))?;
            match owned.pg_ctl_start(settings) {
                Ok(()) => {
                    stop_at_exit(&self.owned, Owned::shut_down);
                    self.port = port;
                    self.url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
                    return Ok(self);
                }
                Err(HarnessError::ServerDidNotStart { log, .. })
                    if attempt < PORT_ATTEMPTS && log.contains("could not bind") =>
                {
                    continue
                }
                Err(e) => return Err(e),
            }
        }
        unreachable!("the last attempt returns")
    }
}

impl Owned {
    fn initdb(&self) -> Result<(), HarnessError> {
        let mut cmd = self.runner.command("initdb", &self.dir);
        cmd.arg("-D")
            .arg(&self.data_dir)
            .args(["-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8"])
            // The environment's locale may not be installed, which makes initdb fail; C always exists.
            .arg("--locale=C");
        let output = output_within(&mut cmd, PROGRAM_BOUND, "run initdb")?;
        if output.status.success() {
            Ok(())
        } else {
            Err(HarnessError::InitdbFailed {
                status: output.status,
                data_dir: self.data_dir.clone(),
                stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
            })
        }
    }

    fn base_settings(&self) -> String {
        let mut settings = String::from("\n# idem-testing\n");
        for (name, value) in TEST_SETTINGS {
            let _ = writeln!(settings, "{name} = {value}");
        }
        let socket_dir = self.dir.display().to_string().replace('\'', "''");
        let _ = writeln!(settings, "unix_socket_directories = '{socket_dir}'");
        settings
    }

    fn append_settings(&self, text: &str) -> Result<(), HarnessError> {
        let path = self.data_dir.join("postgresql.conf");
        OpenOptions::new()
            .append(true)
            .open(&path)
            .and_then(|mut file| file.write_all(text.as_bytes()))
            .map_err(|e| HarnessError::io(format!("append to {}", path.display()), e))
    }

    fn log_path(&self) -> PathBuf {
        self.dir.join("server.log")
    }

    /// `settings`, the caller's, are named in the error: the server's own
    /// may point at a line of a file removed with the cluster.
    fn pg_ctl_start(&self, settings: &[(&str, &str)]) -> Result<(), HarnessError> {
        let mut cmd = self.runner.command("pg_ctl", &self.dir);
        cmd.arg("-D")
            .arg(&self.data_dir)
            .arg("-l")
            .arg(self.log_path())
            .args(["-w", "-t", "60", "-s", "start"]);
        let output = run(&mut cmd, "run pg_ctl start")?;
        if output.status.success() {
            return Ok(());
        }
        let log = fs::read_to_string(self.log_path()).unwrap_or_default();
        // A timed-out start may leave a server running; it must not outlive the failed attempt.
        self.stop_server();
        let mut detail = format!(
            "pg_ctl start exited with {}: {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
        if !settings.is_empty() {
            let given: Vec<String> = settings.iter().map(|(n, v)| format!("{n} = {v}")).collect();
            let _ = write!(
                detail,
                " (with the caller's settings: {})",
                given.join(", ")
            );
        }
        Err(HarnessError::ServerDidNotStart { detail, log })
    }

    fn stop_server(&self) {
        if !self.data_dir.join("postmaster.pid").exists() {
            return;
        }
        let mut cmd = self.runner.command("pg_ctl", &self.dir);
        cmd.arg("-D")
            .arg(&self.data_dir)
            .args(["-m", "immediate", "-w", "-t", "30", "-s", "stop"]);
        let stopped = matches!(run(&mut cmd, "run pg_ctl stop"), Ok(out) if out.status.success());
        if !stopped {
            self.kill_postmaster();
        }
    }

    /// Last resort when pg_ctl could not stop the server, so no postgres outlives the tests.
    fn kill_postmaster(&self) {
        let Ok(pid_file) = fs::read_to_string(self.data_dir.join("postmaster.pid")) else {
            return;
        };
        if let Some(pid) = pid_file
            .lines()
            .next()
            .and_then(|line| line.trim().parse::<libc::pid_t>().ok())
            .filter(|pid| *pid > 0)
        {
            // SAFETY: plain syscall; pid was written by this cluster's postmaster.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
    }

    /// Stops the server and deletes the directory; safe to call more than once.
    fn shut_down(&self) {
        if self.shut_down.swap(true, Ordering::SeqCst) {
            return;
        }
        self.stop_server();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.owned.shut_down();
    }
}

/// Starts a new throwaway cluster, ignoring `DATABASE_URL`.
///
/// Exists so the code path used on machines without `DATABASE_URL` can be
/// exercised on machines that have one. The cluster is stopped and its
/// directory removed when the returned value drops, or at the latest when
/// the process exits. This blocks for the few seconds `initdb` and the
/// server start take: inside a Tokio runtime, call it through
/// `tokio::task::spawn_blocking`. An `initdb` still running after two
/// minutes is killed and answered as [`HarnessError::Timeout`]; the start
/// is bounded by `pg_ctl`'s own 60 s.
pub fn start_throwaway_cluster() -> Result<Cluster, HarnessError> {
    Cluster::start(&[])
}

/// [`start_throwaway_cluster`] with `settings` added to its
/// `postgresql.conf`, after the harness's own (later lines win): for a
/// setting only a server start can change, such as
/// `max_prepared_transactions`.
///
/// Each pair is written as one `name = value` line, so a value other than
/// a word or a number is quoted by the caller, with `''` for a quote inside
/// (`("search_path", "'app, public'")`). Refused with
/// [`HarnessError::InvalidSetting`], before anything is started or written:
/// a name that is not a setting's name, an empty value, an unquoted value
/// with other characters than letters, digits and `-+._:/` (a `#` would
/// begin a comment there, a space end it), a quote left open or followed
/// by more text, a line break anywhere, and the settings the harness owns
/// (`port`, `listen_addresses`, `unix_socket_directories`,
/// `data_directory`, `config_file`, `hba_file`, `ident_file` and the
/// `include` directives: the cluster's URL, socket and clean-up depend on
/// them). A setting the server itself refuses (an unknown name, a value
/// out of range) is [`HarnessError::ServerDidNotStart`], with the server's
/// log and the caller's settings in it.
///
/// ```no_run
/// let cluster = idem_testing::start_throwaway_cluster_with(&[("max_prepared_transactions", "4")])?;
/// println!("{}", cluster.url());
/// # Ok::<(), idem_testing::HarnessError>(())
/// ```
pub fn start_throwaway_cluster_with(settings: &[(&str, &str)]) -> Result<Cluster, HarnessError> {
    Cluster::start(settings)
}

static SHARED: OnceLock<Result<Cluster, Arc<HarnessError>>> = OnceLock::new();

/// The per-process cluster, started on first use.
pub(crate) fn shared_cluster() -> Result<&'static Cluster, HarnessError> {
    // Stopped at the process's exit, as every cluster still alive then is.
    let cluster = SHARED.get_or_init(|| Cluster::start(&[]).map_err(Arc::new));
    cluster
        .as_ref()
        .map_err(|e| HarnessError::SharedCluster(Arc::clone(e)))
}

fn run(cmd: &mut Command, action: &str) -> Result<Output, HarnessError> {
    cmd.output().map_err(|e| HarnessError::io(action, e))
}

fn has_server_binaries(dir: &Path) -> bool {
    ["initdb", "pg_ctl", "postgres"]
        .iter()
        .all(|name| dir.join(name).is_file())
}

/// `IDEM_PG_BIN`, else `pg_config --bindir`, else the newest `/usr/lib/postgresql/*/bin`.
fn find_bin_dir() -> Result<PathBuf, HarnessError> {
    if let Some(dir) = std::env::var_os("IDEM_PG_BIN").filter(|v| !v.is_empty()) {
        let dir = PathBuf::from(dir);
        // An explicit choice that is wrong should fail loudly rather than silently use another version.
        return if has_server_binaries(&dir) {
            Ok(dir)
        } else {
            Err(HarnessError::NoServerBinaries {
                searched: format!("IDEM_PG_BIN={}", dir.display()),
            })
        };
    }
    let mut searched = Vec::new();
    match Command::new("pg_config")
        .arg("--bindir")
        .stderr(Stdio::null())
        .output()
    {
        Ok(out) if out.status.success() => {
            let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
            if has_server_binaries(&dir) {
                return Ok(dir);
            }
            searched.push(format!("pg_config --bindir ({})", dir.display()));
        }
        _ => searched.push("pg_config --bindir (pg_config not usable)".into()),
    }
    let root = Path::new("/usr/lib/postgresql");
    let mut candidates: Vec<(Vec<u32>, PathBuf)> = fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = parse_version(&entry.file_name())?;
            let bin = entry.path().join("bin");
            has_server_binaries(&bin).then_some((version, bin))
        })
        .collect();
    candidates.sort();
    if let Some((_, dir)) = candidates.pop() {
        return Ok(dir);
    }
    searched.push(format!("{}/*/bin", root.display()));
    Err(HarnessError::NoServerBinaries {
        searched: searched.join(", "),
    })
}

/// `"15"` -> `[15]`, `"9.6"` -> `[9, 6]`; anything else is not a version directory.
fn parse_version(name: &OsStr) -> Option<Vec<u32>> {
    name.to_str()?
        .split('.')
        .map(|part| part.parse().ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_version_directories() {
        assert_eq!(parse_version(OsStr::new("15")), Some(vec![15]));
        assert_eq!(parse_version(OsStr::new("9.6")), Some(vec![9, 6]));
        assert_eq!(parse_version(OsStr::new("common")), None);
        let mut versions = [vec![9, 6], vec![15], vec![10]];
        versions.sort();
        assert_eq!(versions.last(), Some(&vec![15]));
    }
}
