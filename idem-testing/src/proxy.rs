//! A wire-level TCP proxy between the code under test and PostgreSQL, to
//! inject the faults idem's contract covers: a connection lost before a
//! statement reaches the server, an answer to `COMMIT` that never arrives
//! (the server committed), an answer that arrives late, and pooled
//! connections that all break at once.
//!
//! Faults are rules armed on the proxy: when a chunk the client sends runs a
//! statement whose SQL contains a pattern (a simple query, or a `Bind` of a
//! prepared statement, matched by the text it was prepared with), the rule
//! fires once on that connection. A
//! `Parse` alone runs nothing and fires nothing. Patterns should be
//! distinctive SQL; a text ends with its NUL, so `"COMMIT\0"` is `COMMIT`
//! alone.
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

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::url::{host_port, with_host_port};
use crate::wire::Frontend;
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
    /// Hold the chunk this long before it reaches the server (a `COMMIT`
    /// held here keeps its transaction, and its row locks, open meanwhile).
    HoldRequest(Duration),
}

#[derive(Debug)]
struct Rule {
    pattern: Vec<u8>,
    fault: Fault,
    /// Matches to let pass before the rule fires.
    skip: usize,
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
        self.arm_nth(pattern, 1, fault);
    }

    /// Fire `fault` once, at the `n`-th chunk (1-based) any client sends
    /// that runs a statement containing `pattern`.
    pub fn arm_nth(&self, pattern: &str, n: usize, fault: Fault) {
        self.shared.rules.lock().unwrap().push(Rule {
            pattern: pattern.as_bytes().to_vec(),
            fault,
            skip: n.saturating_sub(1),
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
    // Only a cut from now on ends this connection.
    generation.borrow_and_update();
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut client_rx, mut client_tx) = client.into_split();
    let (mut server_rx, mut server_tx) = server.into_split();
    // How long to hold the server's next answer, set by the client pump.
    let hold = Mutex::new(None::<Duration>);
    // Set before a statement is forwarded whose answer must never arrive.
    let cut = AtomicBool::new(false);
    let upstream = async {
        let mut wire = Frontend::default();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match client_rx.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if std::env::var_os("IDEM_PROXY_TRACE").is_some() {
                eprintln!(
                    "proxy: client sent {:?}",
                    String::from_utf8_lossy(&buf[..n])
                );
            }
            let fault = take_rule(&shared, &wire.runs(&buf[..n]));
            match fault {
                Some(Fault::CutBefore) => return,
                Some(Fault::HoldRequest(d)) => tokio::time::sleep(d).await,
                Some(Fault::CutAfter) => cut.store(true, Ordering::SeqCst),
                _ => {}
            }
            if server_tx.write_all(&buf[..n]).await.is_err() {
                return;
            }
            match fault {
                Some(Fault::CutAfter) => {
                    // The server reads the statement, then the end of the
                    // stream (never a reset): it runs it to the end.
                    let _ = server_tx.flush().await;
                    let _ = server_tx.shutdown().await;
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
            if cut.load(Ordering::SeqCst) {
                continue;
            }
            let held = hold.lock().unwrap().take();
            if let Some(d) = held {
                tokio::time::sleep(d).await;
            }
            if client_tx.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    tokio::pin!(downstream);
    tokio::select! {
        () = upstream => {}
        () = &mut downstream => return,
        _ = generation.changed() => return,
    }
    if cut.load(Ordering::SeqCst) {
        // The client's side closes now; the server's answers are read and
        // dropped until it closes its side, so it never meets a reset.
        let _ = tokio::time::timeout(Duration::from_secs(10), downstream).await;
    }
}

/// The fault of the first armed rule whose pattern a statement that a
/// chunk `runs` contains, and whose matches to skip are used up, removed.
fn take_rule(shared: &Shared, runs: &[Vec<u8>]) -> Option<Fault> {
    if runs.is_empty() {
        return None;
    }
    let mut rules = shared.rules.lock().unwrap();
    let mut fire = None;
    for (index, rule) in rules.iter_mut().enumerate() {
        let contains = |sql: &Vec<u8>| sql.windows(rule.pattern.len()).any(|w| w == rule.pattern);
        if !runs.iter().any(contains) {
            continue;
        }
        if rule.skip == 0 {
            fire = Some(index);
            break;
        }
        rule.skip -= 1;
    }
    let index = fire?;
    shared.fired.fetch_add(1, Ordering::SeqCst);
    Some(rules.remove(index).fault)
}
