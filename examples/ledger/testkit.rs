//! For the ledger tests (not part of the example): the app's router served
//! in-process on 127.0.0.1:0 over its own fresh database, a bare HTTP/1.1
//! client, and the database-side checks.
//!
//! Include next to the app: `#[path = "../examples/ledger/app/mod.rs"] mod app;`
//! and `#[path = "../examples/ledger/testkit.rs"] mod testkit;`.

use std::net::SocketAddr;
use std::time::Duration;

use axum::http::{HeaderMap, Method, Request};
use diesel::dsl::count_star;
use diesel::prelude::*;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use idem::pool::{build_pool_with, PoolConfig};
use idem_testing::TestDatabase;
use serde_json::{json, Value};

use crate::app;
use crate::app::schema::{ledger_accounts, ledger_entries, ledger_transfers};

/// The server's pool: with the checking connection and the harness's, a test
/// holds at most 14 connections.
const POOL_SIZE: usize = 12;

/// A running ledger over its own database.
pub struct Ledger {
    /// Talks HTTP to it; clone it into concurrent tasks.
    pub client: Client,
    server: tokio::task::JoinHandle<()>,
    /// A connection for the tests' own reads.
    pub conn: AsyncPgConnection,
    // Dropped last: the database outlives every connection to it.
    _db: TestDatabase,
}

/// One HTTP response.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Value,
}

impl Reply {
    /// True when the response carries `Idempotent-Replayed: true`.
    pub fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    /// A header as text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

impl Ledger {
    /// A fresh database with idem's tables and the ledger's, and the app
    /// serving on an ephemeral port.
    pub async fn start() -> Ledger {
        let db = TestDatabase::create().await.expect("a test database");
        let mut conn = AsyncPgConnection::establish(db.url())
            .await
            .expect("connect");
        idem::migrate(&mut conn).await.expect("idem's tables");
        app::schema::setup(&mut conn, false)
            .await
            .expect("the ledger's tables");
        let pool = build_pool_with(
            db.url(),
            &PoolConfig {
                max_size: POOL_SIZE,
                wait_timeout: Duration::from_secs(30),
                ..Default::default()
            },
        )
        .expect("a pool");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("local address");
        let server = tokio::spawn(async move {
            // As the example serves it: the admin page read-only, and the
            // peer address it needs.
            let app = app::api::router_with_admin(pool, false);
            axum::serve(
                listener,
                app.into_make_service_with_connect_info::<SocketAddr>(),
            )
            .await
            .expect("serve");
        });
        Ledger {
            client: Client { addr },
            server,
            conn,
            _db: db,
        }
    }

    /// The cached balance.
    pub async fn balance(&mut self, account: i64) -> i64 {
        ledger_accounts::table
            .find(account)
            .select(ledger_accounts::balance)
            .get_result(&mut self.conn)
            .await
            .expect("the balance")
    }

    /// `Σ CREDIT − Σ DEBIT` over the account's entries.
    pub async fn entries_balance(&mut self, account: i64) -> i64 {
        diesel::sql_query(ENTRIES_BALANCE)
            .bind::<diesel::sql_types::BigInt, _>(account)
            .get_result::<Count>(&mut self.conn)
            .await
            .expect("the entries' balance")
            .n
    }

    /// How many entries the account has.
    pub async fn entries(&mut self, account: i64) -> i64 {
        ledger_entries::table
            .filter(ledger_entries::account_id.eq(account))
            .select(count_star())
            .get_result(&mut self.conn)
            .await
            .expect("the entries")
    }

    /// How many rows each ledger table and `idem_requests` holds:
    /// (accounts, movements, entries, idempotency records).
    pub async fn counts(&mut self) -> (i64, i64, i64, i64) {
        let accounts = ledger_accounts::table
            .select(count_star())
            .get_result(&mut self.conn)
            .await
            .expect("accounts");
        let movements = ledger_transfers::table
            .select(count_star())
            .get_result(&mut self.conn)
            .await
            .expect("movements");
        let entries = ledger_entries::table
            .select(count_star())
            .get_result(&mut self.conn)
            .await
            .expect("entries");
        let records = diesel::sql_query("SELECT count(*) AS n FROM idem_requests")
            .get_result::<Count>(&mut self.conn)
            .await
            .expect("idempotency records")
            .n;
        (accounts, movements, entries, records)
    }

