//! One node of a [`ReplicaPair`](super::ReplicaPair): its directory, its
//! port, and the installed programs run on its data directory.
//!
//! Everything here blocks (it runs the installed programs and waits for
//! processes); the pair calls it from `spawn_blocking`.

use std::fs::{self, OpenOptions};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::process::{self, kill_tree, port_is_free, signal, wait_for, wait_gone};
use super::{ReplicaError, WAIT};
use crate::bounded::{output_within, PROGRAM_BOUND};
use crate::privilege::Runner;
use crate::HarnessError;

/// How much of the server log an error carries.
const LOG_TAIL: usize = 4000;

/// A node: the fixed part (name, directory) and the port and pid of its
/// postmaster, shared between clones so that a stop through any clone
/// (the pair's `Drop`, the process's exit) sees a server started, or a
/// port chosen, later or by an operation that was still under way.
#[derive(Debug, Clone)]
pub(crate) struct Node {
    /// Its `application_name` as a standby and its `cluster_name`.
    pub(crate) name: &'static str,
    pub(crate) dir: PathBuf,
    port: Arc<AtomicU16>,
    pid: Arc<Mutex<Option<libc::pid_t>>>,
}

impl Node {
    pub(crate) fn new(name: &'static str, dir: PathBuf) -> Node {
        Node {
            name,
            dir,
            port: Arc::new(AtomicU16::new(0)),
            pid: Arc::new(Mutex::new(None)),
        }
    }

    /// The port it listens on (0 before its first start).
    pub(crate) fn port(&self) -> u16 {
        self.port.load(Ordering::SeqCst)
    }

    /// The port of its next start.
    pub(crate) fn set_port(&self, port: u16) {
        self.port.store(port, Ordering::SeqCst);
    }

