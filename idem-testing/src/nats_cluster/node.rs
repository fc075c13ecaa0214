//! One `nats-server` of a [`NatsCluster`](super::NatsCluster), and the
//! launch of the three: configuration files, ports, the readiness check.

use std::io::{self, Read};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{NatsClusterError, PORT_ATTEMPTS, WAIT};

/// One `nats-server` of the cluster. Clones share the process handle, so a
/// blocking wait can run off the async worker thread.
#[derive(Debug, Clone)]
pub(super) struct Node {
    pub(super) name: String,
    port: u16,
    dir: PathBuf,
    child: Arc<Mutex<Option<Child>>>,
}

impl Node {
    fn config_path(&self) -> PathBuf {
        self.dir.join("nats-server.conf")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.join("nats-server.log")
    }

    pub(super) fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    fn child(&self) -> std::sync::MutexGuard<'_, Option<Child>> {
        self.child.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Spawns the server on its configuration and waits until it greets
    /// with JetStream enabled.
    pub(super) fn spawn(&self, binary: &Path) -> Result<(), NatsClusterError> {
        let child = Command::new(binary)
            .arg("-c")
            .arg(self.config_path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| NatsClusterError::io(format!("run {}", binary.display()), e))?;
        *self.child() = Some(child);
        let addr = SocketAddr::from(([127, 0, 0, 1], self.port));
        let started = Instant::now();
        loop {
            if has_jetstream(&addr) {
                return Ok(());
            }
            let exited = self
                .child()
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            if exited.is_some() || started.elapsed() > WAIT {
                let detail = match exited {
                    Some(status) => format!("it exited with {status}"),
                    None => format!("no JetStream greeting on {addr} after {WAIT:?}"),
                };
                self.kill();
                return Err(NatsClusterError::NodeDidNotStart {
                    node: self.name.clone(),
                    detail,
                    log: std::fs::read_to_string(self.log_path()).unwrap_or_default(),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub(super) fn is_running(&self) -> bool {
        matches!(self.child().as_mut().map(Child::try_wait), Some(Ok(None)))
    }

    /// SIGKILL by pid (`Child::kill`), and reaped.
    pub(super) fn kill(&self) {
        if let Some(mut child) = self.child().take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM by pid, then SIGKILL after `grace`.
    pub(super) fn stop(&self, grace: Duration) {
        let Some(mut child) = self.child().take() else {
            return;
        };
        if let Ok(pid) = libc::pid_t::try_from(child.id()) {
            // SAFETY: plain syscall on our own child, which is not reaped yet.
            unsafe {
                libc::kill(pid, libc::SIGTERM);
            }
        }
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if !matches!(child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// Writes the configurations and starts the three nodes; starts over on new
/// ports when one of them was taken by another process in the meantime.
pub(super) fn launch(dir: &Path, binary: &Path) -> Result<Vec<Node>, NatsClusterError> {
    for attempt in 1..=PORT_ATTEMPTS {
        let ports = free_ports(6)?;
        let nodes: Vec<Node> = (0..3)
            .map(|i| Node {
                name: format!("n{}", i + 1),
                port: ports[i],
                dir: dir.join(format!("n{}", i + 1)),
                child: Arc::new(Mutex::new(None)),
            })
            .collect();
        for (i, node) in nodes.iter().enumerate() {
            let routes: Vec<u16> = (0..3).filter(|&j| j != i).map(|j| ports[3 + j]).collect();
            write_config(node, ports[3 + i], &routes)?;
        }
        let mut result = Ok(());
        for node in &nodes {
            result = node.spawn(binary);
            if result.is_err() {
                break;
            }
        }
        match result {
            Ok(()) => return Ok(nodes),
            Err(e) => {
                nodes.iter().for_each(Node::kill);
                let taken = matches!(&e, NatsClusterError::NodeDidNotStart { log, .. }
                    if log.contains("address already in use"));
                if !taken || attempt == PORT_ATTEMPTS {
                    return Err(e);
                }
                for node in &nodes {
                    let _ = std::fs::remove_dir_all(&node.dir);
                }
            }
        }
    }
    unreachable!("the last attempt returns")
}

/// A node's configuration file: clustering JetStream needs a server name,
/// a cluster name with routes to the other nodes, and a store directory.
fn write_config(node: &Node, cluster_port: u16, routes: &[u16]) -> Result<(), NatsClusterError> {
    std::fs::create_dir_all(&node.dir)
        .map_err(|e| NatsClusterError::io(format!("create {}", node.dir.display()), e))?;
    let quoted = |path: PathBuf| format!("{:?}", path.display().to_string());
    let routes: String = routes
        .iter()
        .map(|port| format!("    \"nats-route://127.0.0.1:{port}\"\n"))
        .collect();
    let config = format!(
        "server_name: {name}\n\
         listen: \"127.0.0.1:{port}\"\n\
         log_file: {log}\n\
         jetstream {{\n  store_dir: {store}\n  max_memory_store: 64MB\n  max_file_store: 256MB\n}}\n\
         cluster {{\n  name: idem_test\n  listen: \"127.0.0.1:{cluster_port}\"\n  routes: [\n{routes}  ]\n}}\n",
        name = node.name,
        port = node.port,
        log = quoted(node.log_path()),
        store = quoted(node.dir.join("store")),
    );
    std::fs::write(node.config_path(), config)
        .map_err(|e| NatsClusterError::io(format!("write {}", node.config_path().display()), e))
}

/// `n` distinct ports of 127.0.0.1 that were free a moment ago: all bound at
/// once, so none is handed out twice.
fn free_ports(n: usize) -> Result<Vec<u16>, NatsClusterError> {
    let listeners = (0..n)
        .map(|_| TcpListener::bind(("127.0.0.1", 0)))
        .collect::<io::Result<Vec<_>>>()
        .map_err(|e| NatsClusterError::io("find free TCP ports on 127.0.0.1", e))?;
    listeners
        .iter()
        .map(|l| l.local_addr().map(|a| a.port()))
        .collect::<io::Result<_>>()
        .map_err(|e| NatsClusterError::io("find free TCP ports on 127.0.0.1", e))
}

/// Whether a server greets on `addr` with JetStream enabled (its first line
/// is `INFO {json}`). A copy of the helper in `nats.rs`, kept apart so the
/// two modules can change independently.
fn has_jetstream(addr: &SocketAddr) -> bool {
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

/// `IDEM_NATS_SERVER`, else `nats-server` on the `PATH`, else the system directories.
pub(super) fn find_binary() -> Result<PathBuf, NatsClusterError> {
    if let Some(path) = std::env::var_os("IDEM_NATS_SERVER").filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(path));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/usr/bin"].map(PathBuf::from))
        .map(|dir| dir.join("nats-server"))
        .find(|candidate| candidate.is_file())
        .ok_or_else(|| NatsClusterError::NoServerBinary {
            searched: "IDEM_NATS_SERVER, PATH, /usr/sbin, /usr/bin".into(),
        })
}
