//! `#[idempotent]` against a real PostgreSQL: every promise of issue 4 is shown
//! by real outcomes (business rows, `idem_requests` records, commits counted by
//! the server), never by the library's own report of what it did. Sleeps only
//! widen races or let a lease or a retention run out; no assertion depends on
//! the machine being fast.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idem::idempotency::{current_key, purge_expired, settle, Settlement, OUTCOME_UNKNOWN_MESSAGE};
use idem::pool::{build_pool_with, PoolConfig};
use idem::{idempotent, retryable, Deferred, IdempotentError, Pool, VersionedError};
use idem_testing::TestDatabase;
use serde::{Deserialize, Serialize};
use tokio::sync::{Barrier, Semaphore};

// ---------------------------------------------------------------------------
// Fixtures
// ---------------------------------------------------------------------------

/// A final error: stored under the key and replayed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
enum Declined {
    InsufficientFunds { needed: i64 },
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Db(#[from] diesel::result::Error),
    #[error(transparent)]
    Idem(#[from] idem::Error),
    #[error(transparent)]
    Versioned(#[from] VersionedError),
    #[error("declined: {0:?}")]
    Declined(Declined),
    /// The target did not answer: it may have done it.
    #[error("the target timed out")]
    Timeout,
    /// Refused before anything was sent.
    #[error("invalid request, nothing sent")]
    Invalid,
}

impl IdempotentError for AppError {
    type Final = Declined;
    fn to_final(&self) -> Option<Declined> {
        match self {
            AppError::Declined(d) => Some(d.clone()),
            _ => None,
        }
    }
    fn from_final(stored: Declined) -> Self {
        AppError::Declined(stored)
    }
    fn nothing_sent(&self) -> bool {
        matches!(self, AppError::Invalid)
    }
}

const SCHEMA: &str = "
    CREATE TABLE payments (
        id bigint PRIMARY KEY,
        tenant bigint NOT NULL,
        amount bigint NOT NULL,
        currency text NOT NULL
    );
    CREATE TABLE effects (id bigserial PRIMARY KEY, tag text NOT NULL, n bigint NOT NULL);
";

struct Env {
    client: tokio_postgres::Client,
    pool: Pool,
    db: TestDatabase,
}

async fn env(pool_size: usize) -> Env {
    assert!(pool_size <= 20, "tests run in parallel: keep pools small");
    let db = TestDatabase::create()
        .await
        .expect("create the test database");
    let mut conn = AsyncPgConnection::establish(db.url())
        .await
        .expect("connect");
    idem::migrate(&mut conn).await.expect("migrate");
    conn.batch_execute(SCHEMA).await.expect("schema");
    drop(conn);
    let client = side_connection(db.url()).await;
    let pool = pool_of(&db, pool_size);
    Env { client, pool, db }
}

fn pool_of(db: &TestDatabase, size: usize) -> Pool {
    build_pool_with(
        db.url(),
        &PoolConfig {
            max_size: size,
            wait_timeout: Duration::from_secs(60),
        },
    )
    .expect("build the pool")
}

async fn side_connection(url: &str) -> tokio_postgres::Client {
    idem_testing::connect(url).await.expect("connect")
}

impl Env {
    async fn scalar(&self, query: &str) -> i64 {
        self.client
            .query_one(query, &[])
            .await
            .unwrap_or_else(|e| panic!("{query}: {e}"))
            .get(0)
    }

    async fn records(&self) -> i64 {
        self.scalar("SELECT count(*) FROM idem_requests").await
    }

    async fn payments(&self) -> i64 {
        self.scalar("SELECT count(*) FROM payments").await
    }

    async fn effects(&self, tag: &str) -> i64 {
        self.client
            .query_one("SELECT count(*) FROM effects WHERE tag = $1", &[&tag])
            .await
            .unwrap()
            .get(0)
    }

    /// `(state, outcome, response as text)` of the record of `key`, if any.
    async fn record(&self, key: &str) -> Option<(String, Option<String>, Option<String>)> {
        self.client
            .query_opt(
                "SELECT state, outcome, response::text FROM idem_requests WHERE key = $1",
                &[&key],
            )
            .await
            .unwrap()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
    }

    async fn state(&self, key: &str) -> Option<String> {
        self.record(key).await.map(|r| r.0)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Payment {
    id: i64,
    tenant: i64,
    amount: i64,
    currency: String,
}

#[derive(Debug, Clone)]
struct Ctx {
    tenant: i64,
    user: i64,
}

#[derive(Debug, Clone)]
struct PayCmd {
    key: String,
    amount: i64,
    currency: String,
    merchant: String,
}

fn cmd(key: &str, amount: i64) -> PayCmd {
    PayCmd {
        key: key.to_owned(),
        amount,
        currency: "CNY".to_owned(),
        merchant: "demo".to_owned(),
    }
}

const CTX: Ctx = Ctx { tenant: 1, user: 7 };

async fn insert_payment(
    conn: &mut AsyncPgConnection,
    id: i64,
    tenant: i64,
    cmd: &PayCmd,
) -> Result<Payment, AppError> {
    diesel::sql_query(
        "INSERT INTO payments (id, tenant, amount, currency) VALUES ($1, $2, $3, $4)",
    )
    .bind::<BigInt, _>(id)
    .bind::<BigInt, _>(tenant)
    .bind::<BigInt, _>(cmd.amount)
    .bind::<Text, _>(&cmd.currency)
    .execute(conn)
    .await?;
    Ok(Payment {
        id,
        tenant,
        amount: cmd.amount,
        currency: cmd.currency.clone(),
    })
}

/// The payment of seed 000: each caller proposes its own payment id; the key
/// is the arbiter.
#[idempotent(key = cmd.key, scope = (ctx.tenant, ctx.user), fingerprint(cmd.amount, cmd.currency, cmd.merchant))]
#[retryable(max = 4, deadline_ms = 30000)]
async fn pay(
    conn: &mut AsyncPgConnection,
    ctx: &Ctx,
    cmd: &PayCmd,
    proposed_id: i64,
) -> Result<Payment, AppError> {
    insert_payment(conn, proposed_id, ctx.tenant, cmd).await
}

/// Another operation (its default name is its own path) with the same
/// attribute: the same key is a different request.
#[idempotent(key = cmd.key, scope = (ctx.tenant, ctx.user), fingerprint(cmd.amount, cmd.currency, cmd.merchant))]
#[retryable(max = 4, deadline_ms = 30000)]
async fn refund(
    conn: &mut AsyncPgConnection,
    ctx: &Ctx,
    cmd: &PayCmd,
    proposed_id: i64,
) -> Result<Payment, AppError> {
    insert_payment(conn, proposed_id, ctx.tenant, cmd).await
}

async fn insert_effect(conn: &mut AsyncPgConnection, tag: &str, n: i64) -> Result<i64, AppError> {
    #[derive(QueryableByName)]
    struct Id {
        #[diesel(sql_type = BigInt)]
        id: i64,
    }
    let row: Id = diesel::sql_query("INSERT INTO effects (tag, n) VALUES ($1, $2) RETURNING id")
        .bind::<Text, _>(tag)
        .bind::<BigInt, _>(n)
        .get_result(conn)
        .await?;
    Ok(row.id)
}

fn calls(c: &AtomicU32) -> u32 {
    c.load(Ordering::SeqCst)
}

fn matches_idem(result: &Result<impl std::fmt::Debug, AppError>, expected: &str) -> bool {
    match result {
        Err(AppError::Idem(e)) => format!("{e:?}").starts_with(expected),
        _ => false,
    }
}

// ---------------------------------------------------------------------------
// Concurrency: one effect for 200 same-key requests
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 8)]
async fn two_hundred_concurrent_requests_have_one_effect() {
    let env = env(20).await;
    let barrier = Arc::new(Barrier::new(200));
    let tasks: Vec<_> = (0..200)
        .map(|i| {
            let pool = env.pool.clone();
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                pay(&pool, &CTX, &cmd("idem-order-1001", 3000), 1000 + i).await
            })
        })
        .collect();
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.unwrap().expect("every request is answered"));
    }
    let firsts: Vec<_> = answers.iter().filter(|a| !a.replayed).collect();
    assert_eq!(firsts.len(), 1, "exactly one request ran the body");
    assert_eq!(answers.iter().filter(|a| a.replayed).count(), 199);
    let winner = &firsts[0].value;
    assert!(
        answers.iter().all(|a| &a.value == winner),
        "every replay carries the winner's response"
    );
    assert_eq!(env.payments().await, 1, "one business row");
    assert_eq!(
        env.scalar("SELECT id FROM payments").await,
        winner.id,
        "the row is the winner's"
    );
    assert_eq!(env.records().await, 1);
    let (state, outcome, _) = env.record("idem-order-1001").await.unwrap();
    assert_eq!(
        (state.as_str(), outcome.as_deref()),
        ("completed", Some("ok"))
    );
}

