//! A wire-level TCP proxy between the code under test and PostgreSQL, to
//! inject the faults idem's contract covers: a connection lost before a
//! statement reaches the server, an answer to `COMMIT` that never arrives
//! (the server committed), an answer that arrives late, and pooled
//! connections that all break at once.
//!
//! Faults are rules armed on the proxy: when a chunk the client sends
//! contains a pattern (SQL text: a simple query's text, or a statement's text
//! when it is prepared), the rule fires once on that connection. Matching is
//! on bytes, not on parsed messages: patterns should be distinctive SQL.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use idem_testing::proxy::{Fault, Proxy};
//! let db = idem_testing::TestDatabase::create().await?;
//! let proxy = Proxy::start(db.url()).await?;
//! // The next COMMIT reaches the server, and its answer is lost.
//! proxy.arm("COMMIT", Fault::CutAfter);
//! let url = proxy.url(); // connect the code under test here
//! # let _ = url; Ok(()) }
//! ```

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::url::{host_port, with_host_port};
use crate::HarnessError;

/// What a rule does to the connection whose client sent the pattern.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Close both sides before the chunk reaches the server: the server
    /// never sees the statement.
    CutBefore,
    /// Forward the chunk, then close both sides: the server runs the
    /// statement (a `COMMIT` commits), and its answer never arrives.
    CutAfter,
    /// Forward the chunk, and hold the server's next answer this long.
    HoldAnswer(Duration),
}

#[derive(Debug)]
struct Rule {
    pattern: Vec<u8>,
    fault: Fault,
}

#[derive(Default)]
struct Shared {
    rules: Mutex<Vec<Rule>>,
    /// New connections to cut at once, before the server sees them.
    refuse: AtomicUsize,
    accepted: AtomicUsize,
    fired: AtomicUsize,
}

/// A running proxy; stopped when dropped.
pub struct Proxy {
    url: String,
    shared: Arc<Shared>,
    /// Bumped to close every connection open now.
    generation: watch::Sender<u64>,
    accept_task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Listen on a free loopback port, forwarding to the server `url` names.
    pub async fn start(url: &str) -> Result<Proxy, HarnessError> {
        let upstream = host_port(url)?;
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| HarnessError::Proxy(e.to_string()))?;
        let local = listener
            .local_addr()
            .map_err(|e| HarnessError::Proxy(e.to_string()))?;
        let shared = Arc::new(Shared::default());
        let (generation, watcher) = watch::channel(0);
        let accept_task = tokio::spawn(accept(listener, upstream, Arc::clone(&shared), watcher));
        Ok(Proxy {
            url: with_host_port(url, &local.to_string())?,
            shared,
            generation,
            accept_task,
        })
    }

    /// The URL that reaches the server through the proxy.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Fire `fault` once, on the first connection whose client sends `pattern`.
    pub fn arm(&self, pattern: &str, fault: Fault) {
        self.shared.rules.lock().unwrap().push(Rule {
            pattern: pattern.as_bytes().to_vec(),
            fault,
        });
    }

    /// Close the next `n` connections as soon as they are accepted.
    pub fn refuse_next(&self, n: usize) {
        self.shared.refuse.store(n, Ordering::SeqCst);
    }

    /// Close every connection open now (pooled connections go stale).
    pub fn cut_all(&self) {
        self.generation.send_modify(|g| *g += 1);
    }

    /// Rules that fired so far.
    pub fn fired(&self) -> usize {
        self.shared.fired.load(Ordering::SeqCst)
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> usize {
        self.shared.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept_task.abort();
        self.cut_all();
    }
}

async fn accept(
    listener: TcpListener,
    upstream: String,
    shared: Arc<Shared>,
    generation: watch::Receiver<u64>,
) {
    while let Ok((client, _)) = listener.accept().await {
        shared.accepted.fetch_add(1, Ordering::SeqCst);
        let refused = shared
            .refuse
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if refused {
            drop(client);
            continue;
        }
        let (upstream, shared, generation) =
            (upstream.clone(), Arc::clone(&shared), generation.clone());
        tokio::spawn(async move {
            if let Ok(server) = TcpStream::connect(&upstream).await {
                relay(client, server, shared, generation).await;
            }
        });
    }
}

/// Pump bytes both ways until either side closes, a fault cuts the
/// connection, or the proxy's generation moves on.
async fn relay(
    client: TcpStream,
    server: TcpStream,
    shared: Arc<Shared>,
    mut generation: watch::Receiver<u64>,
) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut client_rx, mut client_tx) = client.into_split();
    let (mut server_rx, mut server_tx) = server.into_split();
    // How long to hold the server's next answer, set by the client pump.
    let hold = Mutex::new(None::<Duration>);
    let upstream = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match client_rx.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let fault = take_rule(&shared, &buf[..n]);
            if fault == Some(Fault::CutBefore) {
                return;
            }
            if server_tx.write_all(&buf[..n]).await.is_err() {
                return;
            }
            match fault {
                Some(Fault::CutAfter) => {
                    // Let the bytes leave before the sockets close.
                    let _ = server_tx.flush().await;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    return;
                }
                Some(Fault::HoldAnswer(d)) => {
                    *hold.lock().unwrap() = Some(d);
                }
                _ => {}
            }
        }
    };
    let downstream = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match server_rx.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let held = hold.lock().unwrap().take();
            if let Some(d) = held {
                tokio::time::sleep(d).await;
            }
            if client_tx.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    tokio::select! {
        () = upstream => {}
        () = downstream => {}
        _ = generation.changed() => {}
    }
}

/// The fault of the first armed rule whose pattern `chunk` contains, removed.
fn take_rule(shared: &Shared, chunk: &[u8]) -> Option<Fault> {
    let mut rules = shared.rules.lock().unwrap();
    let index = rules
        .iter()
        .position(|rule| chunk.windows(rule.pattern.len()).any(|w| w == rule.pattern))?;
    shared.fired.fetch_add(1, Ordering::SeqCst);
    Some(rules.remove(index).fault)
}
