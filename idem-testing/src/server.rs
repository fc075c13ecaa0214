//! The throwaway servers behind [`nats`](crate::nats) and
//! [`redis`](crate::redis): an installed program run on a free loopback port
//! in a temporary directory of its own, the one a test process shares (shut
//! down when the process exits), and the choice of server tests use. The
//! nodes of a [`nats_cluster`](crate::nats_cluster) are such programs too,
//! on ports and in directories their cluster chooses.
//!
//! What sets one program apart is its [`Spec`]; each module turns a
//! [`Failure`] into its own public error.

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use crate::exit::{at_exit, stop_at_exit};
use crate::scratch::random_u32;

/// How long a started server gets to be ready (in this crate's unit tests,
/// which start programs that never are, less).
const START_TIMEOUT: Duration = Duration::from_secs(if cfg!(test) { 2 } else { 20 });

/// How often a starting server is asked whether it is ready yet.
const POLL: Duration = Duration::from_millis(20);

/// What sets one kind of server apart.
#[derive(Debug)]
pub(crate) struct Spec {
    /// The program's file name; its log is named after it.
    pub(crate) program: &'static str,
    /// The variable that names the program, before any search.
    pub(crate) program_var: &'static str,
    /// Where packages install the program, looked at after the `PATH`.
    pub(crate) installed: &'static [&'static str],
    /// The variable that names a running server to use.
    pub(crate) url_var: &'static str,
    /// The URL scheme; temporary directories are named after it.
    pub(crate) scheme: &'static str,
    /// The port on 127.0.0.1 a developer's or CI's own server listens on.
    pub(crate) default_port: u16,
    /// What a ready server does, for the error when it does not.
    pub(crate) ready_sign: &'static str,
    /// Whether the server on an address can serve the tests.
    pub(crate) is_ready: fn(&SocketAddr) -> bool,
    /// Adds the arguments that run the program on a port, with its files in
    /// a directory and its log in a file.
    pub(crate) args: fn(&mut Command, u16, &Path, &Path),
}

/// Why no server could be had.
#[derive(Debug, Clone)]
pub(crate) enum Failure {
    /// Not named by [`Spec::program_var`] and not found where searched.
    NoBinary {
        /// Where it was looked for.
        searched: String,
    },
    /// The program exited or was not ready in time.
    DidNotStart {
        /// What went wrong.
        detail: String,
        /// The server's log.
        log: String,
    },
    /// A file or process operation failed.
    Io {
        /// What was being attempted.
        action: String,
        /// The underlying error, shared because a failed shared server
        /// answers every later caller with it.
        source: Arc<io::Error>,
    },
}

impl Failure {
    fn io(action: impl Into<String>, source: io::Error) -> Self {
        Failure::Io {
            action: action.into(),
            source: Arc::new(source),
        }
    }
}

/// `impl From<Failure> for $error`, for the public errors of
/// [`nats`](crate::nats) and [`redis`](crate::redis): both name these
/// failures alike, each as variants of its own enum, which no generic can
/// build.
macro_rules! from_failure {
    ($error:ident) => {
        impl From<$crate::server::Failure> for $error {
            fn from(failure: $crate::server::Failure) -> Self {
                use $crate::server::Failure;
                match failure {
                    Failure::NoBinary { searched } => $error::NoServerBinary { searched },
                    Failure::DidNotStart { detail, log } => {
                        $error::ServerDidNotStart { detail, log }
                    }
                    Failure::Io { action, source } => $error::Io { action, source },
                }
            }
        }
    };
}
pub(crate) use from_failure;

/// A server program started by the harness. Its owner stops it: the public
/// server types [`shut_down`](Self::shut_down) it when dropped, the exit hook
/// a [`Shared`] one, a cluster its nodes (and their common directory).
#[derive(Debug)]
pub(crate) struct Process {
    spec: &'static Spec,
    binary: PathBuf,
    port: u16,
    url: String,
    dir: PathBuf,
    child: Mutex<Option<Child>>,
}

