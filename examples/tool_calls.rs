//! An agent's tool calls that arrive twice (seed 001): the second arrival of
//! a write is answered with the first one's result, marked
//! `{ id, idempotent: true }`, instead of writing again.
//!
//! `cargo run --example tool_calls` (PostgreSQL: `DATABASE_URL`, else
//! 127.0.0.1:5432, else a throwaway cluster from the installed server binaries).
//!
//! No key is passed: it is derived as sha256(who : conversation : tool :
//! canonical arguments), so the same call with its arguments in another key
//! order is the same call, while another user or conversation is another one.
//!
//! 1. `notes.create` writes one row; its second arrival is a replay.
//! 2. `tasks.plan` writes three rows; its replay hands back all three.
//! 3. `payments.refund` calls another system (`mode = external`): a local HTTP
//!    stub that counts calls and never answers. The call times out, so its
//!    outcome is unknown there: the key stays held, later arrivals are told
//!    the request may have reached the target, and the stub is called once.

#[path = "common/mod.rs"]
mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use diesel::prelude::*;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idem::idempotency::current_key;
use idem::{idempotent, Deferred};
use serde::{Deserialize, Serialize};
use serde_json::Value;

diesel::table! {
    tool_calls_notes (id) {
        id -> Int8,
        title -> Text,
        body -> Text,
    }
}

diesel::table! {
    tool_calls_tasks (id) {
        id -> Int8,
        plan -> Text,
        title -> Text,
    }
}

const SCHEMA: &str = "
    DROP TABLE IF EXISTS tool_calls_notes;
    DROP TABLE IF EXISTS tool_calls_tasks;
    CREATE TABLE tool_calls_notes (
        id    bigserial PRIMARY KEY,
        title text NOT NULL,
        body  text NOT NULL
    );
    CREATE TABLE tool_calls_tasks (
        id    bigserial PRIMARY KEY,
        plan  text NOT NULL,
        title text NOT NULL
    );
";

