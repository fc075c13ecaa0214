//! A hostile pass on `idem::http` from its docs alone: an axum app (payments
//! under `#[idempotent]`, local and external, keyed by `IdempotencyKey`; a
//! versioned document behind `IfMatch`/`WithETag`) on a real listener and
//! database, driven by raw HTTP/1.1 bytes (duplicated headers, obs-text, tabs
//! and header-name case reach the server as written), every effect counted
//! in the database. Every refusal must be `application/problem+json` with the
//! status the table in src/http.rs gives its `type`, short, with no SQL and
//! nothing of another tenant in it. What each test attacks is on the test.

mod attack_s55;
mod keys;
mod preconditions;
mod transient;

use std::net::SocketAddr;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use diesel::prelude::*;
use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idem::http::problem_type::*;
use idem::http::{HttpStatus, IdempotencyKey, IdempotentResponse, IfMatch};
use idem::http::{Problem, StoredResponse, WithETag};
use idem::pool::{build_pool_with, PoolConfig};
use idem::{idempotent, retryable, CreateOnceError, Deferred, Error as IdemError, Pool};
use idem::{IdempotentError, Versioned, VersionedChanges, VersionedError};
use idem_testing::TestDatabase;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

diesel::table! { docs (tenant_id, id) { tenant_id -> Int8, id -> Int8, body -> Text, version -> Int8 } }

const SCHEMA: &str = "
CREATE TABLE docs (tenant_id bigint NOT NULL, id bigint NOT NULL, body text NOT NULL,
    version bigint NOT NULL DEFAULT 0 CHECK (version >= 0), PRIMARY KEY (tenant_id, id));
CREATE TABLE pays (id bigserial PRIMARY KEY, tenant_id bigint NOT NULL, idem_key text NOT NULL,
    amount bigint NOT NULL CONSTRAINT pays_secret_limit CHECK (amount < 1000000));
INSERT INTO docs VALUES (1, 1, 'tenant one', 0), (2, 7, 'SECRET-OF-TENANT-TWO', 3);";

#[derive(Debug, Clone, Queryable, Selectable, Versioned, Serialize)]
#[diesel(table_name = docs)]
#[versioned(tenant = tenant_id, key = id, version = version)]
struct Doc {
    tenant_id: i64,
    id: i64,
    body: String,
    version: i64,
}