// ---------------------------------------------------------------------------
// Local mode: one commit per new request
// ---------------------------------------------------------------------------

/// `xact_commit` of database `name`, read from another database so that the
/// reading adds nothing to it; waits until it stops moving (backends flush
/// their counters asynchronously, at the latest when they exit).
async fn settled_commits(admin: &tokio_postgres::Client, name: &str) -> i64 {
    // Backends of the database still connected have unflushed counters.
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let connected: i64 = admin
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = $1",
                &[&name],
            )
            .await
            .unwrap()
            .get(0);
        if connected == 0 {
            break;
        }
        assert!(Instant::now() < until, "backends of {name} did not exit");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let read = || async {
        admin
            .batch_execute("SELECT pg_stat_clear_snapshot()")
            .await
            .unwrap();
        admin
            .query_one(
                "SELECT xact_commit FROM pg_stat_database WHERE datname = $1",
                &[&name],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
    };
    let mut last = read().await;
    let mut stable = 0;
    while stable < 5 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = read().await;
        if now == last {
            stable += 1;
        } else {
            (last, stable) = (now, 0);
        }
    }
    last
}

/// Commits in the test database made by `calls` new-key payments on a
/// dedicated one-connection pool, including the pool's connection set-up.
async fn commits_of(env: &Env, admin: &tokio_postgres::Client, first: i64, calls: i64) -> i64 {
    let name = env.db.name();
    let before = settled_commits(admin, name).await;
    {
        let pool = pool_of(&env.db, 1);
        // The set-up of the connection, counted in every run alike.
        drop(pool.get().await.unwrap());
        for i in first..first + calls {
            let answer = pay(&pool, &CTX, &cmd(&format!("commit-{i}"), 10), i)
                .await
                .unwrap();
            assert!(!answer.replayed);
        }
    }
    settled_commits(admin, name).await - before
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn local_mode_commits_once_per_new_request() {
    let env = env(1).await;
    // Nothing of this test may touch the database while it counts.
    drop(env.client);
    drop(env.pool);
    let env = Env {
        client: side_connection(&idem_testing::server_url().unwrap()).await,
        pool: pool_of(&env.db, 1),
        db: env.db,
    };
    let admin = &env.client;
    const N: i64 = 25;
    // Autovacuum may visit the database and add commits to a window; it never
    // takes any away, so a clean pair of windows shows the exact count.
    let mut seen = Vec::new();
    for round in 0..3 {
        let overhead = commits_of(&env, admin, 0, 0).await;
        let with_calls = commits_of(&env, admin, 100 * (round + 1), N).await;
        seen.push((overhead, with_calls));
        if with_calls - overhead == N {
            return;
        }
    }
    panic!(
        "expected {N} commits for {N} new requests (connection set-up, then with calls): {seen:?}"
    );
}

// ---------------------------------------------------------------------------
// The same key for a different request, and key spaces
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_different_request_under_the_same_key_is_refused_and_scopes_are_separate() {
    let env = env(4).await;
    let first = pay(&env.pool, &CTX, &cmd("k-1", 3000), 1).await.unwrap();
    assert!(!first.replayed);
    let stored_before = env.record("k-1").await;

    // Same key, same request: the stored response, the body not run again.
    let again = pay(&env.pool, &CTX, &cmd("k-1", 3000), 2).await.unwrap();
    assert!(again.replayed);
    assert_eq!(again.value, first.value);
    assert_eq!(
        again.value.id, 1,
        "the first request's payment, not the proposed one"
    );

    // Same key, another amount, another currency, another merchant: refused.
    let mut other_merchant = cmd("k-1", 3000);
    other_merchant.merchant = "elsewhere".into();
    let mut other_currency = cmd("k-1", 3000);
    other_currency.currency = "EUR".into();
    for different in [cmd("k-1", 9999), other_merchant, other_currency] {
        let result = pay(&env.pool, &CTX, &different, 3).await;
        match &result {
            Err(AppError::Idem(e @ idem::Error::FingerprintMismatch)) => {
                assert_eq!(e.http_status(), 422)
            }
            other => panic!("expected a fingerprint mismatch, got {other:?}"),
        }
    }
    // Another operation under the same key and scope, with the same fields.
    let result = refund(&env.pool, &CTX, &cmd("k-1", 3000), 4).await;
    assert!(
        matches!(
            result,
            Err(AppError::Idem(idem::Error::FingerprintMismatch))
        ),
        "{result:?}"
    );
    // Nothing was written, and the record is untouched: not even locked by
    // the replays and refusals (a lock would leave their xid in xmax).
    assert_eq!(env.payments().await, 1);
    assert_eq!(env.records().await, 1);
    assert_eq!(env.record("k-1").await, stored_before);
    assert_eq!(
        env.scalar("SELECT xmax::text::bigint FROM idem_requests WHERE key = 'k-1'")
            .await,
        0
    );

    // Another tenant, then another user of the same tenant: their own key
    // spaces, where the same key is new, even for a different request.
    let tenant2 = Ctx { tenant: 2, user: 7 };
    let t2 = pay(&env.pool, &tenant2, &cmd("k-1", 9999), 5)
        .await
        .unwrap();
    assert!(!t2.replayed);
    assert_eq!(
        (t2.value.id, t2.value.tenant, t2.value.amount),
        (5, 2, 9999)
    );
    let user8 = Ctx { tenant: 1, user: 8 };
    let u8 = pay(&env.pool, &user8, &cmd("k-1", 3000), 6).await.unwrap();
    assert!(!u8.replayed);
    assert_eq!(u8.value.id, 6);
    assert_eq!(env.payments().await, 3);
    assert_eq!(env.records().await, 3);
    // And each scope replays its own record.
    let t2_again = pay(&env.pool, &tenant2, &cmd("k-1", 9999), 7)
        .await
        .unwrap();
    assert!(t2_again.replayed);
    assert_eq!(t2_again.value, t2.value);
    let scopes: Vec<String> = env
        .client
        .query("SELECT scope FROM idem_requests ORDER BY scope", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(scopes, ["[1,7]", "[1,8]", "[2,7]"]);
}

// ---------------------------------------------------------------------------
// Derived keys and the canonical fingerprint
// ---------------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct ToolAnswer {
    id: i64,
    idempotent: bool,
}

/// Two tools with the same operation and the same fields, named in another
/// order: one fingerprint, so one derived key.
#[idempotent(scope = who, operation = "tool.write", fingerprint(a, b))]
async fn tool_ab(
    conn: &mut AsyncPgConnection,
    who: &str,
    a: i64,
    b: &str,
) -> Result<ToolAnswer, AppError> {
    let id = insert_effect(conn, &format!("tool:{b}"), a).await?;
    Ok(ToolAnswer {
        id,
        idempotent: false,
    })
}

#[idempotent(scope = who, operation = "tool.write", fingerprint(b, a))]
async fn tool_ba(
    conn: &mut AsyncPgConnection,
    who: &str,
    a: i64,
    b: &str,
) -> Result<ToolAnswer, AppError> {
    let id = insert_effect(conn, &format!("tool:{b}"), a).await?;
    Ok(ToolAnswer {
        id,
        idempotent: false,
    })
}

/// No key and no fingerprint list: every parameter is the fingerprint.
#[idempotent(scope = (who, conversation))]
async fn tool_json(
    conn: &mut AsyncPgConnection,
    who: &str,
    conversation: i64,
    args: &serde_json::Value,
) -> Result<ToolAnswer, AppError> {
    let id = insert_effect(conn, "json", args.to_string().len() as i64).await?;
    Ok(ToolAnswer {
        id,
        idempotent: false,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn derived_keys_replay_the_same_call_in_any_spelling() {
    let env = env(4).await;
    let first = tool_ab(&env.pool, "alice", 5, "x").await.unwrap();
    assert!(!first.replayed);
    let again = tool_ab(&env.pool, "alice", 5, "x").await.unwrap();
    assert!(again.replayed);
    assert_eq!(again.value, first.value);
    // The other function names the fields in the other order: the same call.
    let other_order = tool_ba(&env.pool, "alice", 5, "x").await.unwrap();
    assert!(
        other_order.replayed,
        "fingerprint(b, a) = fingerprint(a, b)"
    );
    assert_eq!(other_order.value, first.value);
    assert_eq!(env.effects("tool:x").await, 1);
    // Another value, or another caller: another call.
    let other_value = tool_ba(&env.pool, "alice", 6, "x").await.unwrap();
    assert!(!other_value.replayed);
    let other_who = tool_ab(&env.pool, "bob", 5, "x").await.unwrap();
    assert!(!other_who.replayed);
    assert_eq!(env.effects("tool:x").await, 3);
    // The derived key is the published one: sha256(scope : operation : fingerprint).
    let fields = [
        idem::idempotency::Field::new("b", &"x").unwrap(),
        idem::idempotency::Field::new("a", &5).unwrap(),
    ];
    let fp = idem::idempotency::fingerprint::fingerprint(&fields);
    let key = idem::idempotency::derived_key("\"alice\"", "tool.write", &fp);
    assert_eq!(key.len(), 64);
    assert_eq!(
        env.scalar(&format!(
            "SELECT count(*) FROM idem_requests WHERE key = '{key}' AND scope = '\"alice\"'"
        ))
        .await,
        1
    );

    // JSON arguments whose objects list their keys in another order.
    let spelled_one: serde_json::Value = serde_json::from_str(
        r#"{"to":"bob","amount":{"value":30,"currency":"CNY"},"tags":["a","b"]}"#,
    )
    .unwrap();
    let spelled_two: serde_json::Value = serde_json::from_str(
        r#"{"tags":["a","b"],"amount":{"currency":"CNY","value":30},"to":"bob"}"#,
    )
    .unwrap();
    let one = tool_json(&env.pool, "alice", 1, &spelled_one)
        .await
        .unwrap();
    let two = tool_json(&env.pool, "alice", 1, &spelled_two)
        .await
        .unwrap();
    assert!(!one.replayed);
    assert!(
        two.replayed,
        "the key order of a JSON object does not matter"
    );
    assert_eq!(one.value, two.value);
    // The order of an array does.
    let reordered: serde_json::Value = serde_json::from_str(
        r#"{"tags":["b","a"],"amount":{"currency":"CNY","value":30},"to":"bob"}"#,
    )
    .unwrap();
    assert!(
        !tool_json(&env.pool, "alice", 1, &reordered)
            .await
            .unwrap()
            .replayed
    );
    // Another conversation is another call.
    assert!(
        !tool_json(&env.pool, "alice", 2, &spelled_one)
            .await
            .unwrap()
            .replayed
    );
    assert_eq!(env.effects("json").await, 3);
}

// ---------------------------------------------------------------------------
// Errors: final ones are stored, the others let a retry run
// ---------------------------------------------------------------------------

/// What the next runs of a body do, in order; then they succeed.
#[derive(Default)]
struct Script {
    calls: AtomicU32,
    steps: Mutex<VecDeque<Step>>,
    keys: Mutex<Vec<Option<String>>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Declined,
    Timeout,
    Invalid,
    SerializationFailure,
    Stale,
}

impl Script {
    fn new(steps: &[Step]) -> Script {
        Script {
            steps: Mutex::new(steps.iter().copied().collect()),
            ..Script::default()
        }
    }

    fn push(&self, step: Step) {
        self.steps.lock().unwrap().push_back(step);
    }

    /// One run of a body, after its writes: count it, note the key, and fail
    /// as scripted.
    async fn run(&self, conn: &mut AsyncPgConnection) -> Result<(), AppError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.keys.lock().unwrap().push(current_key());
        let step = self.steps.lock().unwrap().pop_front();
        match step {
            None => Ok(()),
            Some(Step::Declined) => Err(AppError::Declined(Declined::InsufficientFunds {
                needed: 42,
            })),
            Some(Step::Timeout) => Err(AppError::Timeout),
            Some(Step::Invalid) => Err(AppError::Invalid),
            Some(Step::SerializationFailure) => {
                conn.batch_execute(
                    "DO $$ BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = 'serialization_failure'; END $$",
                )
                .await?;
                unreachable!("the statement fails")
            }
            Some(Step::Stale) => {
                // A hand-written check that lost a race says so.
                idem::attempt::lost_race();
                Err(AppError::Versioned(VersionedError::Stale {
                    expected: 1,
                    actual: 2,
                }))
            }
        }
    }

    fn calls(&self) -> u32 {
        calls(&self.calls)
    }
}

#[idempotent(key = key, fingerprint(n))]
async fn charge(
    conn: &mut AsyncPgConnection,
    key: &str,
    n: i64,
    script: &Script,
) -> Result<i64, AppError> {
    let id = insert_effect(conn, "charge", n).await?;
    script.run(conn).await?;
    Ok(id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn final_errors_are_stored_and_other_errors_release_the_key() {
    let env = env(4).await;
    let script = Script::new(&[Step::Declined]);

    // A final error: stored, the body's writes rolled back.
    let result = charge(&env.pool, "declined", 10, &script).await;
    assert!(
        matches!(
            &result,
            Err(AppError::Declined(Declined::InsufficientFunds {
                needed: 42
            }))
        ),
        "{result:?}"
    );
    assert_eq!(
        env.effects("charge").await,
        0,
        "the body's writes were rolled back"
    );
    let (state, outcome, response) = env.record("declined").await.unwrap();
    assert_eq!(
        (state.as_str(), outcome.as_deref()),
        ("completed", Some("error"))
    );
    assert!(response.unwrap().contains("InsufficientFunds"));
    // Replayed to later callers, without running the body.
    for _ in 0..2 {
        let result = charge(&env.pool, "declined", 10, &script).await;
        assert!(
            matches!(
                &result,
                Err(AppError::Declined(Declined::InsufficientFunds {
                    needed: 42
                }))
            ),
            "{result:?}"
        );
    }
    assert_eq!(script.calls(), 1);
    // A different request under that key is still refused.
    let result = charge(&env.pool, "declined", 11, &script).await;
    assert!(matches_idem(&result, "FingerprintMismatch"), "{result:?}");

    // A non-final error: nothing stays, not even the claim.
    script.push(Step::Timeout);
    let result = charge(&env.pool, "flaky", 10, &script).await;
    assert!(matches!(result, Err(AppError::Timeout)), "{result:?}");
    assert_eq!(script.calls(), 2);
    assert_eq!(env.record("flaky").await, None, "the claim rolled back");
    assert_eq!(env.effects("charge").await, 0);
    // So a retry really runs again, and then it is stored.
    let retried = charge(&env.pool, "flaky", 10, &script).await.unwrap();
    assert!(!retried.replayed);
    assert_eq!(script.calls(), 3);
    assert_eq!(env.effects("charge").await, 1);
    let replay = charge(&env.pool, "flaky", 10, &script).await.unwrap();
    assert!(replay.replayed);
    assert_eq!(replay.value, retried.value);
    assert_eq!(script.calls(), 3);
}

// ---------------------------------------------------------------------------
// A compound result comes back whole
// ---------------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Written {
    id: i64,
    tag: String,
    n: i64,
}

#[idempotent(key = key, fingerprint(order))]
async fn compound(
    conn: &mut AsyncPgConnection,
    key: &str,
    order: i64,
) -> Result<Vec<Written>, AppError> {
    let mut rows = Vec::new();
    for tag in ["order", "line", "outbox"] {
        let id = insert_effect(conn, tag, order).await?;
        rows.push(Written {
            id,
            tag: tag.to_owned(),
            n: order,
        });
    }
    Ok(rows)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_compound_result_is_replayed_whole() {
    let env = env(2).await;
    let first = compound(&env.pool, "c-1", 77).await.unwrap();
    assert!(!first.replayed);
    assert_eq!(first.value.len(), 3);
    let replay = compound(&env.pool, "c-1", 77).await.unwrap();
    assert!(replay.replayed);
    assert_eq!(replay.value, first.value, "every member, in order");
    assert_eq!(env.scalar("SELECT count(*) FROM effects").await, 3);
    // The replayed rows are the rows in the table.
    let rows: Vec<Written> = env
        .client
        .query("SELECT id, tag, n FROM effects ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| Written {
            id: r.get(0),
            tag: r.get(1),
            n: r.get(2),
        })
        .collect();
    assert_eq!(rows, replay.value);
}

// ---------------------------------------------------------------------------
// External mode
// ---------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct SendCmd {
    key: String,
    target: String,
    amount: i64,
}

fn send_cmd(key: &str, amount: i64) -> SendCmd {
    SendCmd {
        key: key.to_owned(),
        target: "psp".to_owned(),
        amount,
    }
}

/// An outside system the body calls: it can be held mid-call.
struct Target {
    script: Script,
    /// A permit per body that reached the call.
    started: Semaphore,
    /// While set, a body waits for a permit of `release` before answering.
    hold: std::sync::atomic::AtomicBool,
    release: Semaphore,
}

impl Default for Target {
    fn default() -> Target {
        Target {
            script: Script::default(),
            started: Semaphore::new(0),
            hold: Default::default(),
            release: Semaphore::new(0),
        }
    }
}

impl Target {
    fn held() -> Target {
        let target = Target::default();
        target.hold.store(true, Ordering::SeqCst);
        target
    }

    /// The outside call (held while `hold` is set), then the local writes
    /// that commit with the outcome.
    async fn call(&self, db: &mut Deferred<'_>, cmd: &SendCmd) -> Result<String, AppError> {
        assert!(!db.is_open(), "nothing is open while the outside call runs");
        self.started.add_permits(1);
        if std::sync::atomic::AtomicBool::load(&self.hold, Ordering::SeqCst) {
            self.release.acquire().await.unwrap().forget();
        }
        let conn = db.conn().await?;
        insert_effect(conn, &format!("sent:{}", cmd.key), cmd.amount).await?;
        self.script.run(conn).await?;
        Ok(format!(
            "receipt:{}",
            current_key().expect("the body runs under its key")
        ))
    }

    async fn wait_started(&self) {
        tokio::time::timeout(Duration::from_secs(20), self.started.acquire())
            .await
            .expect("the body started")
            .unwrap()
            .forget();
    }
}

#[idempotent(key = cmd.key, operation = "ext.send", fingerprint(cmd.target, cmd.amount), mode = external)]
#[retryable(max = 3, deadline_ms = 30000)]
async fn send(db: &mut Deferred<'_>, cmd: &SendCmd, target: &Target) -> Result<String, AppError> {
    target.call(db, cmd).await
}

/// The same operation; a duplicate waits for the first request's outcome.
#[idempotent(key = cmd.key, operation = "ext.send", fingerprint(cmd.target, cmd.amount), mode = external, wait_ms = 20000)]
async fn send_waiting(
    db: &mut Deferred<'_>,
    cmd: &SendCmd,
    target: &Target,
) -> Result<String, AppError> {
    target.call(db, cmd).await
}

/// The same operation with a lease shorter than the call.
#[idempotent(key = cmd.key, operation = "ext.send", fingerprint(cmd.target, cmd.amount), mode = external, lease_ms = 300)]
async fn send_leased(
    db: &mut Deferred<'_>,
    cmd: &SendCmd,
    target: &Target,
) -> Result<String, AppError> {
    target.call(db, cmd).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn external_claims_commit_before_the_body_and_duplicates_wait_or_are_told() {
    let env = Arc::new(env(6).await);
    let target = Arc::new(Target::held());
    let first = {
        let (env, target) = (env.clone(), target.clone());
        tokio::spawn(async move { send(&env.pool, &send_cmd("x-1", 30), &target).await })
    };
    target.wait_started().await;
    // Phase 2: while the outside call runs, no transaction is open and every
    // pooled connection is back in the pool.
    let status = env.pool.status();
    assert_eq!(
        status.available, status.size,
        "the pool has its connections back during the outside call: {status:?}"
    );
    let open = env
        .scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND xact_start IS NOT NULL AND pid <> pg_backend_pid()",
        )
        .await;
    assert_eq!(open, 0, "no transaction is open during the outside call");
    // The claim is committed while the body runs: another connection sees it.
    let row = env
        .client
        .query_one(
            "SELECT state, mode, lease_until > now() FROM idem_requests WHERE key = 'x-1'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        (
            row.get::<_, String>(0),
            row.get::<_, String>(1),
            row.get::<_, bool>(2)
        ),
        ("in_progress".to_owned(), "external".to_owned(), true)
    );
    // A duplicate is told at once.
    let result = send(&env.pool, &send_cmd("x-1", 30), &target).await;
    match &result {
        Err(AppError::Idem(e @ idem::Error::InProgress)) => assert_eq!(e.http_status(), 409),
        other => panic!("expected in progress, got {other:?}"),
    }
    // A different request under the key is refused even while it runs.
    let result = send(&env.pool, &send_cmd("x-1", 31), &target).await;
    assert!(matches_idem(&result, "FingerprintMismatch"), "{result:?}");
    // A duplicate that may wait gets the first request's result.
    let waiting = {
        let (env, target) = (env.clone(), target.clone());
        tokio::spawn(async move { send_waiting(&env.pool, &send_cmd("x-1", 30), &target).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiting.is_finished(),
        "the duplicate waits while the first runs"
    );
    target.release.add_permits(1);
    let first = first.await.unwrap().unwrap();
    assert!(!first.replayed);
    assert_eq!(first.value, "receipt:x-1", "the body read its key");
    let waited = waiting.await.unwrap().unwrap();
    assert!(waited.replayed);
    assert_eq!(waited.value, first.value);
    assert_eq!(
        target.script.calls(),
        1,
        "the outside system was called once"
    );
    assert_eq!(env.effects("sent:x-1").await, 1);
    let (state, outcome, response) = env.record("x-1").await.unwrap();
    assert_eq!(
        (state.as_str(), outcome.as_deref(), response.as_deref()),
        ("completed", Some("ok"), Some("\"receipt:x-1\""))
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM idem_requests WHERE lease_until IS NOT NULL")
            .await,
        0
    );
    assert_eq!(
        *target.script.keys.lock().unwrap(),
        [Some("x-1".to_owned())],
        "current_key() in the body"
    );
    assert_eq!(current_key(), None, "outside a body there is no key");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_external_duplicates_call_the_target_once() {
    let env = Arc::new(env(10).await);
    let target = Arc::new(Target::held());
    let barrier = Arc::new(Barrier::new(20));
    let tasks: Vec<_> = (0..20)
        .map(|_| {
            let (env, target, barrier) = (env.clone(), target.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                send_waiting(&env.pool, &send_cmd("x-crowd", 5), &target).await
            })
        })
        .collect();
    target.wait_started().await;
    // Let the others find the claim while the call is out.
    tokio::time::sleep(Duration::from_millis(200)).await;
    target.release.add_permits(1);
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(
            task.await
                .unwrap()
                .expect("every duplicate gets the answer"),
        );
    }
    assert_eq!(answers.iter().filter(|a| !a.replayed).count(), 1);
    assert!(answers.iter().all(|a| a.value == "receipt:x-crowd"));
    assert_eq!(target.script.calls(), 1, "the target was called once");
    assert_eq!(
        target.started.available_permits(),
        0,
        "no second call started"
    );
    assert_eq!(env.effects("sent:x-crowd").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn external_failures_release_or_keep_the_key_until_settled() {
    let env = env(4).await;
    let target = Target::default();

    // Nothing was sent: the key is released and a retry runs.
    target.script.push(Step::Invalid);
    let result = send(&env.pool, &send_cmd("x-released", 1), &target).await;
    assert!(matches!(result, Err(AppError::Invalid)), "{result:?}");
    assert_eq!(env.record("x-released").await, None);
    let retried = send(&env.pool, &send_cmd("x-released", 1), &target)
        .await
        .unwrap();
    assert!(!retried.replayed);
    assert_eq!(target.script.calls(), 2);

    // The outcome is unknown: the key is kept, and nobody runs it again.
    target.script.push(Step::Timeout);
    let result = send(&env.pool, &send_cmd("x-unknown", 2), &target).await;
    assert!(matches!(result, Err(AppError::Timeout)), "{result:?}");
    assert_eq!(target.script.calls(), 3);
    assert_eq!(env.state("x-unknown").await.as_deref(), Some("unknown"));
    for _ in 0..3 {
        let result = send(&env.pool, &send_cmd("x-unknown", 2), &target).await;
        match &result {
            Err(AppError::Idem(e @ idem::Error::OutcomeUnknown)) => assert_eq!(
                e.to_string(),
                "the request may have reached the target system; its outcome is decided there; not retried"
            ),
            other => panic!("expected outcome unknown, got {other:?}"),
        }
    }
    assert_eq!(
        OUTCOME_UNKNOWN_MESSAGE,
        "the request may have reached the target system; its outcome is decided there; not retried"
    );
    assert_eq!(target.script.calls(), 3, "never re-run");
    // The body's own writes of the failed attempt were rolled back.
    assert_eq!(env.effects("sent:x-unknown").await, 0);

    // Reconciled as done: later callers get the settled response.
    let settled = settle(
        &env.pool,
        &(),
        "x-unknown",
        Settlement::Completed(serde_json::json!("receipt:from-the-psp")),
    )
    .await
    .unwrap();
    assert!(settled);
    let replay = send(&env.pool, &send_cmd("x-unknown", 2), &target)
        .await
        .unwrap();
    assert!(replay.replayed);
    assert_eq!(replay.value, "receipt:from-the-psp");
    assert_eq!(target.script.calls(), 3);
    // A completed record is not settled again.
    assert!(!settle(&env.pool, &(), "x-unknown", Settlement::Released)
        .await
        .unwrap());

    // Reconciled as not done: the key is released and a retry runs.
    target.script.push(Step::Timeout);
    let result = send(&env.pool, &send_cmd("x-lost", 3), &target).await;
    assert!(matches!(result, Err(AppError::Timeout)), "{result:?}");
    assert!(matches_idem(
        &send(&env.pool, &send_cmd("x-lost", 3), &target).await,
        "OutcomeUnknown"
    ));
    assert!(settle(&env.pool, &(), "x-lost", Settlement::Released)
        .await
        .unwrap());
    let rerun = send(&env.pool, &send_cmd("x-lost", 3), &target)
        .await
        .unwrap();
    assert!(!rerun.replayed);
    assert_eq!(rerun.value, "receipt:x-lost");
    assert_eq!(target.script.calls(), 5);

    // A final error is stored and replayed, as in local mode.
    target.script.push(Step::Declined);
    for _ in 0..2 {
        let result = send(&env.pool, &send_cmd("x-declined", 4), &target).await;
        assert!(matches!(result, Err(AppError::Declined(_))), "{result:?}");
    }
    assert_eq!(target.script.calls(), 6);
    let (state, outcome, _) = env.record("x-declined").await.unwrap();
    assert_eq!(
        (state.as_str(), outcome.as_deref()),
        ("completed", Some("error"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_expired_lease_is_outcome_unknown_never_a_rerun() {
    let env = Arc::new(env(6).await);
    let target = Arc::new(Target::held());
    let first = {
        let (env, target) = (env.clone(), target.clone());
        tokio::spawn(async move { send_leased(&env.pool, &send_cmd("x-lease", 9), &target).await })
    };
    target.wait_started().await;
    // Once the lease ran out the outcome is unknown: the body may still be
    // talking to the target.
    let until = Instant::now() + Duration::from_secs(20);
    while env
        .scalar("SELECT count(*) FROM idem_requests WHERE key = 'x-lease' AND lease_until < now()")
        .await
        == 0
    {
        assert!(Instant::now() < until, "the lease never ran out");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for duplicate in 0..3 {
        let result = match duplicate {
            0 => send(&env.pool, &send_cmd("x-lease", 9), &target).await,
            1 => send_leased(&env.pool, &send_cmd("x-lease", 9), &target).await,
            // Even one that may wait is told at once.
            _ => send_waiting(&env.pool, &send_cmd("x-lease", 9), &target).await,
        };
        assert!(matches_idem(&result, "OutcomeUnknown"), "{result:?}");
    }
    assert_eq!(target.script.calls(), 0, "the first body has not answered");
    assert_eq!(
        target.started.available_permits(),
        0,
        "no second body started"
    );
    // The purge records it as unknown; it does not drop it.
    let mut conn = AsyncPgConnection::establish(env.db.url()).await.unwrap();
    let report = purge_expired(&mut conn, 10).await.unwrap();
    assert_eq!(
        (report.deleted, report.marked_unknown, report.unknown),
        (0, 1, 1)
    );
    assert_eq!(env.state("x-lease").await.as_deref(), Some("unknown"));
    let result = send(&env.pool, &send_cmd("x-lease", 9), &target).await;
    assert!(matches_idem(&result, "OutcomeUnknown"), "{result:?}");
    // When the first request does learn its outcome, it is recorded.
    target.release.add_permits(1);
    let first = first.await.unwrap().unwrap();
    assert!(!first.replayed);
    let replay = send(&env.pool, &send_cmd("x-lease", 9), &target)
        .await
        .unwrap();
    assert!(replay.replayed);
    assert_eq!(replay.value, first.value);
    assert_eq!(target.script.calls(), 1);
    assert_eq!(env.effects("sent:x-lease").await, 1);
}

// ---------------------------------------------------------------------------
// Retention and purge
// ---------------------------------------------------------------------------

#[idempotent(key = key, fingerprint(n), ttl_s = 1)]
async fn short_lived(
    conn: &mut AsyncPgConnection,
    key: &str,
    n: i64,
    script: &Script,
) -> Result<i64, AppError> {
    let id = insert_effect(conn, "short", n).await?;
    script.run(conn).await?;
    Ok(id)
}

async fn wait_until_expired(env: &Env, key: &str) {
    let until = Instant::now() + Duration::from_secs(20);
    while env
        .client
        .query_one(
            "SELECT count(*) FROM idem_requests WHERE key = $1 AND expires_at <= now()",
            &[&key],
        )
        .await
        .unwrap()
        .get::<_, i64>(0)
        == 0
    {
        assert!(Instant::now() < until, "{key} never expired");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_its_retention_a_key_is_new() {
    let env = Arc::new(env(10).await);
    let script = Arc::new(Script::default());
    let first = short_lived(&env.pool, "r-1", 1, &script).await.unwrap();
    assert!(!first.replayed);
    let expiry: f64 = env
        .client
        .query_one(
            "SELECT extract(epoch FROM expires_at - created_at)::float8 FROM idem_requests WHERE key = 'r-1'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(expiry, 1.0, "ttl_s = 1");
    let replay = short_lived(&env.pool, "r-1", 1, &script).await.unwrap();
    assert!(replay.replayed);
    assert!(matches_idem(
        &short_lived(&env.pool, "r-1", 2, &script).await,
        "FingerprintMismatch"
    ));

    wait_until_expired(&env, "r-1").await;
    // Reused after expiry, even for another request: new, and run once, by
    // one of several requests racing to take the expired record over.
    let barrier = Arc::new(Barrier::new(10));
    let racers: Vec<_> = (0..10)
        .map(|_| {
            let (env, script, barrier) = (env.clone(), script.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                short_lived(&env.pool, "r-1", 2, &script).await
            })
        })
        .collect();
    let mut answers = Vec::new();
    for racer in racers {
        answers.push(racer.await.unwrap().unwrap());
    }
    let reused: Vec<_> = answers.iter().filter(|a| !a.replayed).collect();
    assert_eq!(reused.len(), 1, "one request took the expired key over");
    let reused = reused[0].clone();
    assert!(answers.iter().all(|a| a.value == reused.value));
    assert_ne!(reused.value, first.value);
    assert_eq!(script.calls(), 2);
    assert_eq!(
        env.records().await,
        1,
        "the record was taken over, not duplicated"
    );
    // The key now belongs to the new request.
    assert!(
        short_lived(&env.pool, "r-1", 2, &script)
            .await
            .unwrap()
            .replayed
    );
    assert!(matches_idem(
        &short_lived(&env.pool, "r-1", 1, &script).await,
        "FingerprintMismatch"
    ));
    assert_eq!(env.effects("short").await, 2);

    // Once expired, the purge drops it.
    wait_until_expired(&env, "r-1").await;
    let mut conn = AsyncPgConnection::establish(env.db.url()).await.unwrap();
    let report = purge_expired(&mut conn, 100).await.unwrap();
    assert_eq!(report.deleted, 1);
    assert_eq!(env.records().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn purge_deletes_expired_completed_records_in_batches_and_keeps_the_rest() {
    let env = env(1).await;
    // Every DELETE statement on the table logs how many rows it deleted.
    env.client
        .batch_execute(
            "CREATE TABLE purge_log (id bigserial PRIMARY KEY, deleted bigint NOT NULL);
             CREATE FUNCTION log_purge() RETURNS trigger LANGUAGE plpgsql AS
                 $$ BEGIN INSERT INTO purge_log (deleted) SELECT count(*) FROM gone; RETURN NULL; END $$;
             CREATE TRIGGER log_purge AFTER DELETE ON idem_requests
                 REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION log_purge();",
        )
        .await
        .unwrap();
    let insert = |prefix: &'static str,
                  n: i32,
                  state: &'static str,
                  outcome: &'static str,
                  expires: &'static str,
                  lease: &'static str| {
        format!(
            "INSERT INTO idem_requests (scope, key, operation, fingerprint, mode, state, outcome, response, expires_at, lease_until)
             SELECT 'null', '{prefix}-' || i, 'op', sha256(i::text::bytea), 'local', '{state}', {outcome},
                    CASE WHEN {outcome} IS NULL THEN NULL ELSE '1'::jsonb END, now() + {expires}, {lease}
             FROM generate_series(1, {n}) AS i"
        )
    };
    for statement in [
        insert(
            "expired",
            50,
            "completed",
            "'ok'",
            "interval '-1 minute'",
            "NULL",
        ),
        insert(
            "expired-error",
            3,
            "completed",
            "'error'",
            "interval '-1 second'",
            "NULL",
        ),
        insert("live", 5, "completed", "'ok'", "interval '1 hour'", "NULL"),
        insert(
            "lease-out",
            4,
            "in_progress",
            "NULL",
            "interval '-1 minute'",
            "now() - interval '1 second'",
        ),
        insert(
            "leased",
            3,
            "in_progress",
            "NULL",
            "interval '-1 minute'",
            "now() + interval '1 hour'",
        ),
        insert(
            "unknown",
            6,
            "unknown",
            "NULL",
            "interval '-1 minute'",
            "NULL",
        ),
    ] {
        env.client.batch_execute(&statement).await.unwrap();
    }
    let mut conn = AsyncPgConnection::establish(env.db.url()).await.unwrap();
    let report = purge_expired(&mut conn, 7).await.unwrap();
    assert_eq!(report.deleted, 53);
    assert_eq!(report.marked_unknown, 4);
    assert_eq!(report.unknown, 10);
    let batches: Vec<i64> = env
        .client
        .query(
            "SELECT deleted FROM purge_log WHERE deleted > 0 ORDER BY id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        batches,
        [7, 7, 7, 7, 7, 7, 7, 4],
        "53 rows, 7 per statement"
    );
    let left: Vec<(String, i64)> = env
        .client
        .query(
            "SELECT split_part(key, '-', 1) || ':' || state, count(*) FROM idem_requests GROUP BY 1 ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        left,
        [
            ("lease:unknown".to_owned(), 4),
            ("leased:in_progress".to_owned(), 3),
            ("live:completed".to_owned(), 5),
            ("unknown:unknown".to_owned(), 6),
        ]
    );
    // Nothing more to do: a second purge deletes and marks nothing.
    let again = purge_expired(&mut conn, 7).await.unwrap();
    assert_eq!(
        (again.deleted, again.marked_unknown, again.unknown),
        (0, 0, 10)
    );
}

// ---------------------------------------------------------------------------
// The stored response is bounded
// ---------------------------------------------------------------------------

#[idempotent(key = key, fingerprint(len), max_response_bytes = 100)]
async fn sized(conn: &mut AsyncPgConnection, key: &str, len: usize) -> Result<String, AppError> {
    insert_effect(conn, "sized", len as i64).await?;
    Ok("x".repeat(len))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_oversized_response_commits_nothing() {
    let env = env(2).await;
    // 99 characters are 101 bytes of JSON.
    let result = sized(&env.pool, "big", 99).await;
    match &result {
        Err(AppError::Idem(idem::Error::ResponseTooLarge { size, limit })) => {
            assert_eq!((*size, *limit), (101, 100))
        }
        other => panic!("expected a response too large, got {other:?}"),
    }
    assert_eq!(env.effects("sized").await, 0, "no business row");
    assert_eq!(env.records().await, 0, "no record");
    // The key was not used up: a request that fits (exactly) runs under it.
    let fits = sized(&env.pool, "big", 98).await.unwrap();
    assert!(!fits.replayed);
    assert_eq!(fits.value.len(), 98);
    assert!(sized(&env.pool, "big", 98).await.unwrap().replayed);
    assert_eq!(env.effects("sized").await, 1);
}

// ---------------------------------------------------------------------------
// Bad input: refused before anything is written
// ---------------------------------------------------------------------------

struct OptCmd {
    key: Option<String>,
    n: i64,
}

#[idempotent(key = cmd.key, fingerprint(cmd.n))]
async fn optional_key(conn: &mut AsyncPgConnection, cmd: &OptCmd) -> Result<i64, AppError> {
    insert_effect(conn, "optional", cmd.n).await
}

#[idempotent(key = key, fingerprint(grid))]
async fn with_grid(
    conn: &mut AsyncPgConnection,
    key: &str,
    grid: &HashMap<(i32, i32), i32>,
) -> Result<i64, AppError> {
    insert_effect(conn, "grid", grid.len() as i64).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_input_is_refused_before_anything_is_written() {
    let env = env(2).await;
    let script = Script::default();
    let long = "k".repeat(256);
    // 128 two-byte characters: 256 bytes.
    let long_utf8 = "é".repeat(128);
    for (key, reason) in [
        ("", "empty"),
        (long.as_str(), "longer than 255 bytes"),
        (long_utf8.as_str(), "longer than 255 bytes"),
        ("a\u{7}b", "control"),
        ("line\nbreak", "control"),
        ("tab\t", "control"),
    ] {
        let result = charge(&env.pool, key, 1, &script).await;
        match &result {
            Err(AppError::Idem(e @ idem::Error::InvalidKey { .. })) => {
                assert_eq!(e.http_status(), 400);
                assert!(e.to_string().contains(reason), "{e} for {key:?}");
            }
            other => panic!("expected an invalid key for {key:?}, got {other:?}"),
        }
    }
    assert_eq!(script.calls(), 0);

    let result = optional_key(&env.pool, &OptCmd { key: None, n: 1 }).await;
    match &result {
        Err(AppError::Idem(e @ idem::Error::MissingKey)) => assert_eq!(e.http_status(), 400),
        other => panic!("expected a missing key, got {other:?}"),
    }

    let grid: HashMap<(i32, i32), i32> = [((1, 2), 3)].into_iter().collect();
    let result = with_grid(&env.pool, "grid-1", &grid).await;
    match &result {
        Err(AppError::Idem(e @ idem::Error::Unserializable { .. })) => {
            assert!(e.to_string().contains("fingerprint field `grid`"), "{e}")
        }
        other => panic!("expected an unserializable fingerprint, got {other:?}"),
    }

    assert_eq!(env.records().await, 0);
    assert_eq!(env.scalar("SELECT count(*) FROM effects").await, 0);

    // The longest key there is, and an optional key that is given, are fine.
    let longest = "k".repeat(255);
    assert!(
        !charge(&env.pool, &longest, 1, &script)
            .await
            .unwrap()
            .replayed
    );
    let given = OptCmd {
        key: Some("opt-1".into()),
        n: 1,
    };
    assert!(!optional_key(&env.pool, &given).await.unwrap().replayed);
    assert!(optional_key(&env.pool, &given).await.unwrap().replayed);
    assert_eq!(env.records().await, 2);
}

// ---------------------------------------------------------------------------
// Stacking with #[retryable], in both orders
// ---------------------------------------------------------------------------

#[idempotent(key = key, fingerprint(n))]
#[retryable(max = 5, deadline_ms = 30000, backoff_base_ms = 1, backoff_cap_ms = 10)]
async fn idempotent_over_retryable(
    conn: &mut AsyncPgConnection,
    key: &str,
    n: i64,
    script: &Script,
) -> Result<i64, AppError> {
    let id = insert_effect(conn, "stacked", n).await?;
    script.run(conn).await?;
    Ok(id)
}

#[retryable(max = 5, deadline_ms = 30000, backoff_base_ms = 1, backoff_cap_ms = 10)]
#[idempotent(key = key, fingerprint(n))]
async fn retryable_over_idempotent(
    conn: &mut AsyncPgConnection,
    key: &str,
    n: i64,
    script: &Script,
) -> Result<i64, AppError> {
    let id = insert_effect(conn, "stacked", n).await?;
    script.run(conn).await?;
    Ok(id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn both_stacking_orders_retry_conflicts_and_record_once() {
    let env = env(2).await;
    for (order, key) in [(0, "stack-idem-first"), (1, "stack-retry-first")] {
        let script = Script::new(&[Step::SerializationFailure, Step::Stale]);
        let call = || async {
            match order {
                0 => idempotent_over_retryable(&env.pool, key, 5, &script).await,
                _ => retryable_over_idempotent(&env.pool, key, 5, &script).await,
            }
        };
        let first = call().await.unwrap();
        assert!(!first.replayed, "{key}");
        assert_eq!(script.calls(), 3, "{key}: a 40001, a Stale, then success");
        // Only the last attempt's write, and its record, committed.
        let (id, n): (i64, i64) = {
            let row = env
                .client
                .query_one(
                    "SELECT max(id), count(*) FROM effects WHERE tag = 'stacked'",
                    &[],
                )
                .await
                .unwrap();
            (row.get(0), row.get(1))
        };
        assert_eq!((n, id), ((order + 1) as i64, first.value), "{key}");
        let (state, outcome, response) = env.record(key).await.unwrap();
        assert_eq!(
            (state.as_str(), outcome.as_deref(), response),
            ("completed", Some("ok"), Some(first.value.to_string())),
            "{key}"
        );
        let replay = call().await.unwrap();
        assert!(replay.replayed, "{key}");
        assert_eq!(replay.value, first.value);
        assert_eq!(script.calls(), 3, "{key}");
    }
    assert_eq!(env.records().await, 2);
}