impl Process {
    /// Start the program on a free port of 127.0.0.1, in a new temporary
    /// directory. Blocks until it is ready.
    pub(crate) fn start(spec: &'static Spec) -> Result<Process, Failure> {
        let port = TcpListener::bind(("127.0.0.1", 0))
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .map_err(|e| Failure::io("find a free TCP port on 127.0.0.1", e))?;
        let dir = std::env::temp_dir().join(format!("idem-{}-{}", spec.scheme, unique_suffix()));
        let process = Process::new(spec, port, dir)?;
        std::fs::create_dir_all(&process.dir)
            .map_err(|e| Failure::io(format!("create {}", process.dir.display()), e))?;
        // Nothing owns them yet: a failed start must not leave a running
        // program or its directory behind.
        if let Err(failure) = process.spawn() {
            process.shut_down();
            return Err(failure);
        }
        Ok(process)
    }

    /// [`Process::start`], for an owner that may never drop it (a server
    /// kept in a `static`): stopped at the process's exit if still running.
    pub(crate) fn start_owned(spec: &'static Spec) -> Result<Arc<Process>, Failure> {
        let process = Arc::new(Process::start(spec)?);
        stop_at_exit(&process, Process::shut_down);
        Ok(process)
    }

    /// The program found for `spec`, to run on `port` of 127.0.0.1 with its
    /// files in `dir`, which the caller provides; nothing runs before
    /// [`spawn`](Self::spawn). For servers whose port and directory are
    /// chosen by their owner, e.g. a cluster node configured before its
    /// first start.
    pub(crate) fn new(spec: &'static Spec, port: u16, dir: PathBuf) -> Result<Process, Failure> {
        Ok(Process {
            spec,
            binary: find_binary(spec)?,
            port,
            url: loopback_url(spec, port),
            dir,
            child: Mutex::new(None),
        })
    }

    /// Its URL, `SCHEME://127.0.0.1:PORT`.
    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    /// The address it listens on.
    pub(crate) fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// Its temporary directory.
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// Its log file, in its directory, named after the program: where
    /// [`Spec::args`] has it write, and what a failed start reports.
    pub(crate) fn log(&self) -> PathBuf {
        self.dir.join(format!("{}.log", self.spec.program))
    }