    /// Asserts the books: Σ DEBIT == Σ CREDIT, no movement unbalanced, and
    /// every cached balance equal to its entries (the `--reconcile` job).
    pub async fn assert_consistent(&mut self) -> app::admin::Reconciliation {
        let report = app::admin::reconcile(&mut self.conn)
            .await
            .expect("reconcile");
        assert!(report.is_clean(), "the books do not reconcile: {report:?}");
        report
    }
}

/// An HTTP/1.1 client of the server: one connection per request.
#[derive(Debug, Clone)]
pub struct Client {
    addr: SocketAddr,
}

/// One HTTP response as bytes, for requests that may not answer JSON.
#[derive(Debug, Clone)]
pub struct RawReply {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl RawReply {
    /// A header as text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

impl Client {
    /// Sends one request on a new connection, exactly as given (headers as
    /// bytes, the body as is, no content type added), and reads the whole
    /// response; `Err` says why there was none (a dropped connection).
    pub async fn send(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &[u8])],
        body: impl Into<Bytes>,
    ) -> Result<RawReply, String> {
        let stream = tokio::net::TcpStream::connect(self.addr)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        tokio::spawn(connection);
        let mut request = Request::builder()
            .method(method)
            .uri(path)
            .header("host", self.addr.to_string());
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request
            .body(Full::new(body.into()))
            .map_err(|e| format!("request: {e}"))?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| format!("no response: {e}"))?;
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("{status}: the body broke off: {e}"))?
            .to_bytes();
        Ok(RawReply {
            status,
            headers,
            body,
        })
    }

    /// Sends one request on a new connection and reads the whole response,
    /// which must be JSON (or empty).
    pub async fn request(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&Value>,
    ) -> Reply {
        let mut raw: Vec<(&str, &[u8])> = headers
            .iter()
            .map(|(name, value)| (*name, value.as_bytes()))
            .collect();
        let payload = match body {
            Some(body) => {
                raw.push(("content-type", b"application/json"));
                Bytes::from(serde_json::to_vec(body).expect("JSON"))
            }
            None => Bytes::new(),
        };
        let RawReply {
            status,
            headers,
            body: bytes,
        } = self
            .send(method, path, &raw, payload)
            .await
            .unwrap_or_else(|e| panic!("{path}: {e}"));
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).unwrap_or_else(|e| {
                panic!(
                    "{status}: not JSON ({e}): {}",
                    String::from_utf8_lossy(&bytes)
                )
            })
        };
        Reply {
            status,
            headers,
            body,
        }
    }

    /// `POST /accounts` in `currency`; returns its id.
    pub async fn open_account(&self, currency: &str) -> i64 {
        let reply = self
            .request(
                Method::POST,
                "/accounts",
                &[],
                Some(&json!({ "currency": currency })),
            )
            .await;
        assert_eq!(reply.status, 201, "{reply:?}");
        reply.body["id"].as_i64().expect("an id")
    }

    /// `POST /accounts/{id}/top-ups` under `key`.
    pub async fn top_up(&self, key: &str, account: i64, amount: i64, currency: &str) -> Reply {
        let key = format!("\"{key}\"");
        self.request(
            Method::POST,
            &format!("/accounts/{account}/top-ups"),
            &[("idempotency-key", &key)],
            Some(&json!({ "amount": amount, "currency": currency })),
        )
        .await
    }

    /// `POST /transfers` under `key` (none when `None`).
    pub async fn transfer(
        &self,
        key: Option<&str>,
        from: i64,
        to: i64,
        amount: i64,
        currency: &str,
    ) -> Reply {
        let key = key.map(|k| format!("\"{k}\""));
        let headers: Vec<(&str, &str)> = key
            .as_deref()
            .map(|k| vec![("idempotency-key", k)])
            .unwrap_or_default();
        self.request(
            Method::POST,
            "/transfers",
            &headers,
            Some(&json!({
                "from_account": from,
                "to_account": to,
                "amount": amount,
                "currency": currency,
            })),
        )
        .await
    }
}

impl Drop for Ledger {
    fn drop(&mut self) {
        self.server.abort();
    }
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    n: i64,
}

/// `sum(bigint)` is `numeric`: cast back, rather than pull in a decimal crate.
const ENTRIES_BALANCE: &str = "SELECT coalesce(sum(CASE direction WHEN 'CREDIT' THEN amount ELSE -amount END), 0)::bigint AS n \
     FROM ledger_entries WHERE account_id = $1";