    pub(crate) fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.join("server.log")
    }

    /// The URL of `database` on this node alone.
    pub(crate) fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port())
    }

    /// A libpq connection string to this node, as a replication source for
    /// the standby `application_name` (which names it in
    /// `synchronous_standby_names` and `pg_stat_replication`).
    fn conninfo(&self, application_name: &str) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres application_name={application_name}",
            self.port()
        )
    }

    fn pid(&self) -> Option<libc::pid_t> {
        *self.pid.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set_pid(&self, pid: Option<libc::pid_t>) {
        *self.pid.lock().unwrap_or_else(|e| e.into_inner()) = pid;
    }

    /// Whether its postmaster runs.
    pub(crate) fn is_running(&self) -> bool {
        self.pid().is_some_and(process::is_alive)
    }

    pub(crate) fn initdb(&self, runner: &Runner) -> Result<(), ReplicaError> {
        let mut cmd = runner.command("initdb", &self.dir);
        cmd.arg("-D")
            .arg(self.data_dir())
            .args(["-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8"])
            // The environment's locale may not be installed; C always exists.
            .arg("--locale=C");
        self.run(cmd, "initdb").map(drop)
    }

    /// Appends `text` to postgresql.conf, which `pg_basebackup` and
    /// `pg_rewind` copy to the other node: only settings both share go there.
    pub(crate) fn append_settings(&self, text: &str) -> Result<(), ReplicaError> {
        let path = self.data_dir().join("postgresql.conf");
        OpenOptions::new()
            .append(true)
            .open(&path)
            .and_then(|mut file| file.write_all(text.as_bytes()))
            .map_err(|e| HarnessError::io(format!("append to {}", path.display()), e).into())
    }

    /// `pg_ctl start`, waiting until it accepts connections (as a primary,
    /// or as a hot standby). The settings that differ between the nodes
    /// (port, socket directory, name) go on the command line, because the
    /// configuration files travel between the nodes with every clone.
    pub(crate) fn start(&self, runner: &Runner) -> Result<(), ReplicaError> {
        // The caller has made sure that none of a previous server runs.
        self.remove_lock_files();
        // pg_ctl hands the options to a shell: quote the path for it.
        let socket_dir = self.dir.display().to_string().replace('\'', "'\\''");
        let options = format!(
            "-p {} -c cluster_name={} -c unix_socket_directories='{socket_dir}'",
            self.port(),
            self.name
        );
        let mut cmd = runner.command("pg_ctl", &self.dir);
        cmd.arg("-D")
            .arg(self.data_dir())
            .arg("-l")
            .arg(self.log_path())
            .arg("-o")
            .arg(options)
            .args(["-w", "-t", &WAIT.as_secs().to_string(), "-s", "start"]);
        let result = self.run(cmd, "pg_ctl start");
        // Even a failed start may have left a postmaster running; it must be known to be stopped.
        self.set_pid(self.pid_from_file());
        if let (Err(_), Some(pid)) = (&result, self.pid()) {
            // Not `kill`: after a lost race for the port, the port is not ours to wait for.
            wait_gone(&kill_tree(pid), WAIT);
            self.set_pid(None);
        }
        result.map(drop)
    }

    fn pid_from_file(&self) -> Option<libc::pid_t> {
        fs::read_to_string(self.data_dir().join("postmaster.pid"))
            .ok()?
            .lines()
            .next()?
            .trim()
            .parse()
            .ok()
            .filter(|&pid| pid > 0 && process::runs_from(pid, &self.data_dir()))
    }

    /// How long the server log is now, to read only what a start adds.
    pub(crate) fn log_len(&self) -> usize {
        fs::metadata(self.log_path()).map_or(0, |m| m.len() as usize)
    }

    /// Whether the server log, after `since`, says another process held the port.
    pub(crate) fn port_was_taken(&self, since: usize) -> bool {
        fs::read(self.log_path()).is_ok_and(|log| {
            String::from_utf8_lossy(log.get(since..).unwrap_or_default()).contains("could not bind")
        })
    }

    /// A shutdown by signal: SIGINT is PostgreSQL's "fast" mode (clients are
    /// disconnected; SIGTERM would be "smart" and wait for them forever),
    /// SIGQUIT its "immediate" mode. Whatever still runs after `grace` is
    /// killed. Returns once the port is free.
    pub(crate) fn stop(&self, sig: libc::c_int, grace: Duration) -> Result<(), ReplicaError> {
        let Some(pid) = self.pid().or_else(|| self.pid_from_file()) else {
            return Ok(());
        };
        if process::is_alive(pid) {
            signal(pid, sig);
            if !wait_gone(&[pid], grace) {
                return self.kill();
            }
        }
        // The postmaster waits for its children before it exits; a SIGKILLed
        // one did not, so they are looked for as well.
        let leftovers = process::children(pid);
        leftovers
            .iter()
            .for_each(|&child| signal(child, libc::SIGKILL));
        self.finish_stop(&leftovers)
    }

    /// SIGKILL of the postmaster and of every process it started.
    pub(crate) fn kill(&self) -> Result<(), ReplicaError> {
        let Some(pid) = self.pid().or_else(|| self.pid_from_file()) else {
            return Ok(());
        };
        let pids = kill_tree(pid);
        self.finish_stop(&pids)
    }

    fn finish_stop(&self, pids: &[libc::pid_t]) -> Result<(), ReplicaError> {
        if !wait_gone(pids, WAIT) {
            return Err(self.wait_error(format!("the processes {pids:?} of {} to exit", self.name)));
        }
        self.set_pid(None);
        self.remove_lock_files();
        if !wait_for(WAIT, || port_is_free(self.port())) {
            return Err(self.wait_error(format!(
                "port {} of {} to be free",
                self.port(),
                self.name
            )));
        }
        Ok(())
    }

    /// Removes the lock files of a server known to be gone. A killed one
    /// leaves them behind naming its pid, which may linger as a zombie
    /// (pid 1 of a container may reap late), and PostgreSQL, `pg_rewind`'s
    /// crash recovery included, would take it for a running server.
    fn remove_lock_files(&self) {
        let _ = fs::remove_file(self.data_dir().join("postmaster.pid"));
        let socket = format!(".s.PGSQL.{}", self.port());
        let _ = fs::remove_file(self.dir.join(format!("{socket}.lock")));
        let _ = fs::remove_file(self.dir.join(socket));
    }

    fn wait_error(&self, awaited: String) -> ReplicaError {
        ReplicaError::Wait {
            awaited,
            after: WAIT,
            last: "still there".into(),
        }
    }

    /// `pg_ctl promote`, which waits until the promotion is done.
    pub(crate) fn promote(&self, runner: &Runner) -> Result<(), ReplicaError> {
        let mut cmd = runner.command("pg_ctl", &self.dir);
        cmd.arg("-D").arg(self.data_dir()).args([
            "-w",
            "-t",
            &WAIT.as_secs().to_string(),
            "-s",
            "promote",
        ]);
        self.run(cmd, "pg_ctl promote").map(drop)
    }

    /// Replaces the data directory with a fresh `pg_basebackup -R` of
    /// `source`, with this node as a standby of it.
    pub(crate) fn clone_from(&self, runner: &Runner, source: &Node) -> Result<(), ReplicaError> {
        let data_dir = self.data_dir();
        match fs::remove_dir_all(&data_dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(HarnessError::io(format!("remove {}", data_dir.display()), e).into())
            }
        }
        let mut cmd = runner.command("pg_basebackup", &self.dir);
        cmd.arg("-D")
            .arg(&data_dir)
            .arg("-d")
            .arg(source.conninfo(self.name))
            // -R writes standby.signal and primary_conninfo (with our
            // application_name); a fast checkpoint, because a spread one
            // takes minutes; no fsync, the pair is thrown away.
            .args(["-R", "-X", "stream", "--checkpoint=fast", "--no-sync"]);
        self.run(cmd, "pg_basebackup").map(drop)
    }

    /// `pg_rewind -R` of this (stopped) node's data directory onto the
    /// timeline of `source`: only the blocks that changed since the fork
    /// are copied. PostgreSQL 13 and later first run crash recovery on a
    /// directory that was not shut down cleanly, as after a SIGKILL.
    pub(crate) fn rewind_from(&self, runner: &Runner, source: &Node) -> Result<(), ReplicaError> {
        let mut cmd = runner.command("pg_rewind", &self.dir);
        cmd.arg("-D")
            .arg(self.data_dir())
            .arg(format!("--source-server={}", source.conninfo(self.name)))
            .args(["-R", "--no-sync"]);
        self.run(cmd, "pg_rewind").map(drop)
    }

    /// Runs `cmd` within the harness's bound for a program, and on failure
    /// reports its stderr and the server log.
    fn run(&self, mut cmd: Command, program: &str) -> Result<Output, ReplicaError> {
        let output = output_within(&mut cmd, PROGRAM_BOUND, &format!("run {program}"))?;
        if output.status.success() {
            return Ok(output);
        }
        let log = fs::read_to_string(self.log_path()).unwrap_or_default();
        let tail_start = log.len().saturating_sub(LOG_TAIL);
        let tail_start = (tail_start..log.len())
            .find(|&i| log.is_char_boundary(i))
            .unwrap_or(log.len());
        Err(ReplicaError::Program {
            program: program.to_owned(),
            status: output.status,
            data_dir: self.data_dir(),
            stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
            log: log[tail_start..].to_owned(),
        })
    }
}

