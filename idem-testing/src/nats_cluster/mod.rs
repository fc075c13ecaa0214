//! A three-node JetStream cluster for failover tests: `nats-server -js`
//! processes on loopback, routed to each other, each with its own store
//! directory, so that an R3 stream survives the SIGKILL of its leader.
//!
//! The binary is found as for the single test server (`IDEM_NATS_SERVER`,
//! else `nats-server` on the `PATH`, else `/usr/sbin` or `/usr/bin`). The
//! servers are called `n1`, `n2` and `n3`: the names a stream's cluster
//! info uses for its leader and replicas. A killed node is restarted on the
//! same ports with the same store directory, so it rejoins as itself.
//!
//! Every wait is bounded and fails with [`NatsClusterError::Wait`], naming
//! what was awaited. Dropping the cluster, or the process's exit if the
//! cluster is never dropped (kept in a `static`), stops every server by
//! its pid (SIGTERM, then SIGKILL) and deletes the directory.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use idem_testing::nats_cluster::NatsCluster;
//!
//! let cluster = NatsCluster::start().await?;
//! let js = async_nats::jetstream::new(async_nats::connect(cluster.urls()).await?);
//! cluster.create_r3_stream(&js, "ORDERS", &["orders.>"]).await?;
//! let killed = cluster.kill_leader("ORDERS").await?;
//! let leader = cluster.wait_stream_leader("ORDERS", Duration::from_secs(30)).await?;
//! assert_ne!(leader, killed);
//! cluster.restart(&killed).await?;
//! cluster.wait_stream_current("ORDERS", Duration::from_secs(30)).await?;
//! # Ok(()) }
//! ```

mod node;

use std::fmt::Write as _;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;

use crate::exit::stop_at_exit;
use crate::scratch::random_u32;
use node::{launch, Node};

/// The bound of every wait that the caller does not bound.
const WAIT: Duration = Duration::from_secs(30);

/// How long a server gets to exit on SIGTERM when the cluster is dropped.
const DROP_GRACE: Duration = Duration::from_secs(5);

/// How many times to start over when another process took a chosen port.
const PORT_ATTEMPTS: usize = 3;

/// How long one JetStream API request of the harness may take: short, so a
/// request sent to a leader that just died does not eat the whole wait.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// Why a [`NatsCluster`] could not be started or could not do what a test
/// asked of it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NatsClusterError {
    /// No `nats-server` binary was found.
    #[error(
        "no nats-server binary found (searched: {searched}); install nats-server \
         or set IDEM_NATS_SERVER to it"
    )]
    NoServerBinary {
        /// Where the binary was looked for.
        searched: String,
    },
    /// A node did not come up (or exited).
    #[error("nats-server {node} did not start: {detail}\n--- its log ---\n{log}")]
    NodeDidNotStart {
        /// The server name of the node.
        node: String,
        /// What went wrong.
        detail: String,
        /// The node's log.
        log: String,
    },
    /// A file or process operation failed.
    #[error("{action}: {source}")]
    Io {
        /// What was being attempted.
        action: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The client failed talking to the cluster.
    #[error("NATS client: {0}")]
    Client(String),
    /// A bounded wait ran out.
    #[error("timed out after {after:?} waiting for {awaited}; last seen: {last}")]
    Wait {
        /// What was awaited.
        awaited: String,
        /// How long the harness waited.
        after: Duration,
        /// The last observation, to tell a slow machine from a wedged cluster.
        last: String,
    },
    /// No node of the cluster has this server name.
    #[error("no node named {0:?} (the nodes are n1, n2 and n3)")]
    UnknownNode(String),
}

impl NatsClusterError {
    fn io(action: impl Into<String>, source: io::Error) -> Self {
        NatsClusterError::Io {
            action: action.into(),
            source,
        }
    }

    fn client(err: impl std::fmt::Display) -> Self {
        NatsClusterError::Client(err.to_string())
    }
}

/// Three `nats-server -js` in one cluster on loopback; see the
/// [module docs](self).
#[derive(Debug)]
pub struct NatsCluster {
    dir: PathBuf,
    nodes: Vec<Node>,
    /// What stopping the cluster needs, shared with the process's exit: a
    /// cluster never dropped (kept in a `static`) is stopped then.
    teardown: Arc<Teardown>,
    /// The harness's own client, for stream info.
    admin: jetstream::Context,
}