const USER: &str = "tool_calls-example-user";
const CONVERSATION: &str = "conversation-1";
/// How long the external tool waits for its target.
const TARGET_TIMEOUT: Duration = Duration::from_millis(300);

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Db(#[from] diesel::result::Error),
    #[error(transparent)]
    Idem(#[from] idem::Error),
    #[error("bad arguments: {0}")]
    BadArguments(String),
    #[error("no answer from the target within {0:?}: its outcome is unknown")]
    TargetTimeout(Duration),
    #[error("the call to the target failed: {0}")]
    Target(std::io::Error),
}

idem::final_errors!(AppError);

/// One tool call as the agent sends it: who, in which conversation, with
/// which arguments. The tool is the function called.
struct ToolCall {
    user: String,
    conversation: String,
    args: Value,
}

impl ToolCall {
    /// Arguments as the model wrote them, key order included.
    fn new(args: &str) -> ToolCall {
        ToolCall {
            user: USER.to_owned(),
            conversation: CONVERSATION.to_owned(),
            args: serde_json::from_str(args).expect("arguments are JSON"),
        }
    }

    fn arg(&self, name: &str) -> Result<&str, AppError> {
        self.args[name]
            .as_str()
            .ok_or_else(|| AppError::BadArguments(format!("`{name}` must be a string")))
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct NoteCreated {
    id: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Task {
    id: i64,
    title: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Refund {
    refund_id: String,
}

/// A tool with one local write.
#[idempotent(
    scope = (&call.user, &call.conversation),
    operation = "notes.create",
    fingerprint(call.args)
)]
async fn create_note(
    conn: &mut AsyncPgConnection,
    call: &ToolCall,
) -> Result<NoteCreated, AppError> {
    let id = diesel::insert_into(tool_calls_notes::table)
        .values((
            tool_calls_notes::title.eq(call.arg("title")?),
            tool_calls_notes::body.eq(call.arg("body")?),
        ))
        .returning(tool_calls_notes::id)
        .get_result(conn)
        .await?;
    Ok(NoteCreated { id })
}

/// A tool whose one call writes several rows: the record holds them all, so a
/// replay hands back the whole set, not just the first row.
#[idempotent(
    scope = (&call.user, &call.conversation),
    operation = "tasks.plan",
    fingerprint(call.args)
)]
async fn plan_tasks(conn: &mut AsyncPgConnection, call: &ToolCall) -> Result<Vec<Task>, AppError> {
    let plan = call.arg("plan")?;
    let titles: Vec<&str> = call.args["tasks"]
        .as_array()
        .ok_or_else(|| AppError::BadArguments("`tasks` must be a list".to_owned()))?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let rows: Vec<_> = titles
        .iter()
        .map(|t| {
            (
                tool_calls_tasks::plan.eq(plan),
                tool_calls_tasks::title.eq(*t),
            )
        })
        .collect();
    let written: Vec<(i64, String)> = diesel::insert_into(tool_calls_tasks::table)
        .values(rows)
        .returning((tool_calls_tasks::id, tool_calls_tasks::title))
        .get_results(conn)
        .await?;
    Ok(written
        .into_iter()
        .map(|(id, title)| Task { id, title })
        .collect())
}

/// A tool that calls another system: the claim commits before the call, and a
/// call whose outcome is unknown keeps it.
#[idempotent(
    scope = (&call.user, &call.conversation),
    operation = "payments.refund",
    fingerprint(call.args),
    mode = external,
    lease_ms = 500
)]
async fn refund(db: &mut Deferred<'_>, call: &ToolCall) -> Result<Refund, AppError> {
    // Nothing of the database is held during the call: the claim committed
    // before it, and the outcome's transaction begins only if the body asks
    // (`db.conn().await?`) or when idem records the response.
    let _ = db;
    let order = call.arg("order")?.to_owned();
    let key = current_key().expect("the body of an idempotent fn runs under its key");
    let target = TARGET.get().copied().expect("the stub is running");
    let refund_id = tokio::task::spawn_blocking(move || post_refund(target, &order, &key))
        .await
        .expect("the HTTP call did not panic")
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                AppError::TargetTimeout(TARGET_TIMEOUT)
            }
            _ => AppError::Target(e),
        })?;
    Ok(Refund { refund_id })
}

static TARGET: std::sync::OnceLock<SocketAddr> = std::sync::OnceLock::new();

/// A hand-written HTTP/1.1 POST that passes the idempotency key on, so the
/// target can deduplicate too (the end-to-end half no client can promise).
fn post_refund(target: SocketAddr, order: &str, key: &str) -> std::io::Result<String> {
    let mut stream = TcpStream::connect_timeout(&target, TARGET_TIMEOUT)?;
    stream.set_read_timeout(Some(TARGET_TIMEOUT))?;
    let body = serde_json::json!({ "order": order }).to_string();
    write!(
        stream,
        "POST /refunds HTTP/1.1\r\nHost: {target}\r\nIdempotency-Key: {key}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    Ok(response
        .rsplit("\r\n\r\n")
        .next()
        .unwrap_or_default()
        .to_owned())
}

/// The target system: counts the requests it receives and the keys they
/// carry, and never answers.
#[derive(Default)]
struct Stub {
    calls: AtomicUsize,
    keys: Mutex<Vec<String>>,
}

fn start_stub() -> std::io::Result<(SocketAddr, Arc<Stub>)> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let stub = Arc::new(Stub::default());
    let seen = Arc::clone(&stub);
    std::thread::spawn(move || {
        // Held open, unanswered, for as long as the process lives.
        let mut held = Vec::new();
        for stream in listener.incoming().flatten() {
            let mut reader = BufReader::new(stream);
            let mut key = None;
            let mut line = String::new();
            while reader.read_line(&mut line).is_ok_and(|n| n > 0) && line != "\r\n" {
                if let Some((name, value)) = line.split_once(':') {
                    if name.eq_ignore_ascii_case("idempotency-key") {
                        key = Some(value.trim().to_owned());
                    }
                }
                line.clear();
            }
            seen.keys.lock().unwrap().push(key.unwrap_or_default());
            seen.calls.fetch_add(1, Ordering::SeqCst);
            held.push(reader);
        }
    });
    Ok((addr, stub))
}

