//! `#[retryable]` and `idem::retry::retry` against a real PostgreSQL: every
//! failure the loop promises to replay (40001, 40P01, `Stale`, opt-in 55P03, a
//! lost connection) is produced by real concurrent transactions, and every one
//! it promises not to replay is shown to be returned after a single attempt with
//! nothing committed. Timing is only used to widen races or as an upper bound
//! with wide margins (seconds where the promise is milliseconds).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use diesel::dsl::sql;
use diesel::prelude::*;
use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel::sql_types::{BigInt, Bool, Integer, Text};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idem::attempt::current_attempt;
use idem::pool::{build_pool_with, PoolConfig};
use idem::retry::retry;
use idem::Transient;
use idem::{
    retryable, Isolation, Pool, RetryCause, RetryPolicy, Versioned, VersionedChanges,
    VersionedError,
};
use idem_testing::TestDatabase;
use scoped_futures::ScopedFutureExt;
use tokio::sync::Barrier;

// ---------------------------------------------------------------------------
// Fixtures
// ---------------------------------------------------------------------------

diesel::table! {
    counters (id) {
        id -> Int8,
        n -> Int8,
        version -> Int8,
    }
}

#[derive(Debug, Clone, Queryable, Selectable, Versioned)]
#[diesel(table_name = counters)]
#[versioned(tenant = none, version = version, key = id)]
struct Counter {
    id: i64,
    n: i64,
    version: i64,
}

