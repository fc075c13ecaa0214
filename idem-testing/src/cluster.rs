//! Throwaway PostgreSQL clusters built from the locally installed server binaries.

use std::ffi::OsStr;
use std::fmt::Write as _;
use std::fs::{self, OpenOptions};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use crate::exit::at_exit;
use crate::privilege::Runner;
use crate::scratch::{free_port, make_temp_dir};
use crate::HarnessError;

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
/// worth a clean shutdown) and deletes the directory.
#[derive(Debug)]
pub struct Cluster {
    dir: PathBuf,
    data_dir: PathBuf,
    port: u16,
    url: String,
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
        &self.dir
    }

    /// The data directory (`PGDATA`).
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// The directory the server binaries were taken from.
    pub fn bin_dir(&self) -> &Path {
        &self.runner.bin_dir
    }

    fn start(settings: &[(&str, &str)]) -> Result<Cluster, HarnessError> {
        let runner = Runner::for_bin_dir(find_bin_dir()?)?;
        let dir = make_temp_dir("idem-pg")?;
        // From here on, Drop owns the cleanup of whatever the remaining steps leave behind.
        let cluster = Cluster {
            data_dir: dir.join("data"),
            dir,
            port: 0,
            url: String::new(),
            runner,
            shut_down: AtomicBool::new(false),
        };
        cluster.finish_start(settings)
    }

    fn finish_start(mut self, settings: &[(&str, &str)]) -> Result<Cluster, HarnessError> {
        // The server creates its data dir, socket and log in here.
        self.runner.give_dir(&self.dir)?;
        self.initdb()?;
        let mut conf = self.base_settings();
        for (name, value) in settings {
            let _ = writeln!(conf, "{name} = {value}");
        }
        self.append_settings(&conf)?;
        for attempt in 1..=PORT_ATTEMPTS {
            let port = free_port()?;
            // Later lines win in postgresql.conf, so a retry simply appends a new port.
            self.append_settings(&format!("port = {port}\n"))?;
            match self.pg_ctl_start() {
                Ok(()) => {
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

    fn initdb(&self) -> Result<(), HarnessError> {
        let mut cmd = self.runner.command("initdb", &self.dir);
        cmd.arg("-D")
            .arg(&self.data_dir)
            .args(["-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8"])
            // The environment's locale may not be installed, which makes initdb fail; C always exists.
            .arg("--locale=C");
        let output = run(&mut cmd, "run initdb")?;
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

    fn pg_ctl_start(&self) -> Result<(), HarnessError> {
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
        Err(HarnessError::ServerDidNotStart {
            detail: format!(
                "pg_ctl start exited with {}: {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            ),
            log,
        })
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
    pub(crate) fn shut_down(&self) {
        if self.shut_down.swap(true, Ordering::SeqCst) {
            return;
        }
        self.stop_server();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.shut_down();
    }
}

/// Starts a new throwaway cluster, ignoring `DATABASE_URL`.
///
/// Exists so the code path used on machines without `DATABASE_URL` can be
/// exercised on machines that have one. The cluster is stopped and its
/// directory removed when the returned value drops. This blocks for the few
/// seconds `initdb` and the server start take.
pub fn start_throwaway_cluster() -> Result<Cluster, HarnessError> {
    Cluster::start(&[])
}

/// [`start_throwaway_cluster`] with `settings` added to its
/// `postgresql.conf`, after the harness's own (later lines win): for a
/// setting only a server start can change, such as
/// `max_prepared_transactions`. Each value is written as given, so a
/// string is quoted by the caller (`("lc_messages", "'C'")`).
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
    let cluster = SHARED.get_or_init(|| {
        let cluster = Cluster::start(&[]).map_err(Arc::new)?;
        at_exit(|| {
            if let Some(Ok(cluster)) = SHARED.get() {
                cluster.shut_down();
            }
        });
        Ok(cluster)
    });
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