    /// Run the program on this port and directory, and wait until it is
    /// ready. After a [`kill`](Self::kill), this is a restart that clients
    /// of the old one reconnect to.
    pub(crate) fn spawn(&self) -> Result<(), Failure> {
        let log = self.log();
        let mut command = Command::new(&self.binary);
        (self.spec.args)(&mut command, self.port, &self.dir, &log);
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| Failure::io(format!("run {}", self.binary.display()), e))?;
        *self.child() = Some(child);
        let addr = self.addr();
        let started = Instant::now();
        loop {
            if (self.spec.is_ready)(&addr) {
                return Ok(());
            }
            let exited = self
                .child()
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            if exited.is_some() || started.elapsed() > START_TIMEOUT {
                let detail = match exited {
                    Some(status) => format!("it exited with {status}"),
                    None => format!(
                        "no {} on {addr} after {START_TIMEOUT:?}",
                        self.spec.ready_sign
                    ),
                };
                // One that never became ready is not left running (a
                // restart's caller keeps its handle, and would find it
                // half up later).
                self.kill();
                let log = std::fs::read_to_string(&log).unwrap_or_default();
                return Err(Failure::DidNotStart { detail, log });
            }
            std::thread::sleep(POLL);
        }
    }

    /// Whether the program runs: spawned, not killed, not exited.
    pub(crate) fn is_running(&self) -> bool {
        matches!(self.child().as_mut().map(Child::try_wait), Some(Ok(None)))
    }

    /// Kill the program (SIGKILL) and reap it, keeping its directory.
    pub(crate) fn kill(&self) {
        if let Some(mut child) = self.child().take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Send `signal` to the program; its pid, if it runs.
    pub(crate) fn signal(&self, signal: libc::c_int) -> Option<libc::pid_t> {
        let pid = self
            .child()
            .as_ref()
            .and_then(|c| libc::pid_t::try_from(c.id()).ok());
        if let Some(pid) = pid {
            // SAFETY: kill(2) on the pid of a child this harness spawned and
            // has not reaped (it is still in `child`).
            unsafe {
                libc::kill(pid, signal);
            }
        }
        pid
    }

    // A panic elsewhere while the lock was held leaves the handle as valid
    // as before; cleanup must still reach the process.
    fn child(&self) -> MutexGuard<'_, Option<Child>> {
        self.child.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Kill the program and remove its directory.
    pub(crate) fn shut_down(&self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The server the tests of a process share.
#[derive(Debug)]
pub(crate) struct Shared {
    spec: &'static Spec,
    started: OnceLock<Result<Process, Failure>>,
}

impl Shared {
    /// For a `static`: nothing starts before the first [`url`](Self::url).
    pub(crate) const fn new(spec: &'static Spec) -> Shared {
        Shared {
            spec,
            started: OnceLock::new(),
        }
    }

    /// The server named by [`Spec::url_var`] if set (and not empty); else
    /// the one on [`Spec::default_port`] if it is ready; else a [`Process`]
    /// started on the first call, which is shut down when this process
    /// exits. Blocking: the first call may start a server.
    pub(crate) fn url(&'static self) -> Result<String, Failure> {
        let spec = self.spec;
        match std::env::var(spec.url_var) {
            Ok(url) if !url.is_empty() => return Ok(url),
            _ => {}
        }
        if (spec.is_ready)(&SocketAddr::from(([127, 0, 0, 1], spec.default_port))) {
            return Ok(loopback_url(spec, spec.default_port));
        }
        let started = self.started.get_or_init(|| {
            let process = Process::start(spec)?;
            at_exit(|| {
                if let Some(Ok(process)) = self.started.get() {
                    process.shut_down();
                }
            });
            Ok(process)
        });
        started
            .as_ref()
            .map(|process| process.url.clone())
            .map_err(Clone::clone)
    }
}

fn loopback_url(spec: &Spec, port: u16) -> String {
    format!("{}://127.0.0.1:{port}", spec.scheme)
}

fn find_binary(spec: &Spec) -> Result<PathBuf, Failure> {
    if let Some(path) = std::env::var_os(spec.program_var).filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(path));
    }
    let mut searched = vec![format!("{} (unset)", spec.program_var)];
    if let Some(paths) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&paths) {
            let candidate = dir.join(spec.program);
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    searched.push("PATH".to_owned());
    for &candidate in spec.installed {
        if Path::new(candidate).is_file() {
            return Ok(candidate.into());
        }
        searched.push(candidate.to_owned());
    }
    Err(Failure::NoBinary {
        searched: searched.join(", "),
    })
}

/// `PID_COUNTER_RANDOM`: unique across the tests of a process and across
/// processes sharing one server.
pub(crate) fn unique_suffix() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{}_{n}_{:08x}", std::process::id(), random_u32())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shell that writes its pid into its directory, then sleeps: never
    /// ready.
    static NEVER_READY: Spec = Spec {
        program: "sh",
        program_var: "IDEM_TEST_NEVER_READY_SH",
        installed: &["/bin/sh"],
        url_var: "IDEM_TEST_NEVER_READY_URL",
        scheme: "never-ready",
        default_port: 1,
        ready_sign: "nothing",
        is_ready: |_| false,
        args: |command, _, dir, _| {
            let pid = dir.join("pid");
            command
                .arg("-c")
                .arg(format!("echo $$ > '{}'; exec sleep 60", pid.display()));
        },
    };

    #[test]
    fn a_program_never_ready_is_not_left_running() {
        let dir = std::env::temp_dir().join(format!("idem-never-ready-{}", unique_suffix()));
        std::fs::create_dir_all(&dir).unwrap();
        let process = Process::new(&NEVER_READY, 1, dir.clone()).unwrap();
        let failure = process.spawn().unwrap_err();
        assert!(
            matches!(failure, Failure::DidNotStart { .. }),
            "{failure:?}"
        );
        let pid: libc::pid_t = std::fs::read_to_string(dir.join("pid"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        // Killed and reaped: no such process any more.
        // SAFETY: signal 0 only asks whether the process exists.
        let alive = unsafe { libc::kill(pid, 0) } == 0;
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(!alive, "pid {pid} still runs after the failed start");
    }
}