fn marked(id: impl std::fmt::Display, replayed: bool) -> String {
    format!("{{ id: {id}, idempotent: {replayed} }}")
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = common::database_url().await;
    let mut conn = AsyncPgConnection::establish(&url).await?;
    idem::migrate(&mut conn).await?;
    conn.batch_execute(SCHEMA).await?;
    // This example's key space (its user and conversation) starts empty too.
    diesel::sql_query("DELETE FROM idem_requests WHERE scope = $1")
        .bind::<diesel::sql_types::Text, _>(idem::idempotency::scope_hash(&(USER, CONVERSATION))?)
        .execute(&mut conn)
        .await?;
    let pool = idem::pool::build_pool(&url)?;
    let (target, stub) = start_stub()?;
    TARGET.set(target).expect("set once");

    // 1. The same call twice, its arguments in another key order.
    let first_args = r#"{"title": "groceries", "body": "milk, eggs"}"#;
    let again_args = r#"{"body": "milk, eggs", "title": "groceries"}"#;
    let first = create_note(&pool, &ToolCall::new(first_args)).await?;
    let again = create_note(&pool, &ToolCall::new(again_args)).await?;
    println!(
        "notes.create {first_args} -> {}",
        marked(first.id, first.replayed)
    );
    println!(
        "notes.create {again_args} -> {}",
        marked(again.id, again.replayed)
    );
    assert_eq!(first.id, again.id, "the replay is the first call's result");
    let replays = [&first, &again].iter().filter(|a| a.replayed).count();
    let writes: i64 = tool_calls_notes::table
        .count()
        .get_result(&mut conn)
        .await?;

    // 2. A call that writes three rows, twice.
    let plan_args = r#"{"plan": "trip", "tasks": ["book flight", "book hotel", "pack"]}"#;
    let planned = plan_tasks(&pool, &ToolCall::new(plan_args)).await?;
    let replanned = plan_tasks(&pool, &ToolCall::new(plan_args)).await?;
    let ids = |tasks: &[Task]| tasks.iter().map(|t| t.id).collect::<Vec<_>>();
    for answer in [&planned, &replanned] {
        println!(
            "tasks.plan {plan_args} -> {} ({} rows)",
            marked(format!("{:?}", ids(answer)), answer.replayed),
            answer.len()
        );
    }
    let task_rows: i64 = tool_calls_tasks::table
        .count()
        .get_result(&mut conn)
        .await?;
    assert!(
        replanned.replayed && task_rows == 3,
        "three rows, written once"
    );
    let compound_rows_replayed = replanned.value.len();

    // 3. A call to another system that times out, then arrives again.
    let refund_args = r#"{"order": "order-1001", "amount": 3000}"#;
    for arrival in ["first", "second", "third"] {
        match refund(&pool, &ToolCall::new(refund_args)).await {
            Ok(r) => panic!("the stub never answers, yet got {:?}", r.value),
            Err(e) => println!("payments.refund ({arrival} arrival) -> {e}"),
        }
        if arrival == "second" {
            // Past the lease, too, the key stays held: never an automatic re-run.
            tokio::time::sleep(Duration::from_millis(600)).await;
        }
    }
    let unknown = refund(&pool, &ToolCall::new(refund_args)).await;
    assert!(matches!(
        unknown,
        Err(AppError::Idem(idem::Error::OutcomeUnknown))
    ));
    let external_calls = AtomicUsize::load(&stub.calls, Ordering::SeqCst);
    let keys = stub.keys.lock().unwrap().clone();
    println!("stub: {external_calls} call(s), Idempotency-Key {keys:?}");

    println!(
        "writes={writes} replays={replays} compound_rows_replayed={compound_rows_replayed} external_calls={external_calls}"
    );
    Ok(())
}