#[derive(VersionedChanges)]
#[versioned(model = Counter)]
#[diesel(table_name = counters)]
struct SetN {
    n: i64,
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Db(#[from] DieselError),
    #[error(transparent)]
    Versioned(#[from] VersionedError),
    #[error(transparent)]
    Idem(#[from] idem::Error),
    #[error("insufficient funds")]
    InsufficientFunds,
}

const SCHEMA: &str = "
    CREATE TABLE counters (id bigint PRIMARY KEY, n bigint NOT NULL, version bigint NOT NULL DEFAULT 0);
    INSERT INTO counters (id, n) VALUES (1, 0), (2, 0), (3, 0);
    CREATE TABLE accounts (id bigint PRIMARY KEY, balance bigint NOT NULL);
    INSERT INTO accounts VALUES (1, 0), (2, 0);
    CREATE TABLE items (id bigint PRIMARY KEY);
    INSERT INTO items VALUES (1);
    CREATE TABLE doctors (name text PRIMARY KEY, on_call boolean NOT NULL, shift_id int NOT NULL);
    INSERT INTO doctors VALUES ('alice', true, 1), ('bob', true, 1);
    CREATE TABLE deferred_unique (id bigint, UNIQUE (id) DEFERRABLE INITIALLY DEFERRED);
    -- A commit that takes long: a deferred constraint trigger runs at COMMIT.
    CREATE TABLE slow_commit (id bigint PRIMARY KEY);
    CREATE FUNCTION sleep_at_commit() RETURNS trigger LANGUAGE plpgsql AS
        $$ BEGIN PERFORM pg_sleep(30); RETURN NULL; END $$;
    CREATE CONSTRAINT TRIGGER sleep_at_commit AFTER INSERT ON slow_commit
        DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION sleep_at_commit();
";

/// One test's database, pool and side connection. The database is dropped last.
struct Env {
    client: Arc<tokio_postgres::Client>,
    pool: Pool,
    db: TestDatabase,
}

async fn env(pool_size: usize) -> Env {
    let db = TestDatabase::create()
        .await
        .expect("create the test database");
    let client = Arc::new(side_connection(db.url()).await);
    client
        .batch_execute(SCHEMA)
        .await
        .expect("create the schema");
    let pool = build_pool_with(
        db.url(),
        &PoolConfig {
            max_size: pool_size,
            wait_timeout: Duration::from_secs(10),
        },
    )
    .expect("build the pool");
    Env { client, pool, db }
}

/// A connection outside the pool, to observe and to interfere.
async fn side_connection(url: &str) -> tokio_postgres::Client {
    idem_testing::connect(url).await.expect("connect")
}

impl Env {
    async fn scalar_i64(&self, query: &str) -> i64 {
        self.client
            .query_one(query, &[])
            .await
            .unwrap_or_else(|e| panic!("{query}: {e}"))
            .get(0)
    }

    async fn counter(&self, id: i64) -> (i64, i64) {
        let row = self
            .client
            .query_one("SELECT n, version FROM counters WHERE id = $1", &[&id])
            .await
            .unwrap();
        (row.get(0), row.get(1))
    }

    /// Wait until `pid` runs `pg_sleep`, then terminate it.
    async fn terminate_when_sleeping(&self, pid: i32) {
        self.wait_for_backend(pid, "wait_event = 'PgSleep'").await;
        let terminated: bool = self
            .client
            .query_one("SELECT pg_terminate_backend($1)", &[&pid])
            .await
            .unwrap()
            .get(0);
        assert!(terminated);
    }

    /// Wait until backend `pid` satisfies `condition` (SQL over pg_stat_activity).
    async fn wait_for_backend(&self, pid: i32, condition: &str) {
        let query = format!(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND {condition})"
        );
        let until = Instant::now() + Duration::from_secs(20);
        loop {
            let reached: bool = self.client.query_one(&query, &[&pid]).await.unwrap().get(0);
            if reached {
                return;
            }
            assert!(
                Instant::now() < until,
                "backend {pid} never reached {condition}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Wait until backend `pid` has exited.
    async fn wait_for_backend_to_exit(&self, pid: i32) {
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            let alive: bool = self
                .client
                .query_one(
                    "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)",
                    &[&pid],
                )
                .await
                .unwrap()
                .get(0);
            if !alive {
                return;
            }
            assert!(
                Instant::now() < until,
                "backend {pid} is still there 10 s after its future was dropped"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The backends of this database that sit idle inside a transaction.
    async fn idle_in_transaction(&self) -> i64 {
        self.scalar_i64(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND state LIKE 'idle in transaction%'",
        )
        .await
    }

    /// A pooled connection works, is not inside a transaction, and nothing
    /// is checked out or waiting.
    async fn assert_pool_clean(&self) -> i32 {
        let status = self.pool.status();
        assert_eq!(
            status.size, status.available,
            "a connection is still checked out: {status:?}"
        );
        let mut conn = self.pool.get().await.expect("the next checkout works");
        let pid: i32 = sql::<Integer>("SELECT pg_backend_pid()")
            .get_result(&mut *conn)
            .await
            .expect("the checked-out connection can run a query");
        // Checked out and idle: the server says whether it sits in a transaction.
        let state: Option<String> = self
            .client
            .query_one("SELECT state FROM pg_stat_activity WHERE pid = $1", &[&pid])
            .await
            .unwrap()
            .get(0);
        assert_eq!(
            state.as_deref(),
            Some("idle"),
            "a pooled connection was handed out inside a transaction"
        );
        drop(conn);
        assert_eq!(self.idle_in_transaction().await, 0);
        pid
    }
}

/// Fail the attempt the way the server does: a real error with the SQLSTATE
/// (and, for a deadlock, the message) of `cause`.
async fn fail_with(conn: &mut AsyncPgConnection, cause: RetryCause) -> Result<(), AppError> {
    let sql = match cause {
        RetryCause::SerializationFailure => {
            "DO $$ BEGIN RAISE EXCEPTION 'could not serialize access' USING ERRCODE = 'serialization_failure'; END $$"
        }
        RetryCause::Deadlock => {
            "DO $$ BEGIN RAISE EXCEPTION 'deadlock detected' USING ERRCODE = 'deadlock_detected'; END $$"
        }
        other => unreachable!("no scripted failure for {other}"),
    };
    conn.batch_execute(sql).await?;
    unreachable!("the statement fails")
}

fn count(calls: &AtomicU32) -> u32 {
    calls.load(Ordering::SeqCst)
}

fn attempt_no() -> u32 {
    current_attempt().expect("the body runs inside an attempt")
}

async fn backend_pid(conn: &mut AsyncPgConnection) -> Result<i32, DieselError> {
    sql::<Integer>("SELECT pg_backend_pid()")
        .get_result(conn)
        .await
}

async fn insert_item(conn: &mut AsyncPgConnection, id: i64) -> Result<usize, DieselError> {
    diesel::sql_query("INSERT INTO items VALUES ($1)")
        .bind::<BigInt, _>(id)
        .execute(conn)
        .await
}

fn is_exhausted(result: &Result<impl std::fmt::Debug, AppError>, cause: RetryCause) -> bool {
    matches!(result, Err(AppError::Idem(idem::Error::Exhausted { last_cause, .. })) if *last_cause == cause)
}

// ---------------------------------------------------------------------------
// 40001: lost update under REPEATABLE READ, write skew under SERIALIZABLE
// ---------------------------------------------------------------------------

/// A read-modify-write of one balance. Both racers read before either writes
/// (the barrier, on the first attempt only); under REPEATABLE READ the second
/// writer's UPDATE fails with 40001 instead of overwriting the first.
#[retryable(isolation = repeatable_read, max = 4, deadline_ms = 20000)]
async fn deposit_one(conn: &mut AsyncPgConnection, barrier: &Barrier) -> Result<u32, AppError> {
    let attempt = attempt_no();
    let balance: i64 = sql::<BigInt>("SELECT balance FROM accounts WHERE id = 1")
        .get_result(conn)
        .await?;
    if attempt == 1 {
        barrier.wait().await;
    }
    diesel::sql_query("UPDATE accounts SET balance = $1 WHERE id = 1")
        .bind::<BigInt, _>(balance + 1)
        .execute(conn)
        .await?;
    Ok(attempt)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lost_update_under_repeatable_read_is_replayed_to_success() {
    let env = env(4).await;
    let barrier = Barrier::new(2);
    let (a, b) = tokio::join!(
        deposit_one(&env.pool, &barrier),
        deposit_one(&env.pool, &barrier)
    );
    let mut attempts = vec![a.unwrap(), b.unwrap()];
    attempts.sort();
    // The loser's first attempt got 40001; its second read the new balance.
    assert_eq!(attempts, vec![1, 2]);
    assert_eq!(
        env.scalar_i64("SELECT balance FROM accounts WHERE id = 1")
            .await,
        2,
        "no update was lost"
    );
    env.assert_pool_clean().await;
}

/// Hermitage's G2-item: each doctor goes off call if another one stays on
/// call. On the first attempt both racers read before either writes, and both
/// write before either commits, so SSI can only refuse one at COMMIT.
#[retryable(isolation = serializable, max = 4, deadline_ms = 20000)]
async fn go_off_call(
    conn: &mut AsyncPgConnection,
    name: &str,
    barrier: &Barrier,
    log: &Mutex<Vec<(u32, bool)>>,
) -> Result<(bool, u32), AppError> {
    let attempt = attempt_no();
    let on_call: i64 = sql::<BigInt>("SELECT count(*) FROM doctors WHERE on_call AND shift_id = 1")
        .get_result(conn)
        .await?;
    if attempt == 1 {
        barrier.wait().await;
    }
    if on_call < 2 {
        return Ok((false, attempt));
    }
    let updated =
        diesel::sql_query("UPDATE doctors SET on_call = false WHERE name = $1 AND shift_id = 1")
            .bind::<Text, _>(name)
            .execute(conn)
            .await;
    log.lock().unwrap().push((attempt, updated.is_ok()));
    if attempt == 1 {
        barrier.wait().await;
    }
    updated?;
    Ok((true, attempt))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn write_skew_under_serializable_is_replayed_and_the_invariant_holds() {
    let env = env(4).await;
    let barrier = Barrier::new(2);
    let log = Mutex::new(Vec::new());
    let (alice, bob) = tokio::join!(
        go_off_call(&env.pool, "alice", &barrier, &log),
        go_off_call(&env.pool, "bob", &barrier, &log)
    );
    let (alice, bob) = (alice.unwrap(), bob.unwrap());
    let log = log.into_inner().unwrap();
    // Both first-attempt UPDATEs went through: the 40001 came from COMMIT,
    // which the loop replayed like any other.
    assert_eq!(
        log.iter().filter(|(a, ok)| *a == 1 && *ok).count(),
        2,
        "{log:?}"
    );
    // Without SSI both would go off call. The one refused was replayed, saw
    // one doctor left and stayed on call.
    assert_eq!(
        [alice.0, bob.0].iter().filter(|off| **off).count(),
        1,
        "{alice:?} {bob:?}"
    );
    assert!(alice.1 >= 2 || bob.1 >= 2, "{alice:?} {bob:?}");
    assert_eq!(
        env.scalar_i64("SELECT count(*) FROM doctors WHERE on_call")
            .await,
        1
    );
    env.assert_pool_clean().await;
}

// ---------------------------------------------------------------------------
// 40P01: a real deadlock
// ---------------------------------------------------------------------------

/// Locks `first`, waits for the other racer to lock its first row, then locks
/// `second`: two racers with opposite orders deadlock on their first attempt.
async fn lock_in_order(
    conn: &mut AsyncPgConnection,
    first: i64,
    second: i64,
    barrier: &Barrier,
) -> Result<u32, AppError> {
    let attempt = attempt_no();
    let update = "UPDATE accounts SET balance = balance + 1 WHERE id = $1";
    diesel::sql_query(update)
        .bind::<BigInt, _>(first)
        .execute(conn)
        .await?;
    if attempt == 1 {
        barrier.wait().await;
    }
    diesel::sql_query(update)
        .bind::<BigInt, _>(second)
        .execute(conn)
        .await?;
    Ok(attempt)
}

// The deadline leaves room for deadlock_timeout (1 s by default).
#[retryable(max = 4, deadline_ms = 20000)]
async fn transfer_both(
    conn: &mut AsyncPgConnection,
    first: i64,
    second: i64,
    barrier: &Barrier,
) -> Result<u32, AppError> {
    lock_in_order(conn, first, second, barrier).await
}

#[retryable(max = 1, deadline_ms = 20000)]
async fn transfer_both_once(
    conn: &mut AsyncPgConnection,
    first: i64,
    second: i64,
    barrier: &Barrier,
) -> Result<u32, AppError> {
    lock_in_order(conn, first, second, barrier).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deadlock_is_replayed_and_both_transactions_commit() {
    let env = env(4).await;
    let barrier = Barrier::new(2);
    let (a, b) = tokio::join!(
        transfer_both(&env.pool, 1, 2, &barrier),
        transfer_both(&env.pool, 2, 1, &barrier)
    );
    let mut attempts = vec![a.unwrap(), b.unwrap()];
    attempts.sort();
    assert_eq!(
        attempts,
        vec![1, 2],
        "the deadlock victim was replayed once"
    );
    assert_eq!(
        env.scalar_i64("SELECT sum(balance)::bigint FROM accounts")
            .await,
        4,
        "both transactions committed both updates"
    );

    // With a budget of one attempt the victim's failure is reported, with its cause.
    let (a, b) = tokio::join!(
        transfer_both_once(&env.pool, 1, 2, &barrier),
        transfer_both_once(&env.pool, 2, 1, &barrier)
    );
    let (ok, failed) = if a.is_ok() { (a, b) } else { (b, a) };
    assert_eq!(ok.unwrap(), 1);
    assert!(
        matches!(
            failed,
            Err(AppError::Idem(idem::Error::Exhausted {
                attempts: 1,
                last_cause: RetryCause::Deadlock,
                ..
            }))
        ),
        "{failed:?}"
    );
    assert_eq!(
        env.scalar_i64("SELECT sum(balance)::bigint FROM accounts")
            .await,
        6
    );
    env.assert_pool_clean().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_raw_deadlock_error_classifies_as_deadlock() {
    let db = TestDatabase::create().await.unwrap();
    let mut a = AsyncPgConnection::establish(db.url()).await.unwrap();
    let mut b = AsyncPgConnection::establish(db.url()).await.unwrap();
    a.batch_execute(
        "CREATE TABLE t (id int PRIMARY KEY, v int NOT NULL); INSERT INTO t VALUES (1, 0), (2, 0)",
    )
    .await
    .unwrap();
    for conn in [&mut a, &mut b] {
        conn.batch_execute("SET lc_messages TO 'C'; BEGIN")
            .await
            .unwrap();
    }
    a.batch_execute("UPDATE t SET v = 1 WHERE id = 1")
        .await
        .unwrap();
    b.batch_execute("UPDATE t SET v = 1 WHERE id = 2")
        .await
        .unwrap();
    let (ra, rb) = tokio::join!(
        diesel::sql_query("UPDATE t SET v = 2 WHERE id = 2").execute(&mut a),
        diesel::sql_query("UPDATE t SET v = 2 WHERE id = 1").execute(&mut b),
    );
    let err = match (ra, rb) {
        (Ok(_), Err(e)) | (Err(e), Ok(_)) => e,
        other => panic!("expected exactly one deadlock victim: {other:?}"),
    };
    // diesel has no kind for 40P01: only the (untranslated) message tells.
    match &err {
        DieselError::DatabaseError(DatabaseErrorKind::Unknown, info) => {
            assert_eq!(info.message(), "deadlock detected")
        }
        other => panic!("unexpected error {other:?}"),
    }
    assert_eq!(err.transient(), Some(RetryCause::Deadlock));
    assert_eq!(
        VersionedError::Database(err).transient(),
        Some(RetryCause::Deadlock)
    );
    for conn in [&mut a, &mut b] {
        conn.batch_execute("ROLLBACK").await.unwrap();
    }
}

// ---------------------------------------------------------------------------
// Not replayed: 23505, the user's own errors, 55P03 unless opted in
// ---------------------------------------------------------------------------

#[retryable(max = 4)]
async fn insert_items(
    conn: &mut AsyncPgConnection,
    ids: Vec<i64>,
    refuse: bool,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    for id in &ids {
        insert_item(conn, *id).await?;
    }
    if refuse {
        return Err(AppError::InsufficientFunds);
    }
    Ok(())
}

#[tokio::test]
async fn unique_violation_and_user_errors_are_returned_after_one_attempt() {
    let env = env(2).await;
    let calls = AtomicU32::new(0);
    let result = insert_items(&env.pool, vec![2, 1], false, &calls).await;
    assert!(
        matches!(
            result,
            Err(AppError::Db(DieselError::DatabaseError(
                DatabaseErrorKind::UniqueViolation,
                _
            )))
        ),
        "{result:?}"
    );
    assert_eq!(count(&calls), 1);

    let calls = AtomicU32::new(0);
    let result = insert_items(&env.pool, vec![3], true, &calls).await;
    assert!(
        matches!(result, Err(AppError::InsufficientFunds)),
        "{result:?}"
    );
    assert_eq!(count(&calls), 1);

    assert_eq!(
        env.scalar_i64("SELECT count(*) FROM items").await,
        1,
        "neither attempt committed its rows"
    );
    env.assert_pool_clean().await;
}

async fn lock_item_nowait(conn: &mut AsyncPgConnection, calls: &AtomicU32) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    diesel::sql_query("SELECT id FROM items WHERE id = 1 FOR UPDATE NOWAIT")
        .execute(conn)
        .await?;
    Ok(())
}

#[retryable(max = 50, deadline_ms = 20000, backoff_cap_ms = 20)]
async fn nowait(conn: &mut AsyncPgConnection, calls: &AtomicU32) -> Result<(), AppError> {
    lock_item_nowait(conn, calls).await
}

#[retryable(
    max = 50,
    deadline_ms = 20000,
    backoff_cap_ms = 20,
    retry_lock_not_available = true
)]
async fn nowait_replayed(conn: &mut AsyncPgConnection, calls: &AtomicU32) -> Result<(), AppError> {
    lock_item_nowait(conn, calls).await
}

#[retryable(max = 50, deadline_ms = 20000)]
async fn lock_with_timeout(
    conn: &mut AsyncPgConnection,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    conn.batch_execute("SET LOCAL lock_timeout = '50ms'")
        .await?;
    diesel::sql_query("SELECT id FROM items WHERE id = 1 FOR UPDATE")
        .execute(conn)
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lock_not_available_is_replayed_only_when_opted_in() {
    let env = env(2).await;
    let holder = Arc::new(side_connection(env.db.url()).await);
    holder
        .batch_execute("BEGIN; SELECT id FROM items WHERE id = 1 FOR UPDATE")
        .await
        .unwrap();

    let calls = AtomicU32::new(0);
    let result = nowait(&env.pool, &calls).await;
    match &result {
        Err(AppError::Db(e)) => assert_eq!(e.transient(), Some(RetryCause::LockNotAvailable)),
        other => panic!("expected 55P03, got {other:?}"),
    }
    assert_eq!(count(&calls), 1, "55P03 is not replayed by default");

    let calls = AtomicU32::new(0);
    let result = lock_with_timeout(&env.pool, &calls).await;
    match &result {
        Err(AppError::Db(e)) => assert_eq!(e.transient(), Some(RetryCause::LockNotAvailable)),
        other => panic!("expected a lock timeout, got {other:?}"),
    }
    assert_eq!(count(&calls), 1);

    // Opted in: replayed until the holder lets go.
    let calls = Arc::new(AtomicU32::new(0));
    let release = {
        let (calls, holder) = (calls.clone(), holder.clone());
        tokio::spawn(async move {
            while count(&calls) < 2 {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            holder.batch_execute("ROLLBACK").await.unwrap();
        })
    };
    nowait_replayed(&env.pool, &calls).await.unwrap();
    release.await.unwrap();
    assert!(count(&calls) >= 2);
    env.assert_pool_clean().await;
}

// ---------------------------------------------------------------------------
// Versioned writers: the k-th committer needs at most k attempts
// ---------------------------------------------------------------------------

async fn increment(
    conn: &mut AsyncPgConnection,
    id: i64,
    barrier: Option<&Barrier>,
) -> Result<(i64, u32), AppError> {
    let attempt = attempt_no();
    let c = Counter::find(id).load(conn).await?;
    if let (1, Some(barrier)) = (attempt, barrier) {
        barrier.wait().await;
    }
    let c = Counter::update(id)
        .expect_version(c.version)
        .set(&SetN { n: c.n + 1 })
        .execute(conn)
        .await?;
    Ok((c.version, attempt))
}

#[retryable(max = 5, deadline_ms = 30000)]
async fn increment_max5(
    conn: &mut AsyncPgConnection,
    id: i64,
    barrier: Arc<Barrier>,
) -> Result<(i64, u32), AppError> {
    increment(conn, id, Some(&barrier)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_writers_with_five_attempts_all_commit() {
    let env = env(4).await;
    let barrier = Arc::new(Barrier::new(4));
    let tasks: Vec<_> = (0..4)
        .map(|_| {
            let (pool, barrier) = (env.pool.clone(), barrier.clone());
            tokio::spawn(async move { increment_max5(&pool, 1, barrier).await })
        })
        .collect();
    let mut committed = Vec::new();
    for task in tasks {
        committed.push(task.await.unwrap().expect("every writer commits"));
    }
    committed.sort();
    // The version a writer wrote is its place in the commit order.
    assert_eq!(
        committed.iter().map(|(v, _)| *v).collect::<Vec<_>>(),
        vec![1, 2, 3, 4]
    );
    for (k, attempts) in &committed {
        assert!(
            i64::from(*attempts) <= *k,
            "committer {k} needed {attempts} attempts: {committed:?}"
        );
    }
    assert_eq!(env.counter(1).await, (4, 4));
    env.assert_pool_clean().await;
}

#[retryable(max = 4, deadline_ms = 60000)]
async fn increment_max4(conn: &mut AsyncPgConnection, id: i64) -> Result<i64, AppError> {
    let c = Counter::find(id).load(conn).await?;
    // Widens the window between read and write, so that writers collide.
    diesel::sql_query("SELECT pg_sleep(0.002)")
        .execute(conn)
        .await?;
    let c = Counter::update(id)
        .expect_version(c.version)
        .set(&SetN { n: c.n + 1 })
        .execute(conn)
        .await?;
    Ok(c.version)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_writers_with_four_attempts_exhaust_or_commit() {
    let env = env(20).await;
    let tasks: Vec<_> = (0..50)
        .map(|_| {
            let pool = env.pool.clone();
            tokio::spawn(async move { increment_max4(&pool, 1).await })
        })
        .collect();
    let (mut ok, mut exhausted) = (0_i64, 0);
    for task in tasks {
        match task.await.unwrap() {
            Ok(_) => ok += 1,
            Err(AppError::Idem(idem::Error::Exhausted {
                attempts: 4,
                last_cause: RetryCause::Stale,
                ..
            })) => exhausted += 1,
            Err(other) => panic!("unexpected failure: {other:?}"),
        }
    }
    eprintln!("50 writers, 4 attempts each: {ok} committed, {exhausted} exhausted");
    assert_eq!(ok + exhausted, 50);
    assert!(ok >= 1 && exhausted >= 1, "ok {ok}, exhausted {exhausted}");
    assert_eq!(
        env.counter(1).await,
        (ok, ok),
        "one version per successful writer, nothing from the exhausted ones"
    );
    env.assert_pool_clean().await;
}

// ---------------------------------------------------------------------------
// The budget: deadline and backoff cap
// ---------------------------------------------------------------------------

const DEADLINE: Duration = Duration::from_millis(600);
const ATTEMPT_TIME: Duration = Duration::from_millis(100);
/// Room for checkouts, BEGIN and ROLLBACK on a loaded machine.
const SLACK: Duration = Duration::from_millis(1500);

#[retryable(max = 1000, deadline_ms = 600)]
async fn always_busy(conn: &mut AsyncPgConnection, calls: &AtomicU32) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    diesel::sql_query("SELECT pg_sleep(0.1)")
        .execute(conn)
        .await?;
    fail_with(conn, RetryCause::SerializationFailure).await
}

#[tokio::test]
async fn the_deadline_is_never_exceeded_by_more_than_one_attempt() {
    let env = env(2).await;
    let calls = AtomicU32::new(0);
    let started = Instant::now();
    let result = always_busy(&env.pool, &calls).await;
    let elapsed = started.elapsed();
    let Err(AppError::Idem(idem::Error::Exhausted {
        attempts,
        elapsed: reported,
        last_cause: RetryCause::SerializationFailure,
    })) = result
    else {
        panic!("expected exhaustion, got {result:?}")
    };
    assert_eq!(attempts, count(&calls));
    // Each attempt takes at least 100 ms and none starts at or after 600 ms.
    assert!((2..=6).contains(&attempts), "{attempts} attempts");
    // It gave up because the next backoff (at most 150 ms) would cross the deadline.
    assert!(
        reported + Duration::from_millis(150) >= DEADLINE,
        "{reported:?}"
    );
    assert!(reported <= elapsed);
    assert!(
        elapsed <= DEADLINE + ATTEMPT_TIME + SLACK,
        "{elapsed:?} for a {DEADLINE:?} deadline"
    );
    env.assert_pool_clean().await;
}

/// Fails at once, with a backoff of up to 10 s: no sleep may cross the 500 ms deadline.
#[retryable(
    max = 1000,
    deadline_ms = 500,
    backoff_base_ms = 10000,
    backoff_cap_ms = 10000
)]
async fn busy_with_long_backoff(conn: &mut AsyncPgConnection) -> Result<(), AppError> {
    backend_pid(conn).await?;
    fail_with(conn, RetryCause::Deadlock).await
}

#[tokio::test]
async fn no_backoff_sleeps_across_the_deadline() {
    let env = env(2).await;
    for _ in 0..5 {
        let started = Instant::now();
        let result = busy_with_long_backoff(&env.pool).await;
        let elapsed = started.elapsed();
        assert!(is_exhausted(&result, RetryCause::Deadlock), "{result:?}");
        assert!(
            elapsed <= Duration::from_millis(500) + SLACK,
            "slept across the deadline: {elapsed:?}"
        );
    }
}

/// Fails at once 100 times; backoff starts at 1 ms and is capped at 2 ms.
#[retryable(
    max = 100,
    deadline_ms = 120000,
    backoff_base_ms = 1,
    backoff_cap_ms = 2
)]
async fn busy_with_small_cap(
    conn: &mut AsyncPgConnection,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    backend_pid(conn).await?;
    fail_with(conn, RetryCause::SerializationFailure).await
}

#[tokio::test]
async fn backoff_never_exceeds_the_cap() {
    let env = env(2).await;
    let calls = AtomicU32::new(0);
    let started = Instant::now();
    let result = busy_with_small_cap(&env.pool, &calls).await;
    let elapsed = started.elapsed();
    assert!(
        matches!(
            result,
            Err(AppError::Idem(idem::Error::Exhausted { attempts: 100, .. }))
        ),
        "{result:?}"
    );
    assert_eq!(count(&calls), 100);
    // 99 sleeps of at most 2 ms. Uncapped, the ceiling doubles from 1 ms and
    // passes 17 minutes by the 21st attempt.
    assert!(
        elapsed < Duration::from_secs(15),
        "99 capped sleeps took {elapsed:?}"
    );
    env.assert_pool_clean().await;
}

// ---------------------------------------------------------------------------
// Lost connections: before COMMIT (replayed), during COMMIT (unknown)
// ---------------------------------------------------------------------------

#[retryable(max = 4, deadline_ms = 60000)]
async fn insert_then_sleep(
    conn: &mut AsyncPgConnection,
    pids: &Mutex<Vec<i32>>,
) -> Result<u32, AppError> {
    let attempt = attempt_no();
    let pid = backend_pid(conn).await?;
    pids.lock().unwrap().push(pid);
    insert_item(conn, 100 + i64::from(attempt)).await?;
    if attempt == 1 {
        diesel::sql_query("SELECT pg_sleep(30)")
            .execute(conn)
            .await?;
    }
    Ok(attempt)
}

async fn first_pid(pids: &Mutex<Vec<i32>>) -> i32 {
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let first = pids.lock().unwrap().iter().next().copied();
        if let Some(pid) = first {
            return pid;
        }
        assert!(Instant::now() < until, "the body never ran");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_terminated_backend_is_replayed_on_a_fresh_connection() {
    let env = env(4).await;
    let pids = Mutex::new(Vec::new());
    let (result, ()) = tokio::join!(insert_then_sleep(&env.pool, &pids), async {
        env.terminate_when_sleeping(first_pid(&pids).await).await
    });
    assert_eq!(result.unwrap(), 2);
    let pids = pids.into_inner().unwrap();
    assert_eq!(pids.len(), 2);
    assert_ne!(pids[0], pids[1], "the replay ran on another backend");
    assert_eq!(
        env.scalar_i64("SELECT count(*) FROM items WHERE id > 100")
            .await,
        1
    );
    assert_eq!(
        env.scalar_i64("SELECT id FROM items WHERE id > 100").await,
        102,
        "only the second attempt committed"
    );
    let pid = env.assert_pool_clean().await;
    assert_ne!(pid, pids[0], "the dead connection went back to the pool");
}

/// Loses its connection mid-statement on its first attempt, ignores that,
/// and fails with an error of its own: the ROLLBACK then fails too, and must
/// not replace anything. The dead transaction is replayed (what failed on the
/// connection decides, not the error the body chose), and the replay's own
/// answer is returned.
#[retryable(max = 4, deadline_ms = 60000)]
async fn refuse_after_losing_the_connection(
    conn: &mut AsyncPgConnection,
    pids: &Mutex<Vec<i32>>,
) -> Result<(), AppError> {
    let pid = backend_pid(conn).await?;
    let first = {
        let mut pids = pids.lock().unwrap();
        pids.push(pid);
        pids.len() == 1
    };
    if first {
        let lost = diesel::sql_query("SELECT pg_sleep(30)").execute(conn).await;
        assert_eq!(
            lost.unwrap_err().transient(),
            Some(RetryCause::ConnectionLost)
        );
    }
    Err(AppError::InsufficientFunds)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failing_rollback_never_hides_the_original_error() {
    let env = env(4).await;
    let pids = Mutex::new(Vec::new());
    let (result, ()) = tokio::join!(
        refuse_after_losing_the_connection(&env.pool, &pids),
        async { env.terminate_when_sleeping(first_pid(&pids).await).await }
    );
    assert!(
        matches!(result, Err(AppError::InsufficientFunds)),
        "{result:?}"
    );
    let pids = pids.into_inner().unwrap();
    assert_eq!(pids.len(), 2, "replayed once, on a fresh connection");
    assert_ne!(pids[0], pids[1]);
    let pid = env.assert_pool_clean().await;
    assert_ne!(pid, pids[0], "the dead connection went back to the pool");
}

#[retryable(max = 4, deadline_ms = 60000)]
async fn insert_slow_commit(
    conn: &mut AsyncPgConnection,
    pids: &Mutex<Vec<i32>>,
) -> Result<(), AppError> {
    let pid = backend_pid(conn).await?;
    pids.lock().unwrap().push(pid);
    diesel::sql_query("INSERT INTO slow_commit VALUES (1)")
        .execute(conn)
        .await?;
    Ok(())
}

#[retryable(max = 4, deadline_ms = 60000, commit_timeout_ms = 300)]
async fn insert_slow_commit_with_timeout(
    conn: &mut AsyncPgConnection,
    pids: &Mutex<Vec<i32>>,
) -> Result<(), AppError> {
    let pid = backend_pid(conn).await?;
    pids.lock().unwrap().push(pid);
    diesel::sql_query("INSERT INTO slow_commit VALUES (2)")
        .execute(conn)
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backend_terminated_during_commit_gives_commit_unknown() {
    let env = env(4).await;
    let pids = Mutex::new(Vec::new());
    // The body returns at once; the backend then sleeps in the deferred
    // trigger, inside COMMIT, where it is terminated.
    let (result, ()) = tokio::join!(insert_slow_commit(&env.pool, &pids), async {
        env.terminate_when_sleeping(first_pid(&pids).await).await
    });
    assert!(
        matches!(
            result,
            Err(AppError::Idem(idem::Error::CommitUnknown {
                attempts: 1,
                ..
            }))
        ),
        "{result:?}"
    );
    assert_eq!(pids.lock().unwrap().len(), 1, "never replayed");
    assert_eq!(env.scalar_i64("SELECT count(*) FROM slow_commit").await, 0);
    env.assert_pool_clean().await;

    // A COMMIT that gets no answer in time is unknown too.
    let pids = Mutex::new(Vec::new());
    let started = Instant::now();
    let result = insert_slow_commit_with_timeout(&env.pool, &pids).await;
    assert!(
        matches!(
            result,
            Err(AppError::Idem(idem::Error::CommitUnknown {
                attempts: 1,
                ..
            }))
        ),
        "{result:?}"
    );
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!(pids.lock().unwrap().len(), 1, "never replayed");
    env.assert_pool_clean().await;
}

// ---------------------------------------------------------------------------
// A body that swallows a failed statement
// ---------------------------------------------------------------------------

#[retryable(max = 4)]
async fn swallow_a_failure(
    conn: &mut AsyncPgConnection,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    let duplicate = insert_item(conn, 1).await;
    assert!(matches!(
        duplicate,
        Err(DieselError::DatabaseError(
            DatabaseErrorKind::UniqueViolation,
            _
        ))
    ));
    // The transaction is aborted: this fails too (25P02), and is ignored too.
    let _ = insert_item(conn, 2).await;
    Ok(())
}

/// The right way to survive a failed statement: a savepoint.
#[retryable(max = 4)]
async fn recover_with_a_savepoint(conn: &mut AsyncPgConnection) -> Result<(), AppError> {
    let duplicate = conn
        .transaction::<_, DieselError, _>(async |conn| insert_item(conn, 1).await)
        .await;
    assert!(duplicate.is_err());
    insert_item(conn, 3).await?;
    Ok(())
}

#[tokio::test]
async fn a_swallowed_error_is_never_reported_as_committed() {
    let env = env(1).await;
    let calls = AtomicU32::new(0);
    let result = swallow_a_failure(&env.pool, &calls).await;
    assert!(
        matches!(result, Err(AppError::Idem(idem::Error::RolledBack))),
        "{result:?}"
    );
    assert_eq!(count(&calls), 1);
    assert_eq!(
        env.scalar_i64("SELECT count(*) FROM items WHERE id <> 1")
            .await,
        0
    );
    env.assert_pool_clean().await;

    // A failure rolled back to a savepoint leaves the transaction healthy.
    recover_with_a_savepoint(&env.pool).await.unwrap();
    assert_eq!(
        env.scalar_i64("SELECT count(*) FROM items WHERE id = 3")
            .await,
        1
    );
    env.assert_pool_clean().await;
}

// ---------------------------------------------------------------------------
// Cancellation
// ---------------------------------------------------------------------------

#[retryable(max = 4, deadline_ms = 60000)]
async fn hold_a_row_lock(
    conn: &mut AsyncPgConnection,
    pids: &Mutex<Vec<i32>>,
    sleep_on_server: bool,
) -> Result<(), AppError> {
    let pid = backend_pid(conn).await?;
    diesel::sql_query("UPDATE accounts SET balance = balance + 1 WHERE id = 1")
        .execute(conn)
        .await?;
    pids.lock().unwrap().push(pid);
    if sleep_on_server {
        diesel::sql_query("SELECT pg_sleep(60)")
            .execute(conn)
            .await?;
    } else {
        tokio::time::sleep(Duration::from_secs(60)).await;
    }
    Ok(())
}

async fn cancel_mid_attempt(sleep_on_server: bool) {
    let env = env(2).await;
    let pids = Mutex::new(Vec::new());
    // Drop the call once its body holds the row lock and sleeps.
    let holding = async {
        let pid = first_pid(&pids).await;
        let state = if sleep_on_server {
            "wait_event = 'PgSleep'"
        } else {
            "state = 'idle in transaction'"
        };
        env.wait_for_backend(pid, state).await;
        pid
    };
    let pid = tokio::select! {
        result = hold_a_row_lock(&env.pool, &pids, sleep_on_server) => panic!("the call returned {result:?}"),
        pid = holding => pid,
    };

    // The backend goes away, and its transaction and row lock with it.
    env.wait_for_backend_to_exit(pid).await;
    assert_eq!(env.idle_in_transaction().await, 0);
    env.client
        .batch_execute(
            "SET lock_timeout = '1s'; UPDATE accounts SET balance = balance + 10 WHERE id = 1",
        )
        .await
        .expect("the row lock was released");
    assert_eq!(
        env.scalar_i64("SELECT balance FROM accounts WHERE id = 1")
            .await,
        10,
        "the cancelled attempt did not commit"
    );
    let status = env.pool.status();
    assert_eq!(
        (status.size, status.available),
        (0, 0),
        "the cancelled attempt's connection was closed, not pooled"
    );
    env.assert_pool_clean().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dropping_the_future_while_the_body_awaits_closes_the_transaction() {
    cancel_mid_attempt(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dropping_the_future_while_a_statement_runs_closes_the_transaction() {
    cancel_mid_attempt(true).await;
}

// ---------------------------------------------------------------------------
// Connection hygiene
// ---------------------------------------------------------------------------

#[retryable(max = 2, deadline_ms = 20000)]
async fn always_stale(conn: &mut AsyncPgConnection) -> Result<(), AppError> {
    insert_item(conn, 50).await?;
    // A hand-written version check that lost its race says so.
    idem::attempt::lost_race();
    Err(AppError::Versioned(VersionedError::Stale {
        expected: 1,
        actual: 2,
    }))
}

#[retryable(max = 4)]
async fn violate_at_commit(conn: &mut AsyncPgConnection) -> Result<(), AppError> {
    conn.batch_execute("INSERT INTO deferred_unique VALUES (1), (1)")
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failed_attempts_never_return_a_broken_connection_to_the_pool() {
    // One connection: every call and every check gets the same one back.
    let env = env(1).await;
    let pid = env.assert_pool_clean().await;
    let calls = AtomicU32::new(0);

    let result = insert_items(&env.pool, vec![7], true, &calls).await;
    assert!(matches!(result, Err(AppError::InsufficientFunds)));
    assert_eq!(env.assert_pool_clean().await, pid);

    let result = insert_items(&env.pool, vec![8, 1], false, &calls).await;
    assert!(matches!(result, Err(AppError::Db(_))));
    assert_eq!(env.assert_pool_clean().await, pid);

    let result = swallow_a_failure(&env.pool, &calls).await;
    assert!(matches!(
        result,
        Err(AppError::Idem(idem::Error::RolledBack))
    ));
    assert_eq!(env.assert_pool_clean().await, pid);

    let result = always_stale(&env.pool).await;
    assert!(is_exhausted(&result, RetryCause::Stale), "{result:?}");
    assert_eq!(env.assert_pool_clean().await, pid);

    let result = violate_at_commit(&env.pool).await;
    match &result {
        Err(AppError::Idem(idem::Error::Commit(DieselError::DatabaseError(
            DatabaseErrorKind::UniqueViolation,
            _,
        )))) => {}
        other => panic!("expected a failed COMMIT, got {other:?}"),
    }
    assert_eq!(env.assert_pool_clean().await, pid);

    let holder = side_connection(env.db.url()).await;
    holder
        .batch_execute("BEGIN; SELECT id FROM items WHERE id = 1 FOR UPDATE")
        .await
        .unwrap();
    let result = nowait(&env.pool, &calls).await;
    assert!(matches!(result, Err(AppError::Db(_))));
    holder.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(env.assert_pool_clean().await, pid);

    assert_eq!(
        env.scalar_i64("SELECT count(*) FROM items").await
            + env.scalar_i64("SELECT count(*) FROM deferred_unique").await,
        1,
        "nothing was committed"
    );
}

// ---------------------------------------------------------------------------
// Nesting
// ---------------------------------------------------------------------------

#[retryable]
async fn inner(conn: &mut AsyncPgConnection, calls: &AtomicU32) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    insert_item(conn, 60).await?;
    Ok(())
}

#[retryable]
async fn outer(
    conn: &mut AsyncPgConnection,
    pool: &Pool,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    insert_item(conn, 61).await?;
    inner(pool, calls).await
}

#[retryable]
async fn outer_with_closure(
    conn: &mut AsyncPgConnection,
    pool: &Pool,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    insert_item(conn, 62).await?;
    retry(pool, RetryPolicy::new(), "inner_closure", |conn| {
        async move {
            calls.fetch_add(1, Ordering::SeqCst);
            insert_item(conn, 63).await?;
            Ok::<_, AppError>(())
        }
        .scope_boxed()
    })
    .await
}

#[tokio::test]
async fn a_retry_loop_inside_an_attempt_is_rejected() {
    let env = env(4).await;
    let calls = AtomicU32::new(0);
    let result = outer(&env.pool, &env.pool, &calls).await;
    assert!(
        matches!(result, Err(AppError::Idem(idem::Error::Nested))),
        "{result:?}"
    );
    let result = outer_with_closure(&env.pool, &env.pool, &calls).await;
    assert!(
        matches!(result, Err(AppError::Idem(idem::Error::Nested))),
        "{result:?}"
    );
    assert_eq!(count(&calls), 0, "no inner body ran");
    assert_eq!(env.scalar_i64("SELECT count(*) FROM items").await, 1);
    // Called on its own, the inner function works.
    inner(&env.pool, &calls).await.unwrap();
    assert_eq!(count(&calls), 1);
    env.assert_pool_clean().await;
}

// ---------------------------------------------------------------------------
// on_conflict = lock
// ---------------------------------------------------------------------------

/// Whether this transaction holds the table lock that `SELECT .. FOR UPDATE`
/// takes (ROW SHARE); a plain SELECT takes ACCESS SHARE, an UPDATE ROW EXCLUSIVE.
async fn loaded_for_update(conn: &mut AsyncPgConnection) -> Result<bool, DieselError> {
    sql::<Bool>(
        "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = pg_backend_pid() \
         AND locktype = 'relation' AND relation = 'counters'::regclass AND mode = 'RowShareLock')",
    )
    .get_result(conn)
    .await
}

type AttemptLog = Mutex<Vec<(u32, bool)>>;

async fn increment_logged(
    conn: &mut AsyncPgConnection,
    id: i64,
    barrier: &Barrier,
    log: &AttemptLog,
) -> Result<u32, AppError> {
    let attempt = attempt_no();
    let c = Counter::find(id).load(conn).await?;
    let locked = loaded_for_update(conn).await?;
    log.lock().unwrap().push((attempt, locked));
    if attempt == 1 {
        barrier.wait().await;
    }
    diesel::sql_query("SELECT pg_sleep(0.002)")
        .execute(conn)
        .await?;
    Counter::update(id)
        .expect_version(c.version)
        .set(&SetN { n: c.n + 1 })
        .execute(conn)
        .await?;
    Ok(attempt)
}

#[retryable(max = 100, deadline_ms = 60000, on_conflict = lock)]
async fn increment_adaptive(
    conn: &mut AsyncPgConnection,
    id: i64,
    barrier: Arc<Barrier>,
    log: Arc<AttemptLog>,
) -> Result<u32, AppError> {
    increment_logged(conn, id, &barrier, &log).await
}

#[retryable(max = 100, deadline_ms = 60000)]
async fn increment_optimistic(
    conn: &mut AsyncPgConnection,
    id: i64,
    barrier: Arc<Barrier>,
    log: Arc<AttemptLog>,
) -> Result<u32, AppError> {
    increment_logged(conn, id, &barrier, &log).await
}

const HOT_WRITERS: usize = 20;

async fn hot_row(env: &Env, id: i64, adaptive: bool) -> Vec<(u32, bool)> {
    let barrier = Arc::new(Barrier::new(HOT_WRITERS));
    let log = Arc::new(AttemptLog::default());
    let tasks: Vec<_> = (0..HOT_WRITERS)
        .map(|_| {
            let (pool, barrier, log) = (env.pool.clone(), barrier.clone(), log.clone());
            tokio::spawn(async move {
                if adaptive {
                    increment_adaptive(&pool, id, barrier, log).await
                } else {
                    increment_optimistic(&pool, id, barrier, log).await
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap().expect("every writer commits");
    }
    assert_eq!(
        env.counter(id).await,
        (HOT_WRITERS as i64, HOT_WRITERS as i64)
    );
    Arc::try_unwrap(log).unwrap().into_inner().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_conflict_lock_stops_a_hot_row_from_burning_attempts() {
    let env = env(HOT_WRITERS).await;

    let adaptive = hot_row(&env, 1, true).await;
    let adaptive_wasted = adaptive.len() - HOT_WRITERS;
    // First attempts are optimistic; after a conflict every attempt locks,
    // and a locked attempt cannot lose: at most one wasted attempt per writer.
    assert!(
        adaptive.iter().all(|(a, locked)| *locked == (*a > 1)),
        "{adaptive:?}"
    );
    assert!(adaptive.iter().all(|(a, _)| *a <= 2), "{adaptive:?}");
    assert!(adaptive_wasted <= HOT_WRITERS, "{adaptive_wasted} wasted");

    // The row that lost version races is remembered: a later call locks it
    // from its first attempt, while a call without on_conflict = lock never does.
    let log = Arc::new(AttemptLog::default());
    let attempt = increment_adaptive(&env.pool, 1, Arc::new(Barrier::new(1)), log.clone()).await;
    assert_eq!(attempt.unwrap(), 1);
    assert_eq!(*log.lock().unwrap(), vec![(1, true)]);
    let log = Arc::new(AttemptLog::default());
    let attempt = increment_optimistic(&env.pool, 1, Arc::new(Barrier::new(1)), log.clone()).await;
    assert_eq!(attempt.unwrap(), 1);
    assert_eq!(*log.lock().unwrap(), vec![(1, false)]);
    assert_eq!(
        env.counter(1).await,
        (HOT_WRITERS as i64 + 2, HOT_WRITERS as i64 + 2)
    );

    let optimistic = hot_row(&env, 2, false).await;
    let optimistic_wasted = optimistic.len() - HOT_WRITERS;
    assert!(optimistic.iter().all(|(_, locked)| !locked));
    eprintln!("{HOT_WRITERS} writers on one row: wasted attempts adaptive {adaptive_wasted}, optimistic {optimistic_wasted}");
    assert!(optimistic_wasted >= adaptive_wasted);
    env.assert_pool_clean().await;
}

#[tokio::test]
async fn on_conflict_lock_never_locks_without_a_conflict() {
    let env = env(2).await;
    for _ in 0..5 {
        let log = Arc::new(AttemptLog::default());
        let attempt =
            increment_adaptive(&env.pool, 3, Arc::new(Barrier::new(1)), log.clone()).await;
        assert_eq!(attempt.unwrap(), 1);
        assert_eq!(*log.lock().unwrap(), vec![(1, false)]);
    }
    assert_eq!(env.counter(3).await, (5, 5));
}

// ---------------------------------------------------------------------------
// The closure form
// ---------------------------------------------------------------------------

const CLOSURE_POLICY: RetryPolicy = RetryPolicy::new()
    .isolation(Isolation::RepeatableRead)
    .deadline(Duration::from_secs(20));

async fn deposit_with_closure(
    pool: &Pool,
    barrier: &Barrier,
    calls: &AtomicU32,
) -> Result<u32, AppError> {
    retry(pool, CLOSURE_POLICY, "deposit_with_closure", |conn| {
        async move {
            calls.fetch_add(1, Ordering::SeqCst);
            let attempt = attempt_no();
            let balance: i64 = sql::<BigInt>("SELECT balance FROM accounts WHERE id = 2")
                .get_result(conn)
                .await?;
            if attempt == 1 {
                barrier.wait().await;
            }
            diesel::sql_query("UPDATE accounts SET balance = $1 WHERE id = 2")
                .bind::<BigInt, _>(balance + 1)
                .execute(conn)
                .await?;
            Ok(attempt)
        }
        .scope_boxed()
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_closure_form_replays_the_same_way() {
    let env = env(4).await;
    let barrier = Barrier::new(2);
    let calls = AtomicU32::new(0);
    let (a, b) = tokio::join!(
        deposit_with_closure(&env.pool, &barrier, &calls),
        deposit_with_closure(&env.pool, &barrier, &calls)
    );
    let mut attempts = vec![a.unwrap(), b.unwrap()];
    attempts.sort();
    assert_eq!(attempts, vec![1, 2]);
    assert_eq!(count(&calls), 3, "the closure runs once per attempt");
    assert_eq!(
        env.scalar_i64("SELECT balance FROM accounts WHERE id = 2")
            .await,
        2
    );

    // Not replayed: the user's error, after one call and a rollback.
    let calls = AtomicU32::new(0);
    let result: Result<(), AppError> = retry(&env.pool, CLOSURE_POLICY, "refuse", |conn| {
        let calls = &calls;
        async move {
            calls.fetch_add(1, Ordering::SeqCst);
            insert_item(conn, 70).await?;
            Err(AppError::InsufficientFunds)
        }
        .scope_boxed()
    })
    .await;
    assert!(matches!(result, Err(AppError::InsufficientFunds)));
    assert_eq!(count(&calls), 1);
    assert_eq!(
        env.scalar_i64("SELECT count(*) FROM items WHERE id = 70")
            .await,
        0
    );

    // Swallowed errors are caught here too.
    let result: Result<(), AppError> = retry(&env.pool, CLOSURE_POLICY, "swallow", |conn| {
        async move {
            let _ = insert_item(conn, 1).await;
            Ok(())
        }
        .scope_boxed()
    })
    .await;
    assert!(matches!(
        result,
        Err(AppError::Idem(idem::Error::RolledBack))
    ));
    env.assert_pool_clean().await;
}
