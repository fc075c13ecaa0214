//! A NATS server with JetStream for tests, and uniquely named streams on it.
//!
//! # Which server
//!
//! 1. If `NATS_URL` is set (and not empty), it is the URL of a running
//!    server with JetStream enabled, e.g. `nats://127.0.0.1:4222`.
//! 2. Otherwise, if a server answers on `127.0.0.1:4222` and its greeting
//!    says JetStream is enabled, that one.
//! 3. Otherwise the first use in a process starts `nats-server -js` (from
//!    `IDEM_NATS_SERVER`, else `nats-server` on the `PATH`, else
//!    `/usr/sbin/nats-server` or `/usr/bin/nats-server`) on a free loopback
//!    port with a temporary store directory. It is stopped and its directory
//!    removed when the process exits.
//!
//! Tests share the server, so every test creates streams and consumers of
//! its own ([`TestStream::create`]) under unique names.
//!
//! ```no_run
//! # async fn demo() -> Result<(), idem_testing::nats::NatsHarnessError> {
//! let js = idem_testing::nats::jetstream().await?;
//! let stream = idem_testing::nats::TestStream::create(&js, "orders").await?;
//! js.publish(stream.subject().to_owned(), "hello".into()).await.expect("published");
//! # Ok(()) }
//! ```

use std::io::{self, Read};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;

use crate::server::{self, unique_suffix, Process, Shared, Spec};

/// `nats-server -js` alone; a [cluster](crate::nats_cluster) node is the
/// same program, found and awaited alike, run from a configuration file.
pub(crate) static SPEC: Spec = Spec {
    program: "nats-server",
    program_var: "IDEM_NATS_SERVER",
    installed: &["/usr/sbin/nats-server", "/usr/bin/nats-server"],
    url_var: "NATS_URL",
    scheme: "nats",
    default_port: 4222,
    ready_sign: "JetStream greeting",
    is_ready: has_jetstream,
    args,
};

/// JetStream on, storing under the server's directory, where a restart
/// finds its file-stored streams again.
fn args(command: &mut Command, port: u16, dir: &Path, log: &Path) {
    command
        .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"])
        .arg(dir.join("store"))
        .arg("-l")
        .arg(log);
}

/// Why the harness could not provide a NATS server or a stream.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum NatsHarnessError {
    /// No `NATS_URL`, nothing with JetStream on 127.0.0.1:4222, and no
    /// `nats-server` binary.
    #[error(
        "no NATS server with JetStream: NATS_URL is unset, nothing with JetStream answers on \
         127.0.0.1:4222, and no nats-server binary was found (searched: {searched}). Install \
         nats-server, set IDEM_NATS_SERVER to it, or set NATS_URL"
    )]
    NoServerBinary {
        /// Where the binary was looked for.
        searched: String,
    },
    /// The started server did not accept connections in time.
    #[error("nats-server did not start: {detail}\n--- server log ---\n{log}")]
    ServerDidNotStart {
        /// What went wrong.
        detail: String,
        /// The server's log.
        log: String,
    },
    /// A file or process operation failed.
    #[error("{action}: {source}")]
    Io {
        /// What was being attempted.
        action: String,
        /// The underlying error.
        #[source]
        source: Arc<io::Error>,
    },
    /// The client failed talking to the server.
    #[error("NATS client: {0}")]
    Client(String),
}

impl NatsHarnessError {
    fn client(err: impl std::fmt::Display) -> Self {
        NatsHarnessError::Client(err.to_string())
    }
}

server::from_failure!(NatsHarnessError);

/// A `nats-server -js` started by the harness; stopped (and its store
/// directory removed) when dropped, or at the process's exit.
///
/// A test that needs an outage [`kill`](NatsServer::kill)s it and
/// [`restart`](NatsServer::restart)s it on the same port with the same store
/// directory, so clients reconnect to it and file-stored streams survive.
#[derive(Debug)]
pub struct NatsServer {
    // Shared with the process's exit, which stops one never dropped.
    process: Arc<Process>,
}

impl NatsServer {
    /// Start a server with JetStream on a free port of 127.0.0.1, storing
    /// in a new temporary directory. Blocks until it accepts connections.
    pub fn start() -> Result<NatsServer, NatsHarnessError> {
        Ok(NatsServer {
            process: Process::start_owned(&SPEC)?,
        })
    }

    /// Kill the server (SIGKILL: a crash, not a shutdown), keeping its store
    /// directory. Its clients see the connection drop and try to reconnect.
    pub fn kill(&self) {
        self.process.kill();
    }

