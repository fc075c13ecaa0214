//! A Redis server for tests, shared or of a test's own.
//!
//! # Which server
//!
//! 1. If `REDIS_URL` is set (and not empty), that server, e.g.
//!    `redis://127.0.0.1:6379`.
//! 2. Otherwise, if a server answers `PING` on `127.0.0.1:6379`, that one.
//! 3. Otherwise the first use in a process starts `redis-server` (from
//!    `IDEM_REDIS_SERVER`, else `redis-server` on the `PATH`, else
//!    `/usr/bin/redis-server` or `/usr/sbin/redis-server`) on a free loopback
//!    port, with no persistence, in a temporary directory. It is stopped and
//!    its directory removed when the process exits.
//!
//! Tests share that server and run in parallel, so each keeps to keys under
//! a [`unique_prefix`] of its own and never flushes it. A test that flushes,
//! stops or freezes Redis starts a [`RedisServer`] of its own.
//!
//! ```no_run
//! # fn demo() -> Result<(), idem_testing::redis::RedisHarnessError> {
//! let shared = idem_testing::redis::url()?;
//! let prefix = idem_testing::redis::unique_prefix("cache");
//! let own = idem_testing::redis::RedisServer::start()?;
//! own.command(&["FLUSHALL"])?;
//! own.stop(); // from now on nothing answers at own.url()
//! # let _ = (shared, prefix); Ok(()) }
//! ```

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::scratch::random_u32;

/// The port a developer's or CI's own server listens on.
const DEFAULT_ADDR: &str = "127.0.0.1:6379";

/// How long a started server gets to answer `PING`.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// Why the harness could not provide a Redis server.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum RedisHarnessError {
    /// No `REDIS_URL`, nothing answering on 127.0.0.1:6379, and no
    /// `redis-server` binary.
    #[error(
        "no Redis server: REDIS_URL is unset, nothing answers PING on 127.0.0.1:6379, and no \
         redis-server binary was found (searched: {searched}). Install redis-server, set \
         IDEM_REDIS_SERVER to it, or set REDIS_URL"
    )]
    NoServerBinary {
        /// Where the binary was looked for.
        searched: String,
    },
    /// The started server did not answer in time.
    #[error("redis-server did not start: {detail}\n--- server log ---\n{log}")]
    ServerDidNotStart {
        /// What went wrong.
        detail: String,
        /// The server's log.
        log: String,
    },
    /// A file, process or socket operation failed.
    #[error("{action}: {source}")]
    Io {
        /// What was being attempted.
        action: String,
        /// The underlying error.
        #[source]
        source: Arc<io::Error>,
    },
    /// The server answered a command with an error.
    #[error("redis answered {0}")]
    Reply(String),
}

impl RedisHarnessError {
    fn io(action: impl Into<String>, source: io::Error) -> Self {
        RedisHarnessError::Io {
            action: action.into(),
            source: Arc::new(source),
        }
    }
}

/// A `redis-server` started by the harness, without persistence; stopped
/// (and its directory removed) when dropped.
#[derive(Debug)]
pub struct RedisServer {
    url: String,
    addr: SocketAddr,
    dir: PathBuf,
    child: Mutex<Option<Child>>,
}

