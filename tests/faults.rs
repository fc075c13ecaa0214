//! Faults on the wire, through a TCP proxy between idem and a real
//! PostgreSQL: a connection lost before a statement reaches the server, an
//! answer to `COMMIT` that never arrives (the server committed), a `COMMIT`
//! held on its way, pooled connections that all break at once; and a response
//! built to break SQL quoting. Every effect
//! is counted in the database through a connection of its own, never taken
//! from idem's own report.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idem::http::HttpStatus;
use idem::pool::{build_pool_with, PoolConfig};
use idem::{idempotent, retryable, Deferred, Pool};
use idem_testing::proxy::{Fault, Proxy};
use idem_testing::TestDatabase;
use serde::{Deserialize, Serialize};

/// A simple query that is exactly `COMMIT` (not `READ COMMITTED`).
const COMMIT: &str = "COMMIT\0";
/// The statement that writes a local request's completed record, as prepared.
const RECORD: &str = "INSERT INTO idem_requests AS r (scope, scope_label, key, operation";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
enum Declined {
    Refused,
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] idem::Error),
    #[error(transparent)]
    Db(#[from] diesel::result::Error),
    #[error("declined: {0:?}")]
    Declined(Declined),
}
idem::final_errors!(AppError::Declined(Declined));

struct Env {
    db: TestDatabase,
    proxy: Proxy,
    pool: Pool,
    client: tokio_postgres::Client,
}

async fn env(pool_size: usize) -> Env {
    let db = TestDatabase::create().await.expect("a test database");
    let mut conn = AsyncPgConnection::establish(db.url())
        .await
        .expect("connect");
    idem::migrate(&mut conn).await.expect("migrate");
    conn.batch_execute("CREATE TABLE effects (id bigserial PRIMARY KEY, tag text NOT NULL)")
        .await
        .expect("schema");
    let proxy = Proxy::start(db.url()).await.expect("the proxy");
    let pool = build_pool_with(
        proxy.url(),
        &PoolConfig {
            max_size: pool_size,
            wait_timeout: Duration::from_secs(10),
            ..Default::default()
        },
    )
    .expect("a pool through the proxy");
    // Side reads go straight to the server.
    let client = idem_testing::connect(db.url())
        .await
        .expect("a side client");
    Env {
        db,
        proxy,
        pool,
        client,
    }
}

impl Env {
    async fn effects(&self, tag: &str) -> i64 {
        self.client
            .query_one("SELECT count(*) FROM effects WHERE tag = $1", &[&tag])
            .await
            .expect("count effects")
            .get(0)
    }

    /// `(state, outcome)` of a key's record.
    async fn record(&self, key: &str) -> Option<(String, Option<String>)> {
        self.client
            .query_opt(
                "SELECT state::text, outcome::text FROM idem_requests WHERE key = $1",
                &[&key],
            )
            .await
            .expect("read the record")
            .map(|row| (row.get(0), row.get(1)))
    }
}

async fn insert_effect(conn: &mut AsyncPgConnection, tag: &str) -> Result<i64, AppError> {
    #[derive(diesel::QueryableByName)]
    struct Id {
        #[diesel(sql_type = BigInt)]
        id: i64,
    }
    let row: Id = diesel::sql_query("INSERT INTO effects (tag) VALUES ($1) RETURNING id")
        .bind::<Text, _>(tag)
        .get_result(conn)
        .await?;
    Ok(row.id)
}

#[retryable(max = 3, deadline_ms = 10000)]
async fn write(conn: &mut AsyncPgConnection, tag: &str) -> Result<i64, AppError> {
    insert_effect(conn, tag).await
}

#[idempotent(key = key, fingerprint(tag), scope = none)]
#[retryable(max = 3, deadline_ms = 10000)]
async fn write_once(conn: &mut AsyncPgConnection, key: &str, tag: &str) -> Result<i64, AppError> {
    insert_effect(conn, tag).await
}

