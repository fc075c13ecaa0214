//! The service each process runs: a payment endpoint (a new effect per key)
//! and a hot-account endpoint (every request moves money into one account),
//! both `#[idempotent]` + `#[retryable]`, over HTTP.
//!
//! | method and path | body | answers |
//! |---|---|---|
//! | `POST /pay` | `{"amount"}`, `Idempotency-Key` | 201 receipt |
//! | `POST /hot` | `{"amount"}`, `Idempotency-Key` | 201 receipt with the hot balance |
//! | `GET /stats` | | 200 how often each body ran in this process |
//!
//! Every effect is a row of `scale_effects` with the request's key and no
//! unique constraint: the idempotency record is the only thing standing
//! between two processes that receive the same key and a second row.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Integer, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idem::http::{IdempotencyKey, IdempotentResponse, Problem, StoredResponse};
use idem::pool::{build_pool_with, PoolConfig, Pooler};
use idem::{idempotent, retryable, Pool, Versioned, VersionedChanges, VersionedError};
use serde::{Deserialize, Serialize};

/// The tables, in a fresh database (after `idem::migrate`).
pub const SCHEMA: &str = "
    CREATE TABLE scale_effects (
        id      bigserial PRIMARY KEY,
        key     text   NOT NULL,
        kind    text   NOT NULL,
        amount  bigint NOT NULL,
        process int    NOT NULL
    );
    -- Not unique on purpose: a duplicate effect must be able to show.
    CREATE INDEX scale_effects_key ON scale_effects (key);
    CREATE TABLE scale_accounts (
        id      bigint PRIMARY KEY,
        balance bigint NOT NULL,
        version bigint NOT NULL DEFAULT 0
    );
    INSERT INTO scale_accounts (id, balance) VALUES (1, 0);
";

/// The one account every `/hot` request writes.
const HOT: i64 = 1;

diesel::table! {
    scale_accounts (id) {
        id -> Int8,
        balance -> Int8,
        version -> Int8,
    }
}

#[derive(Debug, Clone, Queryable, Selectable, Versioned)]
#[diesel(table_name = scale_accounts)]
#[versioned(tenant = none, key = id, version = version)]
struct Account {
    id: i64,
    balance: i64,
    version: i64,
}

#[derive(VersionedChanges)]
#[versioned(model = Account)]
#[diesel(table_name = scale_accounts)]
struct NewBalance {
    balance: i64,
}

/// How a child process is told to serve.
#[derive(Debug, Clone)]
pub struct ServeArgs {
    /// The database, directly or through PgBouncer.
    pub url: String,
    /// Set up the pool for transaction pooling.
    pub transaction_pooling: bool,
    /// Connections of this process's pool.
    pub pool_size: usize,
    /// This process's number, written into its effects.
    pub process: i32,
}

/// What each body counts in this process: runs, including the attempts a
/// lost race or a retry threw away.
#[derive(Debug, Default)]
struct Counters {
    pay_runs: AtomicU64,
    hot_runs: AtomicU64,
}

/// What `GET /stats` answers.
#[derive(Debug, Default, Clone, Copy, Serialize, Deserialize)]
pub struct Stats {
    /// Runs of the `/pay` body.
    pub pay_runs: u64,
    /// Runs of the `/hot` body.
    pub hot_runs: u64,
}

#[derive(Clone)]
struct App {
    pool: Pool,
    process: i32,
    counters: Arc<Counters>,
}

/// A request body of both endpoints.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Amount {
    /// Minor units.
    pub amount: i64,
}