impl RedisServer {
    /// Start a server on a free port of 127.0.0.1 (`--save '' --appendonly
    /// no`), in a new temporary directory. Blocks until it answers `PING`.
    pub fn start() -> Result<RedisServer, RedisHarnessError> {
        let binary = find_binary()?;
        let port = TcpListener::bind(("127.0.0.1", 0))
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .map_err(|e| RedisHarnessError::io("find a free TCP port on 127.0.0.1", e))?;
        let dir = std::env::temp_dir().join(format!("idem-redis-{}", unique_suffix()));
        std::fs::create_dir_all(&dir)
            .map_err(|e| RedisHarnessError::io(format!("create {}", dir.display()), e))?;
        let log = dir.join("redis-server.log");
        let child = Command::new(&binary)
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(&dir)
            .arg("--logfile")
            .arg(&log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| RedisHarnessError::io(format!("run {}", binary.display()), e))?;
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let server = RedisServer {
            url: format!("redis://{addr}"),
            addr,
            dir,
            child: Mutex::new(Some(child)),
        };
        let started = Instant::now();
        loop {
            if answers_ping(&addr) {
                return Ok(server);
            }
            let exited = server
                .child
                .lock()
                .ok()
                .and_then(|mut c| c.as_mut().and_then(|c| c.try_wait().ok().flatten()));
            if exited.is_some() || started.elapsed() > START_TIMEOUT {
                let detail = match exited {
                    Some(status) => format!("it exited with {status}"),
                    None => format!("no answer to PING on {addr} after {START_TIMEOUT:?}"),
                };
                let log = std::fs::read_to_string(&log).unwrap_or_default();
                return Err(RedisHarnessError::ServerDidNotStart { detail, log });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Its URL, `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Its temporary directory (the log).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Send one command and return the reply's first line (`+OK`, `:3`,
    /// `$5`..): enough for `FLUSHALL`, `DBSIZE`, `EXISTS`.
    pub fn command(&self, args: &[&str]) -> Result<String, RedisHarnessError> {
        command(&self.addr, args, Duration::from_secs(5))
    }

    /// Kill the server: from now on its port refuses connections. Its
    /// directory stays until drop.
    pub fn stop(&self) {
        if let Some(mut child) = self.child.lock().ok().and_then(|mut c| c.take()) {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Freeze the server (`SIGSTOP`): connections stay open and nothing
    /// answers, as with a Redis stuck in a long command or a lost network.
    pub fn pause(&self) {
        self.signal(libc::SIGSTOP);
    }

    /// Thaw a [`pause`](Self::pause)d server.
    pub fn resume(&self) {
        self.signal(libc::SIGCONT);
    }

    fn signal(&self, signal: libc::c_int) {
        if let Some(child) = self.child.lock().ok().as_ref().and_then(|c| c.as_ref()) {
            if let Ok(pid) = libc::pid_t::try_from(child.id()) {
                // SAFETY: kill(2) on our own child's pid, which we have not reaped.
                unsafe {
                    libc::kill(pid, signal);
                }
            }
        }
    }

    fn shut_down(&self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.shut_down();
    }
}

static SHARED: OnceLock<Result<RedisServer, RedisHarnessError>> = OnceLock::new();

extern "C" fn shut_down_shared_server() {
    // Unwinding out of an extern "C" fn aborts; a failed cleanup must not
    // turn a passing run into a crash.
    let _ = std::panic::catch_unwind(|| {
        if let Some(Ok(server)) = SHARED.get() {
            server.shut_down();
        }
    });
}

/// The URL of the shared Redis tests use (see the [module docs](self) for
/// which). Blocking: the first call may start a server.
pub fn url() -> Result<String, RedisHarnessError> {
    match std::env::var("REDIS_URL") {
        Ok(url) if !url.is_empty() => return Ok(url),
        _ => {}
    }
    if let Ok(addr) = DEFAULT_ADDR.parse() {
        if answers_ping(&addr) {
            return Ok(format!("redis://{DEFAULT_ADDR}"));
        }
    }
    let server = SHARED.get_or_init(|| {
        let server = RedisServer::start()?;
        // Statics are never dropped: without this the server would outlive
        // the test binary.
        // SAFETY: registers a plain extern "C" fn; libc keeps no other state for it.
        unsafe {
            libc::atexit(shut_down_shared_server);
        }
        Ok(server)
    });
    server.as_ref().map(|s| s.url.clone()).map_err(Clone::clone)
}

/// A key prefix no other test (of this process or another) uses:
/// `idem-test:{label}:{pid}_{n}_{random}:`.
pub fn unique_prefix(label: &str) -> String {
    format!("idem-test:{label}:{}:", unique_suffix())
}

/// Whether a Redis answers `PING` on `addr`.
fn answers_ping(addr: &SocketAddr) -> bool {
    command(addr, &["PING"], Duration::from_millis(300)).is_ok_and(|reply| reply == "+PONG")
}

/// One command in RESP, and the first line of its reply.
fn command(addr: &SocketAddr, args: &[&str], wait: Duration) -> Result<String, RedisHarnessError> {
    let action = |what: &str| format!("{what} redis at {addr}");
    let mut socket = TcpStream::connect_timeout(addr, Duration::from_millis(300))
        .map_err(|e| RedisHarnessError::io(action("connect to"), e))?;
    let _ = socket.set_read_timeout(Some(wait));
    let mut request = format!("*{}\r\n", args.len());
    for arg in args {
        request.push_str(&format!("${}\r\n{arg}\r\n", arg.len()));
    }
    socket
        .write_all(request.as_bytes())
        .map_err(|e| RedisHarnessError::io(action("write to"), e))?;
    let mut reply = Vec::new();
    let mut buf = [0_u8; 512];
    while !reply.ends_with(b"\r\n") {
        match socket.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => reply.extend_from_slice(&buf[..n]),
            Err(e) => return Err(RedisHarnessError::io(action("read from"), e)),
        }
    }
    let line = String::from_utf8_lossy(&reply);
    let first = line.lines().next().unwrap_or_default().to_owned();
    if first.starts_with('-') {
        return Err(RedisHarnessError::Reply(first));
    }
    Ok(first)
}

fn find_binary() -> Result<PathBuf, RedisHarnessError> {
    if let Some(path) = std::env::var_os("IDEM_REDIS_SERVER").filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(path));
    }
    let mut searched = vec!["IDEM_REDIS_SERVER (unset)".to_owned()];
    if let Some(paths) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&paths) {
            let candidate = dir.join("redis-server");
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    searched.push("PATH".to_owned());
    for candidate in ["/usr/bin/redis-server", "/usr/sbin/redis-server"] {
        if Path::new(candidate).is_file() {
            return Ok(candidate.into());
        }
        searched.push(candidate.to_owned());
    }
    Err(RedisHarnessError::NoServerBinary {
        searched: searched.join(", "),
    })
}

/// `PID_COUNTER_RANDOM`: unique across the tests of a process and across
/// processes sharing one server.
fn unique_suffix() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{}_{n}_{:08x}", std::process::id(), random_u32())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The path taken where no server runs: start one, see it answer, freeze
    /// and thaw it, stop it.
    #[test]
    fn starts_a_server_and_stops_it() {
        let server = RedisServer::start().expect("redis-server starts");
        let addr: SocketAddr = server
            .url()
            .trim_start_matches("redis://")
            .parse()
            .expect("addr");
        assert!(answers_ping(&addr));
        assert_eq!(server.command(&["SET", "k", "v"]).unwrap(), "+OK");
        assert_eq!(server.command(&["DBSIZE"]).unwrap(), ":1");
        server.pause();
        // Frozen: the kernel still accepts, nothing answers.
        assert!(!answers_ping(&addr));
        server.resume();
        assert!(answers_ping(&addr));
        let dir = server.dir().to_owned();
        drop(server);
        assert!(!dir.exists(), "directory removed");
        assert!(!answers_ping(&addr), "stopped");
    }
}