#[idempotent(key = key, fingerprint(tag), scope = none)]
#[retryable(max = 3, deadline_ms = 10000)]
async fn decline(conn: &mut AsyncPgConnection, key: &str, tag: &str) -> Result<i64, AppError> {
    insert_effect(conn, tag).await?;
    Err(AppError::Declined(Declined::Refused))
}

/// An outside call counted in `calls`, then the local write.
#[idempotent(key = key, fingerprint(tag), mode = external, scope = none)]
#[retryable(max = 3, deadline_ms = 10000, commit_timeout_ms = 200)]
async fn send(
    db: &mut Deferred<'_>,
    key: &str,
    tag: &str,
    calls: &AtomicU32,
) -> Result<i64, AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    insert_effect(db.conn().await?, tag).await
}

/// No #[retryable]: one attempt of the body, yet a stale pooled connection
/// met before anything ran costs nothing.
#[idempotent(key = key, fingerprint(tag), scope = none)]
async fn write_once_plain(
    conn: &mut AsyncPgConnection,
    key: &str,
    tag: &str,
) -> Result<i64, AppError> {
    insert_effect(conn, tag).await
}

#[idempotent(key = key, fingerprint(tag), mode = external, scope = none)]
async fn send_plain(
    db: &mut Deferred<'_>,
    key: &str,
    tag: &str,
    calls: &AtomicU32,
) -> Result<i64, AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    insert_effect(db.conn().await?, tag).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_commit_answer_is_commit_unknown_and_the_key_tells_what_happened() {
    let env = env(2).await;
    // Plain #[retryable]: the server committed, the caller cannot know.
    env.proxy.arm(COMMIT, Fault::CutAfter);
    let result = write(&env.pool, "plain").await;
    match &result {
        Err(AppError::Idem(e @ idem::Error::CommitUnknown { .. })) => {
            assert_eq!(e.http_status(), 503)
        }
        other => panic!("expected commit unknown, got {other:?}"),
    }
    assert_eq!(env.effects("plain").await, 1, "the server committed it");

    // #[idempotent(scope = none)]: the same, and the same key again returns what committed.
    env.proxy.arm(COMMIT, Fault::CutAfter);
    let result = write_once(&env.pool, "k-1", "keyed").await;
    assert!(
        matches!(
            result,
            Err(AppError::Idem(idem::Error::CommitUnknown { .. }))
        ),
        "{result:?}"
    );
    let again = write_once(&env.pool, "k-1", "keyed")
        .await
        .expect("a replay");
    assert!(again.replayed);
    assert_eq!(env.effects("keyed").await, 1, "one effect, once");
    assert_eq!(env.proxy.fired(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_lost_on_its_way_is_commit_unknown_and_the_key_runs_once() {
    let env = env(2).await;
    // Local mode sends its record in the same message as its COMMIT: cut
    // before it reaches the server, nothing was committed, but the loop
    // cannot know whether the COMMIT arrived, as for any lost COMMIT.
    env.proxy.arm(RECORD, Fault::CutBefore);
    let result = write_once(&env.pool, "lost-record", "lost").await;
    assert!(
        matches!(
            result,
            Err(AppError::Idem(idem::Error::CommitUnknown { .. }))
        ),
        "{result:?}"
    );
    assert_eq!(env.proxy.fired(), 1);
    assert_eq!(env.effects("lost").await, 0, "nothing reached the server");
    assert_eq!(env.record("lost-record").await, None);
    // The key says what happened: the same call again runs, once.
    let again = write_once(&env.pool, "lost-record", "lost")
        .await
        .expect("runs again");
    assert!(!again.replayed);
    assert_eq!(env.effects("lost").await, 1, "one effect, once");
    assert_eq!(
        env.record("lost-record").await,
        Some(("completed".to_owned(), Some("ok".to_owned())))
    );
    let replay = write_once(&env.pool, "lost-record", "lost")
        .await
        .expect("a replay");
    assert!(replay.replayed);
    assert_eq!(env.effects("lost").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_final_error_is_answered_as_itself_when_its_record_is_lost_on_its_way() {
    let env = env(2).await;
    // The attempt that stores the decline loses its connection before the
    // record (with its COMMIT) reaches the server: the decline is still the
    // answer (the body's writes were rolled back either way), unrecorded.
    env.proxy.arm(RECORD, Fault::CutBefore);
    let result = decline(&env.pool, "d-1", "declined").await;
    assert!(
        matches!(result, Err(AppError::Declined(Declined::Refused))),
        "{result:?}"
    );
    assert_eq!(env.proxy.fired(), 1);
    assert_eq!(env.record("d-1").await, None, "nothing reached the server");
    assert_eq!(
        env.effects("declined").await,
        0,
        "the body's writes rolled back"
    );
    // Called again, it runs and declines again, and this time is stored.
    let again = decline(&env.pool, "d-1", "declined").await;
    assert!(
        matches!(again, Err(AppError::Declined(Declined::Refused))),
        "{again:?}"
    );
    assert_eq!(
        env.record("d-1").await,
        Some(("completed".to_owned(), Some("error".to_owned())))
    );
    let replay = decline(&env.pool, "d-1", "declined").await;
    assert!(
        matches!(replay, Err(AppError::Declined(Declined::Refused))),
        "{replay:?}"
    );

    // The answer to the storing COMMIT is lost: still the decline (its
    // effects were rolled back either way), and the record did commit.
    env.proxy.arm(COMMIT, Fault::CutAfter);
    let result = decline(&env.pool, "d-2", "declined").await;
    assert!(
        matches!(result, Err(AppError::Declined(Declined::Refused))),
        "{result:?}"
    );
    assert_eq!(
        env.record("d-2").await,
        Some(("completed".to_owned(), Some("error".to_owned())))
    );
    assert_eq!(env.effects("declined").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_that_cannot_be_set_up_or_went_stale_are_replaced() {
    let env = env(4).await;
    // New connections refused while the pool sets them up.
    env.proxy.refuse_next(2);
    let id = write(&env.pool, "setup")
        .await
        .expect("a later connection works");
    assert!(id > 0);
    assert_eq!(env.effects("setup").await, 1);

    // Every pooled connection breaks at once: local and external calls all
    // recover (without #[retryable]: a connection that broke while idle ran
    // nothing, so replacing it spends no attempt), each with its effect once.
    let calls = AtomicU32::new(0);
    let warm: Vec<_> = futures_join_all(&env.pool, 4).await;
    drop(warm);
    let accepted = env.proxy.accepted();
    env.proxy.cut_all();
    tokio::time::sleep(Duration::from_millis(100)).await;
    for i in 0..10 {
        let key = format!("stale-ext-{i}");
        send_plain(&env.pool, &key, "stale-ext", &calls)
            .await
            .unwrap_or_else(|e| panic!("external call {i}: {e:?}"));
    }
    env.proxy.cut_all();
    tokio::time::sleep(Duration::from_millis(100)).await;
    for i in 0..10 {
        let key = format!("stale-local-{i}");
        write_once_plain(&env.pool, &key, "stale-local")
            .await
            .unwrap_or_else(|e| panic!("local call {i}: {e:?}"));
    }
    assert!(
        env.proxy.accepted() > accepted,
        "the stale connections were replaced by new ones"
    );
    assert_eq!(env.effects("stale-ext").await, 10);
    assert_eq!(env.effects("stale-local").await, 10);
    assert_eq!(
        AtomicU32::load(&calls, Ordering::SeqCst),
        10,
        "each outside call once"
    );
}

/// Check out `n` connections at once (so the pool holds `n`), then give them back.
async fn futures_join_all(pool: &Pool, n: usize) -> Vec<()> {
    let mut held = Vec::new();
    for _ in 0..n {
        held.push(pool.get().await.expect("a connection"));
    }
    held.into_iter().map(drop).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_external_claim_whose_commit_answer_was_lost_is_resumed_by_its_owner() {
    let env = env(2).await;
    let calls = AtomicU32::new(0);
    // The first COMMIT of the call is the claim's.
    env.proxy.arm(COMMIT, Fault::CutAfter);
    let sent = send(&env.pool, "ext-1", "resumed", &calls)
        .await
        .expect("the call resumes its own claim");
    assert!(!sent.replayed);
    assert_eq!(env.proxy.fired(), 1);
    assert_eq!(
        AtomicU32::load(&calls, Ordering::SeqCst),
        1,
        "the outside call ran once"
    );
    assert_eq!(env.effects("resumed").await, 1);
    assert_eq!(
        env.record("ext-1").await,
        Some(("completed".to_owned(), Some("ok".to_owned())))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_external_commit_is_bounded_by_the_commit_timeout() {
    let env = env(2).await;
    let calls = AtomicU32::new(0);
    // The claim's COMMIT passes; the outcome's COMMIT is held 3 s on its way
    // to the server, its transaction (and the record's row lock) open.
    env.proxy
        .arm_nth(COMMIT, 2, Fault::HoldRequest(Duration::from_secs(3)));
    let started = Instant::now();
    let result = send(&env.pool, "ext-held", "held", &calls).await;
    let elapsed = started.elapsed();
    assert!(
        matches!(
            result,
            Err(AppError::Idem(idem::Error::CommitUnknown { .. }))
        ),
        "{result:?}"
    );
    assert!(
        // Well under the 3 s hold, with room for a loaded machine.
        elapsed < Duration::from_secs(2),
        "commit_timeout_ms = 200 bounds the call, recording included: {elapsed:?}"
    );
    // Whatever the held COMMIT did in the end, the key never runs again.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let (state, _) = env.record("ext-held").await.expect("the claim is kept");
    assert!(
        state == "completed" || state == "unknown" || state == "in_progress",
        "{state}"
    );
    let again = send(&env.pool, "ext-held", "held", &calls).await;
    match again {
        Ok(replay) => assert!(replay.replayed, "a committed outcome replays"),
        Err(AppError::Idem(idem::Error::OutcomeUnknown | idem::Error::InProgress)) => {}
        other => panic!("the key must not run again: {other:?}"),
    }
    assert_eq!(
        AtomicU32::load(&calls, Ordering::SeqCst),
        1,
        "the outside call ran once"
    );
    drop(env.db);
}

/// A response built to break SQL quoting: 0.1 formatted responses into
/// `COMMIT`'s SQL text, dollar-quoted with a tag searched for in quadratic
/// time. 0.2 binds it; it is stored and replayed byte for byte.
#[idempotent(key = key, fingerprint(n), scope = none)]
async fn echo_hostile(
    conn: &mut AsyncPgConnection,
    key: &str,
    n: usize,
) -> Result<String, AppError> {
    insert_effect(conn, "hostile").await?;
    let mut text = String::from("'; DROP TABLE idem_requests; -- $$ ");
    for i in 0..n {
        text.push_str(&format!("$idem{i}$"));
    }
    Ok(text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_full_of_quote_tags_is_stored_and_replayed_as_is() {
    let env = env(2).await;
    // About 60 KB of `$idemN$` tags.
    let first = echo_hostile(&env.pool, "hostile-1", 6000)
        .await
        .expect("stored");
    assert!(!first.replayed);
    assert!(first.value.len() > 50_000, "{}", first.value.len());
    let again = echo_hostile(&env.pool, "hostile-1", 6000)
        .await
        .expect("replayed");
    assert!(again.replayed);
    assert_eq!(again.value, first.value);
    assert_eq!(env.effects("hostile").await, 1);
    let stored: String = env
        .client
        .query_one(
            "SELECT response #>> '{}' FROM idem_requests WHERE key = 'hostile-1'",
            &[],
        )
        .await
        .expect("read the record")
        .get(0);
    assert_eq!(stored, first.value);
}