/// `dir` made writable for the account the servers run as.
pub(crate) fn make_node_dir(runner: &Runner, dir: &Path) -> Result<(), ReplicaError> {
    fs::create_dir(dir).map_err(|e| HarnessError::io(format!("create {}", dir.display()), e))?;
    runner.give_dir(dir)?;
    Ok(())
}

/// The programs the pair runs, beyond the ones a single cluster needs.
const PROGRAMS: [&str; 5] = ["initdb", "pg_ctl", "postgres", "pg_basebackup", "pg_rewind"];

/// `IDEM_PG_BIN`, else `pg_config --bindir`, else the newest
/// `/usr/lib/postgresql/*/bin`: as the throwaway cluster looks, with
/// `pg_basebackup` and `pg_rewind` required too.
pub(crate) fn find_bin_dir() -> Result<PathBuf, HarnessError> {
    let usable = |dir: &Path| PROGRAMS.iter().all(|p| dir.join(p).is_file());
    if let Some(dir) = std::env::var_os("IDEM_PG_BIN").filter(|v| !v.is_empty()) {
        let dir = PathBuf::from(dir);
        // An explicit choice that is wrong fails loudly rather than silently using another version.
        return if usable(&dir) {
            Ok(dir)
        } else {
            Err(HarnessError::NoServerBinaries {
                searched: format!("IDEM_PG_BIN={} (needs {PROGRAMS:?})", dir.display()),
            })
        };
    }
    let from_pg_config = Command::new("pg_config")
        .arg("--bindir")
        .stderr(Stdio::null())
        .output()
        .ok()
        .filter(|out| out.status.success())
        .map(|out| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()));
    let mut versions: Vec<(Vec<u32>, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name();
            let version = name
                .to_str()?
                .split('.')
                .map(|p| p.parse().ok())
                .collect::<Option<_>>()?;
            Some((version, entry.path().join("bin")))
        })
        .collect();
    versions.sort();
    from_pg_config
        .into_iter()
        .chain(versions.into_iter().rev().map(|(_, dir)| dir))
        .find(|dir| usable(dir))
        .ok_or_else(|| HarnessError::NoServerBinaries {
            searched: format!("pg_config --bindir, /usr/lib/postgresql/*/bin (needs {PROGRAMS:?})"),
        })
}
