//! One `nats-server` of a [`NatsCluster`](super::NatsCluster), and the
//! launch of the three: configuration files and ports. Finding the program,
//! starting it and waiting for its JetStream greeting are those of the
//! single test server ([`crate::server`], [`crate::nats`]).

use std::io;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{NatsClusterError, PORT_ATTEMPTS};
use crate::nats;
use crate::server::{Failure, Process, Spec};

/// The single server's program and readiness check, run from the node's
/// configuration file.
static NODE: Spec = Spec {
    args: from_config,
    ..nats::SPEC
};

/// The file in a node's directory that configures it.
const CONFIG: &str = "nats-server.conf";

/// The configuration names the ports, log and store, so that a restart
/// brings the node back as itself; the harness's port and log are those
/// written there.
fn from_config(command: &mut Command, _port: u16, dir: &Path, _log: &Path) {
    command.arg("-c").arg(dir.join(CONFIG));
}

/// One `nats-server` of the cluster. Clones share the process, so a
/// blocking wait can run off the async worker thread.
#[derive(Debug, Clone)]
pub(super) struct Node {
    pub(super) name: String,
    process: Arc<Process>,
}

impl Node {
    /// A node of this name on `port`, with its files in `dir`; not started.
    fn new(name: String, port: u16, dir: PathBuf) -> Result<Node, NatsClusterError> {
        match Process::new(&NODE, port, dir) {
            Ok(process) => Ok(Node {
                name,
                process: Arc::new(process),
            }),
            Err(failure) => Err(cluster_error(failure, &name)),
        }
    }

    fn dir(&self) -> &Path {
        self.process.dir()
    }

    pub(super) fn url(&self) -> String {
        self.process.url().to_owned()
    }

    /// Spawns the server on its configuration and waits until it greets
    /// with JetStream enabled; a node that did not start is killed.
    pub(super) fn spawn(&self) -> Result<(), NatsClusterError> {
        self.process.spawn().map_err(|failure| {
            self.kill();
            cluster_error(failure, &self.name)
        })
    }

    pub(super) fn is_running(&self) -> bool {
        self.process.is_running()
    }

    /// SIGKILL by pid (`Child::kill`), and reaped.
    pub(super) fn kill(&self) {
        self.process.kill();
    }

    /// SIGTERM by pid, then SIGKILL after `grace`.
    pub(super) fn stop(&self, grace: Duration) {
        if self.process.signal(libc::SIGTERM).is_none() {
            return;
        }
        let deadline = Instant::now() + grace;
        while self.process.is_running() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        // Reaps an exited server too.
        self.process.kill();
    }
}

/// The cluster's error for a failure of the server glue; `node` names the
/// node that was being set up or started.
fn cluster_error(failure: Failure, node: &str) -> NatsClusterError {
    match failure {
        Failure::NoBinary { searched } => NatsClusterError::NoServerBinary { searched },
        Failure::DidNotStart { detail, log } => NatsClusterError::NodeDidNotStart {
            node: node.to_owned(),
            detail,
            log,
        },
        // The cluster's error owns its io::Error; a failure just made is not
        // shared yet, so this unwraps it.
        Failure::Io { action, source } => NatsClusterError::io(
            action,
            Arc::try_unwrap(source)
                .unwrap_or_else(|shared| io::Error::new(shared.kind(), shared.to_string())),
        ),
    }
}

/// Writes the configurations and starts the three nodes; starts over on new
/// ports when one of them was taken by another process in the meantime.
pub(super) fn launch(dir: &Path) -> Result<Vec<Node>, NatsClusterError> {
    for attempt in 1..=PORT_ATTEMPTS {
        let ports = free_ports(6)?;
        let nodes = (0..3)
            .map(|i| {
                Node::new(
                    format!("n{}", i + 1),
                    ports[i],
                    dir.join(format!("n{}", i + 1)),
                )
            })
            .collect::<Result<Vec<Node>, _>>()?;
        for (i, node) in nodes.iter().enumerate() {
            let routes: Vec<u16> = (0..3).filter(|&j| j != i).map(|j| ports[3 + j]).collect();
            write_config(node, ports[3 + i], &routes)?;
        }
        let mut result = Ok(());
        for node in &nodes {
            result = node.spawn();
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
                    let _ = std::fs::remove_dir_all(node.dir());
                }
            }
        }
    }
    unreachable!("the last attempt returns")
}

/// A node's configuration file: clustering JetStream needs a server name,
/// a cluster name with routes to the other nodes, and a store directory.
fn write_config(node: &Node, cluster_port: u16, routes: &[u16]) -> Result<(), NatsClusterError> {
    let dir = node.dir();
    std::fs::create_dir_all(dir)
        .map_err(|e| NatsClusterError::io(format!("create {}", dir.display()), e))?;
    let quoted = |path: PathBuf| format!("{:?}", path.display().to_string());
    let routes: String = routes
        .iter()
        .map(|port| format!("    \"nats-route://127.0.0.1:{port}\"\n"))
        .collect();
    let config = format!(
        "server_name: {name}\n\
         listen: \"{addr}\"\n\
         log_file: {log}\n\
         jetstream {{\n  store_dir: {store}\n  max_memory_store: 64MB\n  max_file_store: 256MB\n}}\n\
         cluster {{\n  name: idem_test\n  listen: \"127.0.0.1:{cluster_port}\"\n  routes: [\n{routes}  ]\n}}\n",
        name = node.name,
        addr = node.process.addr(),
        log = quoted(node.process.log()),
        store = quoted(dir.join("store")),
    );
    let path = dir.join(CONFIG);
    std::fs::write(&path, config)
        .map_err(|e| NatsClusterError::io(format!("write {}", path.display()), e))
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
