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
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use crate::server::{self, unique_suffix, Process, Shared, Spec};

static SPEC: Spec = Spec {
    program: "redis-server",
    program_var: "IDEM_REDIS_SERVER",
    installed: &["/usr/bin/redis-server", "/usr/sbin/redis-server"],
    url_var: "REDIS_URL",
    scheme: "redis",
    default_port: 6379,
    ready_sign: "answer to PING",
    is_ready: answers_ping,
    args,
};

/// No persistence: a test server's data dies with it anyway.
fn args(command: &mut Command, port: u16, dir: &Path, log: &Path) {
    command
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
        .arg("--dir")
        .arg(dir)
        .arg("--logfile")
        .arg(log);
}

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

server::from_failure!(RedisHarnessError);

/// A `redis-server` started by the harness, without persistence; stopped
/// (and its directory removed) when dropped, or at the process's exit.
#[derive(Debug)]
pub struct RedisServer {
    // Shared with the process's exit, which stops one never dropped.
    process: Arc<Process>,
}

impl RedisServer {
    /// Start a server on a free port of 127.0.0.1 (`--save '' --appendonly
    /// no`), in a new temporary directory. Blocks until it answers `PING`.
    pub fn start() -> Result<RedisServer, RedisHarnessError> {
        Ok(RedisServer {
            process: Process::start_owned(&SPEC)?,
        })
    }

    /// Its URL, `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> &str {
        self.process.url()
    }

    /// Its temporary directory (the log).
    pub fn dir(&self) -> &Path {
        self.process.dir()
    }

    /// Send one command and return the reply's first line (`+OK`, `:3`,
    /// `$5`..): enough for `FLUSHALL`, `DBSIZE`, `EXISTS`.
    pub fn command(&self, args: &[&str]) -> Result<String, RedisHarnessError> {
        command(&self.process.addr(), args, Duration::from_secs(5))
    }

    /// Kill the server: from now on its port refuses connections. Its
    /// directory stays until drop.
    pub fn stop(&self) {
        self.process.kill();
    }

    /// Freeze the server (`SIGSTOP`): connections stay open and nothing
    /// answers, as with a Redis stuck in a long command or a lost network.
    pub fn pause(&self) {
        self.process.signal(libc::SIGSTOP);
    }

    /// Thaw a [`pause`](Self::pause)d server.
    pub fn resume(&self) {
        self.process.signal(libc::SIGCONT);
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.process.shut_down();
    }
}

static SHARED: Shared = Shared::new(&SPEC);

/// The URL of the shared Redis tests use (see the [module docs](self) for
/// which). Blocking: the first call may start a server.
pub fn url() -> Result<String, RedisHarnessError> {
    Ok(SHARED.url()?)
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

    /// The path [`url`] takes where no URL variable is set and nothing
    /// usable is on the usual port (here a port that accepts connections
    /// but never answers): a throwaway server, the same for later calls.
    #[test]
    fn without_a_usable_default_a_shared_throwaway_is_started() {
        let silent = std::net::TcpListener::bind(("127.0.0.1", 0)).expect("a port");
        let silent = silent.local_addr().expect("its address");
        // Leaked like the statics they stand in for; the exit hook stops
        // the server.
        let spec: &'static Spec = Box::leak(Box::new(Spec {
            url_var: "IDEM_TEST_UNSET_REDIS_URL",
            default_port: silent.port(),
            ..SPEC
        }));
        let shared: &'static Shared = Box::leak(Box::new(Shared::new(spec)));
        let url = shared.url().expect("a throwaway redis-server");
        assert_ne!(url, format!("redis://{silent}"), "not the silent port");
        let addr: SocketAddr = url.trim_start_matches("redis://").parse().expect("addr");
        assert!(answers_ping(&addr), "the throwaway answers");
        assert_eq!(shared.url().expect("again"), url, "started once");
    }
}