impl NatsCluster {
    /// Starts the three servers and returns once each accepts connections
    /// and the cluster answers JetStream requests (its meta leader is
    /// elected). Takes a few seconds. Must be called inside a Tokio runtime.
    pub async fn start() -> Result<NatsCluster, NatsClusterError> {
        let dir = std::env::temp_dir().join(format!(
            "idem-nats-cluster-{}-{:08x}",
            std::process::id(),
            random_u32()
        ));
        std::fs::create_dir_all(&dir)
            .map_err(|e| NatsClusterError::io(format!("create {}", dir.display()), e))?;
        let launch_dir = dir.clone();
        let launched = blocking(move || launch(&launch_dir)).await;
        let nodes = match launched {
            Ok(nodes) => nodes,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e);
            }
        };
        let urls: Vec<String> = nodes.iter().map(Node::url).collect();
        let connected = async {
            let client = async_nats::ConnectOptions::new()
                .connection_timeout(REQUEST_TIMEOUT)
                // Bounds each JetStream API request (the context's own timeout bounds only acks).
                .request_timeout(Some(REQUEST_TIMEOUT))
                .connect(urls)
                .await
                .map_err(NatsClusterError::client)?;
            Ok::<_, NatsClusterError>(jetstream::new(client))
        }
        .await;
        let admin = match connected {
            Ok(admin) => admin,
            Err(e) => {
                nodes.iter().for_each(Node::kill);
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e);
            }
        };
        let teardown = Arc::new(Teardown {
            dir: dir.clone(),
            nodes: nodes.clone(),
        });
        stop_at_exit(&teardown, Teardown::run);
        let cluster = NatsCluster {
            dir,
            nodes,
            teardown,
            admin,
        };
        // JetStream answers once the servers have elected a meta leader. Asked
        // raw: async-nats 0.46 cannot parse nats-server 2.9's account info.
        let client = cluster.admin.client();
        poll("the JetStream meta leader".into(), WAIT, || async {
            let reply = client
                .request("$JS.API.INFO", "".into())
                .await
                .map_err(|e| e.to_string())?;
            let reply = String::from_utf8_lossy(&reply.payload).into_owned();
            if reply.contains("account_info_response") && !reply.contains("\"error\"") {
                Ok(Some(()))
            } else {
                Err(reply)
            }
        })
        .await?;
        Ok(cluster)
    }

    /// The client URL of each node, `nats://127.0.0.1:PORT`, for
    /// `async_nats::connect(cluster.urls())`: a client connected to all
    /// of them moves to another when its server dies.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(Node::url).collect()
    }

    /// The client URLs, comma-separated, as the `nats` CLI and most client
    /// configurations take them (`async_nats::connect` wants [`urls`](Self::urls)).
    pub fn url(&self) -> String {
        self.urls().join(",")
    }

    /// The server names of the nodes: `n1`, `n2`, `n3`.
    pub fn node_names(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.name.clone()).collect()
    }

    /// The client URL of one node.
    pub fn node_url(&self, node: &str) -> Result<String, NatsClusterError> {
        self.node(node).map(Node::url)
    }

    /// Whether the node runs (it does, unless a test killed it).
    pub fn is_running(&self, node: &str) -> Result<bool, NatsClusterError> {
        self.node(node).map(Node::is_running)
    }

    /// The temporary directory: a directory per node with its
    /// configuration, its log and its store.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn node(&self, name: &str) -> Result<&Node, NatsClusterError> {
        self.nodes
            .iter()
            .find(|n| n.name == name)
            .ok_or_else(|| NatsClusterError::UnknownNode(name.to_owned()))
    }

    /// Creates a file-stored stream with three replicas, retrying while the
    /// cluster does not know all its peers yet, and returns once it has a
    /// leader and both followers are current.
    pub async fn create_r3_stream(
        &self,
        js: &jetstream::Context,
        name: &str,
        subjects: &[&str],
    ) -> Result<jetstream::stream::Stream, NatsClusterError> {
        let config = jetstream::stream::Config {
            name: name.to_owned(),
            subjects: subjects.iter().map(|s| (*s).to_owned()).collect(),
            num_replicas: 3,
            storage: jetstream::stream::StorageType::File,
            ..Default::default()
        };
        // Creating is idempotent for an identical configuration, so a retry
        // after a timed-out request that did create the stream succeeds.
        let stream = poll(
            format!("the creation of the R3 stream {name}"),
            WAIT,
            || async {
                js.create_stream(config.clone())
                    .await
                    .map(Some)
                    .map_err(|e| e.to_string())
            },
        )
        .await?;
        self.wait_stream_current(name, WAIT).await?;
        Ok(stream)
    }

    /// The server name of the stream's leader, from the stream info as a
    /// client sees it (`cluster.leader`); `None` while it has none.
    pub async fn stream_leader(&self, stream: &str) -> Result<Option<String>, NatsClusterError> {
        let info = self
            .stream_info(stream)
            .await
            .map_err(NatsClusterError::Client)?;
        Ok(info.cluster.and_then(|c| c.leader))
    }

    async fn stream_info(&self, stream: &str) -> Result<jetstream::stream::Info, String> {
        let stream = self
            .admin
            .get_stream(stream)
            .await
            .map_err(|e| e.to_string())?;
        Ok(stream.cached_info().clone())
    }

    /// Waits until the stream has a leader that is a running node, and
    /// returns its server name.
    pub async fn wait_stream_leader(
        &self,
        stream: &str,
        timeout: Duration,
    ) -> Result<String, NatsClusterError> {
        poll(format!("a leader of stream {stream}"), timeout, || async {
            let info = self.stream_info(stream).await?;
            match info.cluster.and_then(|c| c.leader) {
                Some(leader) if self.running(&leader) => Ok(Some(leader)),
                other => Err(format!("leader {other:?}")),
            }
        })
        .await
    }

    /// Waits until every node runs, the stream has a leader and both other
    /// nodes are current, online replicas (a restarted node has caught
    /// up); returns the leader's server name.
    pub async fn wait_stream_current(
        &self,
        stream: &str,
        timeout: Duration,
    ) -> Result<String, NatsClusterError> {
        poll(
            format!("all replicas of stream {stream} current"),
            timeout,
            || async {
                let stopped: Vec<&str> = self
                    .nodes
                    .iter()
                    .filter(|n| !n.is_running())
                    .map(|n| n.name.as_str())
                    .collect();
                if !stopped.is_empty() {
                    return Err(format!("not running: {stopped:?}"));
                }
                let cluster = self.stream_info(stream).await?.cluster.unwrap_or_default();
                let current = cluster
                    .replicas
                    .iter()
                    .filter(|r| r.current && !r.offline)
                    .count();
                match cluster.leader {
                    Some(leader) if current == self.nodes.len() - 1 => Ok(Some(leader)),
                    leader => {
                        let mut seen = format!("leader {leader:?}, replicas");
                        for r in &cluster.replicas {
                            let _ = write!(
                                seen,
                                " {}(current={}, offline={}, lag={:?})",
                                r.name, r.current, r.offline, r.lag
                            );
                        }
                        Err(seen)
                    }
                }
            },
        )
        .await
    }

    fn running(&self, name: &str) -> bool {
        self.node(name).is_ok_and(Node::is_running)
    }

    /// SIGKILLs the server that leads `stream` now (waiting for it to have
    /// a leader first) and returns its server name.
    pub async fn kill_leader(&self, stream: &str) -> Result<String, NatsClusterError> {
        let leader = self.wait_stream_leader(stream, WAIT).await?;
        self.kill(&leader)?;
        Ok(leader)
    }

    /// SIGKILLs one node by its pid, and reaps it.
    pub fn kill(&self, node: &str) -> Result<(), NatsClusterError> {
        self.node(node)?.kill();
        Ok(())
    }

    /// Starts a stopped node again on the same ports with the same store
    /// directory, so it rejoins the cluster as itself, and returns once it
    /// accepts connections. (That its streams caught up is
    /// [`wait_stream_current`](Self::wait_stream_current).)
    pub async fn restart(&self, node: &str) -> Result<(), NatsClusterError> {
        let node = self.node(node)?.clone();
        if node.is_running() {
            return Ok(());
        }
        blocking(move || node.spawn()).await
    }
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        self.teardown.run();
    }
}

/// The nodes (clones share each one's process) and the directory.
#[derive(Debug)]
struct Teardown {
    dir: PathBuf,
    nodes: Vec<Node>,
}

impl Teardown {
    /// Stops every node and removes the directory; again, it does nothing.
    fn run(&self) {
        for node in &self.nodes {
            node.stop(DROP_GRACE);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs `f` on the blocking pool: it spawns processes and waits for them.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, NatsClusterError> + Send + 'static,
) -> Result<T, NatsClusterError> {
    crate::waiting::blocking(f).await
}

/// Calls `probe` until it returns `Ok(Some(_))` or `timeout` runs out; an
/// `Err` or `Ok(None)` is a "not yet", and the last `Err` is reported.
async fn poll<T, F, Fut>(
    awaited: String,
    timeout: Duration,
    probe: F,
) -> Result<T, NatsClusterError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Option<T>, String>>,
{
    crate::waiting::poll(timeout, probe)
        .await
        .map_err(|last| NatsClusterError::Wait {
            awaited,
            after: timeout,
            last,
        })
}