    /// Freeze the server (SIGSTOP): its connections stay open but nothing
    /// is answered, as with a server stuck or cut off by the network; what
    /// clients send meanwhile waits in its sockets and is read on
    /// [`thaw`](NatsServer::thaw).
    pub fn freeze(&self) {
        let Some(pid) = self.process.signal(libc::SIGSTOP) else {
            return;
        };
        // The signal is delivered asynchronously: wait until every thread
        // is stopped, so that nothing is answered after this returns.
        let started = Instant::now();
        while !all_threads_stopped(pid) && started.elapsed() < Duration::from_secs(2) {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Let a frozen server run again (SIGCONT).
    pub fn thaw(&self) {
        self.process.signal(libc::SIGCONT);
    }

    /// Start the server again on the same port with the same store directory
    /// (killing it first if it runs). Blocks until it accepts connections.
    pub fn restart(&self) -> Result<(), NatsHarnessError> {
        self.process.kill();
        Ok(self.process.spawn()?)
    }

    /// Its client URL, `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> &str {
        self.process.url()
    }

    /// Its temporary directory (store and log).
    pub fn dir(&self) -> &Path {
        self.process.dir()
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.process.shut_down();
    }
}

static SHARED: Shared = Shared::new(&SPEC);

/// The URL of the NATS server tests use (see the [module docs](self) for
/// which). Blocking: the first call may start a server.
pub fn url() -> Result<String, NatsHarnessError> {
    Ok(SHARED.url()?)
}

/// A client connected to [`url`], as a JetStream context.
pub async fn jetstream() -> Result<jetstream::Context, NatsHarnessError> {
    let url = tokio::task::spawn_blocking(url)
        .await
        .map_err(NatsHarnessError::client)??;
    let client = async_nats::connect(url)
        .await
        .map_err(NatsHarnessError::client)?;
    Ok(jetstream::new(client))
}

/// Whether a server greets on `addr` with JetStream enabled: the first line
/// a NATS server sends is `INFO {json}`, whose `jetstream` field says so.
pub(crate) fn has_jetstream(addr: &SocketAddr) -> bool {
    let Ok(mut socket) = TcpStream::connect_timeout(addr, Duration::from_millis(300)) else {
        return false;
    };
    let _ = socket.set_read_timeout(Some(Duration::from_secs(1)));
    let mut greeting = Vec::new();
    let mut buf = [0_u8; 1024];
    while !greeting.contains(&b'\n') && greeting.len() < 16 * 1024 {
        match socket.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => greeting.extend_from_slice(&buf[..n]),
        }
    }
    let line = String::from_utf8_lossy(&greeting);
    line.starts_with("INFO ") && line.replace(' ', "").contains("\"jetstream\":true")
}

/// Whether every thread of `pid` is stopped (state `T` in
/// `/proc/PID/task/TID/stat`, the field after the parenthesised name).
fn all_threads_stopped(pid: libc::pid_t) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|task| {
        std::fs::read_to_string(task.path().join("stat"))
            .ok()
            .and_then(|stat| {
                let (_, after) = stat.rsplit_once(')')?;
                after.trim_start().chars().next()
            })
            .is_some_and(|state| state == 'T' || state == 't')
    })
}

/// A stream of a test's own: a unique name and one unique subject. Memory
/// storage, so a shared server does not fill a disk; deleted by
/// [`TestStream::delete`] (a left-over one goes with the server).
#[derive(Debug, Clone)]
pub struct TestStream {
    name: String,
    subject: String,
    stream: jetstream::stream::Stream,
}

impl TestStream {
    /// Create a stream named `{LABEL}_{unique}` with the subject
    /// `{label}.{unique}` (the label lower- and upper-cased as given).
    pub async fn create(
        js: &jetstream::Context,
        label: &str,
    ) -> Result<TestStream, NatsHarnessError> {
        let suffix = unique_suffix();
        let name = format!("{}_{suffix}", label.to_uppercase());
        let subject = format!("{}.{suffix}", label.to_lowercase());
        let stream = js
            .create_stream(jetstream::stream::Config {
                name: name.clone(),
                subjects: vec![subject.clone()],
                storage: jetstream::stream::StorageType::Memory,
                ..Default::default()
            })
            .await
            .map_err(NatsHarnessError::client)?;
        Ok(TestStream {
            name,
            subject,
            stream,
        })
    }

    /// The stream's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The one subject it captures.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// The client's handle on it (to create consumers, read its info).
    pub fn stream(&self) -> &jetstream::stream::Stream {
        &self.stream
    }

    /// Delete the stream and its consumers.
    pub async fn delete(self, js: &jetstream::Context) -> Result<(), NatsHarnessError> {
        js.delete_stream(&self.name)
            .await
            .map(|_| ())
            .map_err(NatsHarnessError::client)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The path taken where no server runs: start one, see it greet with
    /// JetStream, freeze and thaw it, kill it and restart it on its port,
    /// stop it.
    #[test]
    fn starts_a_server_with_jetstream_and_stops_it() {
        let server = NatsServer::start().expect("nats-server starts");
        let addr: SocketAddr = server
            .url()
            .trim_start_matches("nats://")
            .parse()
            .expect("addr");
        assert!(has_jetstream(&addr));
        server.freeze();
        assert!(!has_jetstream(&addr), "frozen: no greeting");
        server.thaw();
        assert!(has_jetstream(&addr), "thawed");
        server.kill();
        assert!(!has_jetstream(&addr), "killed");
        assert!(server.dir().join("store").exists(), "its store is kept");
        server.restart().expect("restarts on the same port");
        assert!(has_jetstream(&addr), "back");
        let dir = server.dir().to_owned();
        drop(server);
        assert!(!dir.exists(), "store directory removed");
        assert!(!has_jetstream(&addr), "stopped");
    }
}
