//! The load: every logical request is sent to two processes at once with
//! the same `Idempotency-Key` (a client that timed out and retried through
//! another instance, or a load balancer that sent it twice), a share of
//! them to the hot account.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::Request;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;

use crate::service::{Receipt, Stats};

/// One round: `requests` logical requests over `ports`.
#[derive(Debug, Clone)]
pub struct Round {
    /// Prefix of this round's keys, so no two rounds share one.
    pub label: String,
    /// The processes to send to: the two copies of request `i` go to
    /// `ports[i % n]` and `ports[(i + 1) % n]` (the same process, over two
    /// connections, when there is one).
    pub ports: Vec<u16>,
    /// Logical requests in the round.
    pub requests: usize,
    /// Logical requests in flight at once.
    pub concurrency: usize,
    /// Percent of requests that go to the hot account.
    pub hot_percent: usize,
}

/// What a round saw from the client's side.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Wall time of the round.
    pub elapsed: Duration,
    /// Keys at least one of whose two sends was answered 2xx.
    pub acknowledged: Vec<String>,
    /// Sends answered with anything else, or not answered.
    pub failed: usize,
    /// Keys whose two 2xx answers carried different effects.
    pub disagreeing: usize,
    /// The first few failures, for the report.
    pub failures: Vec<String>,
}

impl Outcome {
    /// Logical requests per second.
    pub fn throughput(&self, requests: usize) -> f64 {
        requests as f64 / self.elapsed.as_secs_f64()
    }
}

/// Run `round` to the end.
pub async fn run(round: &Round) -> Outcome {
    let next = Arc::new(AtomicUsize::new(0));
    let outcome = Arc::new(Mutex::new(Outcome::default()));
    let started = Instant::now();
    let workers: Vec<_> = (0..round.concurrency)
        .map(|_| {
            let (round, next, outcome) = (round.clone(), Arc::clone(&next), Arc::clone(&outcome));
            tokio::spawn(async move {
                // Two keep-alive connections to each process: one per copy.
                let mut conns: Vec<[Option<Conn>; 2]> =
                    round.ports.iter().map(|_| [None, None]).collect();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= round.requests {
                        return;
                    }
                    one_request(&round, i, &mut conns, &outcome).await;
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.expect("a load worker panicked");
    }
    let mut outcome = std::mem::take(&mut *outcome.lock().unwrap());
    outcome.elapsed = started.elapsed();
    outcome
}

async fn one_request(
    round: &Round,
    i: usize,
    conns: &mut [[Option<Conn>; 2]],
    outcome: &Mutex<Outcome>,
) {
    let key = format!("{}-{i}", round.label);
    let path = if i % 100 < round.hot_percent {
        "/hot"
    } else {
        "/pay"
    };
    let body = format!("{{\"amount\":{}}}", 1 + i % 7);
    let n = round.ports.len();
    let (a, b) = (i % n, (i + 1) % n);
    let (first, second) = if a == b {
        let [x, y] = &mut conns[a];
        (x, y)
    } else {
        let (low, high) = conns.split_at_mut(a.max(b));
        let (x, y) = (&mut low[a.min(b)][0], &mut high[0][1]);
        if a < b {
            (x, y)
        } else {
            (y, x)
        }
    };
    let (one, two) = tokio::join!(
        send(first, round.ports[a], path, &key, &body),
        send(second, round.ports[b], path, &key, &body)
    );
    let mut outcome = outcome.lock().unwrap();
    let mut receipts = Vec::new();
    for answer in [one, two] {
        match answer {
            Ok(receipt) => receipts.push(receipt),
            Err(failure) => {
                outcome.failed += 1;
                if outcome.failures.len() < 5 {
                    outcome.failures.push(format!("{key} {path}: {failure}"));
                }
            }
        }
    }
    if let [x, y] = receipts.as_slice() {
        if x.effect != y.effect {
            outcome.disagreeing += 1;
        }
    }
    if !receipts.is_empty() {
        outcome.acknowledged.push(key);
    }
}

/// A keep-alive HTTP/1.1 connection to one process.
struct Conn {
    sender: SendRequest<Full<Bytes>>,
}

impl Conn {
    async fn open(port: u16) -> Result<Conn, String> {
        let stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let _ = stream.set_nodelay(true);
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        tokio::spawn(connection);
        Ok(Conn { sender })
    }
}

/// One send; a 2xx answer's receipt, or why there is none. A connection
/// that broke is opened again for the next send.
async fn send(
    conn: &mut Option<Conn>,
    port: u16,
    path: &str,
    key: &str,
    body: &str,
) -> Result<Receipt, String> {
    if conn.is_none() {
        *conn = Some(Conn::open(port).await?);
    }
    let sender = &mut conn.as_mut().expect("opened above").sender;
    let request = Request::post(path)
        .header("host", format!("127.0.0.1:{port}"))
        .header("content-type", "application/json")
        .header("idempotency-key", format!("\"{key}\""))
        .body(Full::new(Bytes::from(body.to_owned())))
        .map_err(|e| e.to_string())?;
    let answered = async {
        sender.ready().await?;
        let response = sender.send_request(request).await?;
        let status = response.status();
        let bytes = response.into_body().collect().await?.to_bytes();
        Ok::<_, hyper::Error>((status, bytes))
    }
    .await;
    let (status, bytes) = match answered {
        Ok(answer) => answer,
        Err(e) => {
            *conn = None;
            return Err(format!("no answer: {e}"));
        }
    };
    if !status.is_success() {
        return Err(format!("{status}: {}", String::from_utf8_lossy(&bytes)));
    }
    serde_json::from_slice(&bytes).map_err(|e| format!("{status}, not a receipt: {e}"))
}

/// `GET /stats` of every process, summed.
pub async fn stats(ports: &[u16]) -> Result<Stats, String> {
    let mut total = Stats::default();
    for &port in ports {
        let mut conn = Conn::open(port).await?;
        let request = Request::get("/stats")
            .header("host", format!("127.0.0.1:{port}"))
            .body(Full::new(Bytes::new()))
            .map_err(|e| e.to_string())?;
        let response = conn
            .sender
            .send_request(request)
            .await
            .map_err(|e| e.to_string())?;
        let bytes = response
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        let stats: Stats = serde_json::from_slice(&bytes).map_err(|e| e.to_string())?;
        total.pay_runs += stats.pay_runs;
        total.hot_runs += stats.hot_runs;
    }
    Ok(total)
}