/// The answer of both endpoints, stored under the key and replayed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Receipt {
    /// The effect row this request wrote (the winner's, on a replay).
    pub effect: i64,
    /// The process whose body ran.
    pub process: i32,
    /// The hot account's balance right after (`/hot` only).
    pub balance: Option<i64>,
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Db(#[from] diesel::result::Error),
    #[error(transparent)]
    Versioned(#[from] VersionedError),
    #[error(transparent)]
    Idem(#[from] idem::Error),
}

idem::final_errors!(AppError);

impl IntoResponse for AppError {
    fn into_response(self) -> Response {
        match self {
            AppError::Idem(e) => Problem::from(e).into_response(),
            AppError::Versioned(e) => Problem::from(e).into_response(),
            AppError::Db(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
        }
    }
}

type Answer = Result<IdempotentResponse<StoredResponse<Receipt>>, AppError>;

/// Serve on a free port of 127.0.0.1; print `listening <port>` for the
/// parent; stop when the parent closes stdin (or dies).
pub async fn serve(args: ServeArgs) -> Result<(), Box<dyn std::error::Error>> {
    let pool = build_pool_with(
        &args.url,
        &PoolConfig {
            max_size: args.pool_size,
            wait_timeout: std::time::Duration::from_secs(30),
            pooler: if args.transaction_pooling {
                Pooler::TransactionPooling
            } else {
                Pooler::Direct
            },
            ..PoolConfig::default()
        },
    )?;
    let app = App {
        pool,
        process: args.process,
        counters: Arc::default(),
    };
    let router = Router::new()
        .route("/pay", post(pay_handler))
        .route("/hot", post(hot_handler))
        .route("/stats", get(stats_handler))
        .with_state(app);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!("listening {}", listener.local_addr()?.port());
    // A blocking read: EOF comes when the parent closes the pipe or exits,
    // so no child outlives a parent that crashed.
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
        let _ = stop_tx.send(());
    });
    axum::serve(listener, router)
        .with_graceful_shutdown(async {
            let _ = stop_rx.await;
        })
        .await?;
    Ok(())
}

async fn pay_handler(
    State(app): State<App>,
    key: IdempotencyKey,
    Json(req): Json<Amount>,
) -> Answer {
    Ok(pay(&app.pool, &key, &req, &app).await?.into())
}

async fn hot_handler(
    State(app): State<App>,
    key: IdempotencyKey,
    Json(req): Json<Amount>,
) -> Answer {
    Ok(hot(&app.pool, &key, &req, &app).await?.into())
}

async fn stats_handler(State(app): State<App>) -> Json<Stats> {
    // Spelled out: diesel-async's `RunQueryDsl::load` would shadow the atomic's.
    let read = |counter: &AtomicU64| AtomicU64::load(counter, Ordering::Relaxed);
    Json(Stats {
        pay_runs: read(&app.counters.pay_runs),
        hot_runs: read(&app.counters.hot_runs),
    })
}

/// One effect per key. The fingerprint names the body only: the same
/// request reaching two processes must be the same request.
#[idempotent(key = key, scope = none, operation = "scale.pay", fingerprint(req))]
#[retryable(max = 5, deadline_ms = 20000)]
async fn pay(
    conn: &mut AsyncPgConnection,
    key: &IdempotencyKey,
    req: &Amount,
    app: &App,
) -> Result<StoredResponse<Receipt>, AppError> {
    app.counters.pay_runs.fetch_add(1, Ordering::Relaxed);
    let effect = insert_effect(conn, key.as_str(), "pay", req.amount, app.process).await?;
    Ok(StoredResponse::created(Receipt {
        effect,
        process: app.process,
        balance: None,
    }))
}

/// One effect per key, and the hot account's balance moved by the amount:
/// a versioned write, which after a lost race locks the row (and the
/// process remembers it as hot for later calls).
#[idempotent(key = key, scope = none, operation = "scale.hot", fingerprint(req))]
#[retryable(max = 10, deadline_ms = 20000, on_conflict = lock)]
async fn hot(
    conn: &mut AsyncPgConnection,
    key: &IdempotencyKey,
    req: &Amount,
    app: &App,
) -> Result<StoredResponse<Receipt>, AppError> {
    app.counters.hot_runs.fetch_add(1, Ordering::Relaxed);
    let account = Account::find(HOT).load(conn).await?;
    let account = Account::update(HOT)
        .expect_version(account.version)
        .set(&NewBalance {
            balance: account.balance + req.amount,
        })
        .execute(conn)
        .await?;
    let effect = insert_effect(conn, key.as_str(), "hot", req.amount, app.process).await?;
    Ok(StoredResponse::created(Receipt {
        effect,
        process: app.process,
        balance: Some(account.balance),
    }))
}

async fn insert_effect(
    conn: &mut AsyncPgConnection,
    key: &str,
    kind: &str,
    amount: i64,
    process: i32,
) -> Result<i64, AppError> {
    #[derive(QueryableByName)]
    struct Id {
        #[diesel(sql_type = BigInt)]
        id: i64,
    }
    let row: Id = diesel::sql_query(
        "INSERT INTO scale_effects (key, kind, amount, process) \
         VALUES ($1, $2, $3, $4) RETURNING id",
    )
    .bind::<Text, _>(key)
    .bind::<Text, _>(kind)
    .bind::<BigInt, _>(amount)
    .bind::<Integer, _>(process)
    .get_result(conn)
    .await?;
    Ok(row.id)
}

/// Create the tables in a fresh database.
pub async fn setup(conn: &mut AsyncPgConnection) -> Result<(), Box<dyn std::error::Error>> {
    idem::migrate(conn).await?;
    conn.batch_execute(SCHEMA).await?;
    Ok(())
}