#[derive(VersionedChanges)]
#[versioned(model = Doc)]
#[diesel(table_name = docs)]
struct SetBody {
    body: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct PayReq {
    amount: i64,
    merchant: String,
    #[serde(default)]
    sleep_ms: u64,
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] IdemError),
    #[error(transparent)]
    Versioned(#[from] VersionedError),
    #[error(transparent)]
    Db(#[from] DieselError),
    /// A final decline of a negative amount; `true` when replayed.
    #[error("declined {0}")]
    Declined(i64, bool),
}

impl IdempotentError for AppError {
    type Final = i64;
    fn to_final(&self) -> Option<i64> {
        match self {
            AppError::Declined(amount, _) => Some(*amount),
            _ => None,
        }
    }
    fn from_final(amount: i64) -> Self {
        AppError::Declined(amount, true)
    }
}

const DECLINED: &str = "urn:test:declined";

impl IntoResponse for AppError {
    fn into_response(self) -> Response {
        let problem = match self {
            AppError::Idem(e) => Problem::from(e),
            AppError::Versioned(e) => Problem::from(e),
            AppError::Db(e) => Problem::from(IdemError::from(e)),
            AppError::Declined(amount, replayed) => {
                let status = StatusCode::UNPROCESSABLE_ENTITY;
                let detail = format!("{amount}");
                let response = Problem::new(status, DECLINED, "Declined", detail);
                return IdempotentResponse { response, replayed }.into_response();
            }
        };
        problem.into_response()
    }
}

type Paid = Result<StoredResponse<Value>, AppError>;

#[derive(QueryableByName)]
struct N {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

const INSERT: &str = "INSERT INTO pays (tenant_id, idem_key, amount) \
                      VALUES ($1, $2, $3) RETURNING id AS n";

async fn insert_pay(conn: &mut AsyncPgConnection, t: i64, key: &str, req: &PayReq) -> Paid {
    let query = diesel::sql_query(INSERT).bind::<BigInt, _>(t);
    let query = query.bind::<Text, _>(key).bind::<BigInt, _>(req.amount);
    let id = query.get_result::<N>(conn).await?.n;
    let body = json!({ "id": id, "amount": req.amount, "merchant": req.merchant });
    Ok(StoredResponse::created(body))
}

#[idempotent(key = key, scope = ("pay", t), fingerprint(req))]
#[retryable(max = 4, deadline_ms = 3000)]
async fn pay(conn: &mut AsyncPgConnection, t: i64, key: &IdempotencyKey, req: &PayReq) -> Paid {
    if req.amount < 0 {
        return Err(AppError::Declined(req.amount, false));
    }
    let sql = format!("SELECT pg_sleep({})", req.sleep_ms as f64 / 1000.0);
    diesel::sql_query(sql).execute(conn).await?;
    insert_pay(conn, t, key.as_str(), req).await
}

/// Another operation in the same key space, with the same fingerprint.
#[idempotent(key = key, scope = ("pay", t), fingerprint(req))]
async fn refund(conn: &mut AsyncPgConnection, t: i64, key: &IdempotencyKey, req: &PayReq) -> Paid {
    insert_pay(conn, t, key.as_str(), req).await
}

/// External mode, the same key space: the outside call is a sleep.
#[idempotent(key = key, scope = ("pay", t), fingerprint(req), mode = external)]
#[retryable(max = 1, deadline_ms = 8000)]
async fn pay_ext(db: &mut Deferred<'_>, t: i64, key: &IdempotencyKey, req: &PayReq) -> Paid {
    tokio::time::sleep(Duration::from_millis(req.sleep_ms)).await;
    insert_pay(db.conn().await?, t, key.as_str(), req).await
}

type Tagged = Result<WithETag<Json<Doc>>, AppError>;
type Conn<'a> = &'a mut AsyncPgConnection;

#[retryable(max = 4, deadline_ms = 3000)]
async fn set_body(
    conn: &mut AsyncPgConnection,
    t: i64,
    id: i64,
    v: Option<i64>,
    body: String,
) -> Tagged {
    let version = match v {
        Some(v) => v,
        None => Doc::find(id).tenant(t).load(conn).await?.version,
    };
    let update = Doc::update(id).tenant(t).expect_version(version);
    let doc = update.set(&SetBody { body }).execute(conn).await?;
    Ok(WithETag(doc.version, Json(doc)))
}

async fn load_doc(conn: Conn<'_>, t: i64, id: i64) -> Result<Doc, VersionedError> {
    Doc::find(id).tenant(t).load(conn).await
}

type Pool2<T> = (State<Pool>, Path<T>);

async fn pay_h(
    (State(p), Path(r)): Pool2<(String, i64)>,
    key: IdempotencyKey,
    Json(req): Json<PayReq>,
) -> Response {
    let (mode, t) = (r.0.as_str(), r.1);
    let paid = match mode {
        "pay" => pay(&p, t, &key, &req).await,
        "refund" => refund(&p, t, &key, &req).await,
        _ => pay_ext(&p, t, &key, &req).await,
    };
    paid.map(IdempotentResponse::from).into_response()
}

async fn get_doc((State(pool), Path((t, id))): Pool2<(i64, i64)>) -> Tagged {
    let mut conn = pool.get().await.map_err(IdemError::from)?;
    let doc = load_doc(&mut conn, t, id).await?;
    Ok(WithETag(doc.version, Json(doc)))
}

async fn patch_doc(
    (State(p), Path((t, id))): Pool2<(i64, i64)>,
    m: IfMatch,
    b: Json<Value>,
) -> Tagged {
    let text = b["body"].as_str().unwrap_or_default().to_owned();
    set_body(&p, t, id, m.version(), text).await
}

async fn optional(if_match: Option<IfMatch>, key: Option<IdempotencyKey>) -> String {
    let key = key.map(IdempotencyKey::into_string);
    format!("{:?} {key:?}", if_match.map(|m| m.version()))
}

/// The server's address, a connection for the test's reads, the server's
/// pool, and its database (dropped last).
struct App(
    SocketAddr,
    AsyncPgConnection,
    Pool,
    #[allow(dead_code)] TestDatabase,
);

async fn start_with(max_size: usize, wait_timeout: Duration) -> App {
    let db = TestDatabase::create().await.expect("a test database");
    let mut conn = AsyncPgConnection::establish(db.url()).await.unwrap();
    idem::migrate(&mut conn).await.expect("idem's tables");
    conn.batch_execute(SCHEMA).await.expect("schema");
    let config = PoolConfig {
        max_size,
        wait_timeout,
        ..Default::default()
    };
    let pool = build_pool_with(db.url(), &config).expect("a pool");
    let app = Router::new()
        .route("/{mode}/{t}", post(pay_h))
        .route("/t/{t}/docs/{id}", get(get_doc).patch(patch_doc))
        .route("/optional", post(optional));
    let app = transient::routes(app).with_state(pool.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().expect("address");
    tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
    App(addr, conn, pool, db)
}

async fn start() -> App {
    start_with(12, Duration::from_secs(30)).await
}

type H<'a> = &'a [&'a [u8]];

impl App {
    async fn go(&self, path: &str, headers: H<'_>, body: &str) -> Reply {
        send(self.0, "POST", path, headers, body).await
    }
    async fn pay(&self, t: i64, headers: H<'_>, body: &str) -> Reply {
        self.go(&format!("/pay/{t}"), headers, body).await
    }
    async fn patch(&self, id: i64, headers: H<'_>) -> Reply {
        let body = r#"{"body": "written"}"#;
        let path = format!("/t/1/docs/{id}");
        send(self.0, "PATCH", &path, headers, body).await
    }
    async fn count(&mut self, sql: &str) -> i64 {
        let query = diesel::sql_query(sql);
        query.get_result::<N>(&mut self.1).await.expect(sql).n
    }
    async fn pays(&mut self) -> i64 {
        self.count("SELECT count(*) AS n FROM pays").await
    }
    /// (body, version) of tenant `t`'s document `id`.
    async fn doc(&mut self, t: i64, id: i64) -> (String, i64) {
        let d = load_doc(&mut self.1, t, id).await.unwrap();
        (d.body, d.version)
    }
}

#[derive(Debug)]
struct Reply {
    status: u16,
    head: String,
    body: Vec<u8>,
}

/// What no refusal may say: SQL, idem's table, the app's table and
/// constraint, tenant 2's document.
const LEAKS: &str = "secret|select |insert |update \"|idem_requests|pays|constraint";

/// The status of each problem `type`, as the table in `idem::http`'s docs
/// (src/http.rs:25-46) and `problem_type`'s docs give it.
fn documented_status(kind: &str) -> u16 {
    match kind {
        IDEMPOTENCY_KEY_MISSING | IDEMPOTENCY_KEY_INVALID | IF_MATCH_INVALID => 400,
        FINGERPRINT_MISMATCH | RESPONSE_UNSTORABLE | DECLINED => 422,
        IN_PROGRESS | RETRIES_EXHAUSTED | STATE_CONFLICT | UNIQUE_CONFLICT => 409,
        OUTCOME_UNKNOWN => 502,
        COMMIT_OUTCOME_UNKNOWN | UNAVAILABLE => 503,
        PRECONDITION_REQUIRED => 428,
        PRECONDITION_FAILED => 412,
        NOT_FOUND => 404,
        INTERNAL => 500,
        other => panic!("undocumented type {other}"),
    }
}

impl Reply {
    fn header(&self, name: &str) -> Option<String> {
        let fields = self.head.lines().skip(1).filter_map(|l| l.split_once(':'));
        let mut named = fields.filter(|(n, _)| n.eq_ignore_ascii_case(name));
        named.next().map(|(_, v)| v.trim().to_owned())
    }
    fn replayed(&self) -> bool {
        self.header("idempotent-replayed").as_deref() == Some("true")
    }
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    /// Asserts a JSON answer of `status`, a replay or not; its body.
    fn is(&self, status: u16, replayed: bool) -> Value {
        let got = (self.status, self.replayed());
        assert_eq!(got, (status, replayed), "{self:?}");
        let json = serde_json::from_slice(&self.body);
        json.unwrap_or_else(|e| panic!("not JSON ({e}): {self:?}"))
    }
    /// An RFC 9457 problem of type `kind` with its documented status, short,
    /// leaking nothing, with `Retry-After: 1` on a 503 and none on a 4xx
    /// other than 409 (whose callers check it); its body.
    fn problem(&self, kind: &str) -> Value {
        let status = documented_status(kind);
        let ct = self.header("content-type");
        let json = Some("application/problem+json");
        assert_eq!((self.status, ct.as_deref()), (status, json), "{self:?}");
        let body = self.is(status, self.replayed());
        assert_eq!(
            (&body["status"], &body["type"]),
            (&json!(status), &json!(kind))
        );
        assert!(body["title"].is_string() && body["detail"].is_string());
        assert!(self.body.len() <= 1024, "{} bytes", self.body.len());
        let lower = self.text().to_lowercase();
        assert!(LEAKS.split('|').all(|s| !lower.contains(s)), "{body}");
        if status != 409 {
            let want = [None, Some("1")][usize::from(status == 503)];
            assert_eq!(self.header("retry-after").as_deref(), want, "{self:?}");
        }
        body
    }
}

/// One request, written as given: `headers` are raw `Name: value` bytes.
async fn send(addr: SocketAddr, method: &str, path: &str, headers: H<'_>, body: &str) -> Reply {
    let mut req = format!("{method} {path} HTTP/1.1\r\nhost: {addr}\r\n").into_bytes();
    for h in headers {
        req.extend_from_slice(h);
        req.extend_from_slice(b"\r\n");
    }
    let n = body.len();
    let ct = ["", "content-type: application/json\r\n"][usize::from(n > 0)];
    let end = format!("{ct}connection: close\r\ncontent-length: {n}\r\n\r\n{body}");
    req.extend_from_slice(end.as_bytes());
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(&req).await.expect("write");
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.expect("read");
    let end = 4 + raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&raw[..end]).into_owned();
    let (status, body) = (head[9..12].parse().unwrap(), raw[end..].to_vec());
    let reply = Reply { status, head, body };
    assert!(reply.header("transfer-encoding").is_none(), "{reply:?}");
    reply
}

const BODY: &str = r#"{"amount": 100, "merchant": "m1"}"#;

/// `Idempotency-Key: <value>` as bytes.
fn key(value: &str) -> Vec<u8> {
    format!("idempotency-key: {value}").into_bytes()
}

async fn connect(url: &str) -> AsyncPgConnection {
    AsyncPgConnection::establish(url)
        .await
        .expect("a connection")
}

/// Polls `sql` (a count) on `conn` until it is positive, for 10 s at most.
async fn until_positive(conn: &mut AsyncPgConnection, sql: &str) {
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while diesel::sql_query(sql)
        .get_result::<N>(conn)
        .await
        .unwrap()
        .n
        == 0
    {
        assert!(std::time::Instant::now() < until, "never: {sql}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A backend of this test's database waiting on a lock (a row's or an
/// advisory one).
const WAITING: &str = "SELECT count(*) AS n FROM pg_stat_activity \
                       WHERE datname = current_database() AND wait_event_type = 'Lock'";

/// Locks tenant 1's document 1 in a transaction left open.
const HOLD_DOC: &str = "BEGIN; SELECT 1 FROM docs WHERE tenant_id = 1 AND id = 1 FOR UPDATE";

/// The server process of `conn`.
async fn backend_pid(conn: &mut AsyncPgConnection) -> i64 {
    let pid = diesel::sql_query("SELECT pg_backend_pid()::int8 AS n");
    pid.get_result::<N>(conn).await.unwrap().n
}
