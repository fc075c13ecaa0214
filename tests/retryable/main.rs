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

#[path = "../support/pool.rs"]
mod test_pool;

mod attack_dropped;
mod attack_s56;
mod attack_savepoint;
mod attack_seal;
mod attack_session34;
mod attack_third;
mod attack_unanswered;
mod budget;
mod closure_form;
mod connections;
mod deadline;
mod deadline_external;
mod dropped_savepoint;
mod nesting;
mod not_replayed;
mod open_savepoint;
mod replayed;
mod versioned_writers;

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

/// A pool of one connection to `url` (a proxy's, say), waiting up to 10 s.
fn pool_of_one(url: &str) -> Pool {
    build_pool_with(
        url,
        &PoolConfig {
            max_size: 1,
            wait_timeout: Duration::from_secs(10),
            ..Default::default()
        },
    )
    .expect("a pool")
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
    // The code under test's pool: through PgBouncer under IDEM_TEST_VIA=pgbouncer.
    let pool = test_pool::test_pool(&db, pool_size, Duration::from_secs(10));
    Env { client, pool, db }
}

/// A connection outside the pool, to observe and to interfere.
async fn side_connection(url: &str) -> tokio_postgres::Client {
    idem_testing::connect(url).await.expect("connect")
}

/// Items `base..base + 10` committed, in order.
async fn items_from(env: &Env, base: i64) -> Vec<i64> {
    env.client
        .query(
            "SELECT id FROM items WHERE id >= $1 AND id < $1 + 10 ORDER BY id",
            &[&base],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

impl Env {
    /// How many other sessions still run a statement whose text holds
    /// `tag`, once none does or 2 s have passed.
    async fn running_after(&self, tag: &str) -> i64 {
        let running = format!(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query LIKE '%{tag}%' \
             AND pid <> pg_backend_pid()"
        );
        let mut left = self.scalar_i64(&running).await;
        for _ in 0..40 {
            if left == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            left = self.scalar_i64(&running).await;
        }
        left
    }

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
        idem_testing::stats::idle_in_transaction(&self.client)
            .await
            .expect("count the sessions idle in a transaction")
    }

    /// A pooled connection works, is not inside a transaction, and nothing
    /// is checked out or waiting.
    async fn assert_pool_clean(&self) -> i32 {
        // An attempt that only answered (a replay) ends its read-only
        // transaction in the background: its connection comes back once
        // ROLLBACK is answered, a round trip later (two hops behind PgBouncer).
        let until = Instant::now() + Duration::from_secs(10);
        let mut status = self.pool.status();
        while status.size != status.available && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(5)).await;
            status = self.pool.status();
        }
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

/// Add 1 to counter 3, which row-locks it to the end of the transaction.
async fn bump_counter_3_in(conn: &mut AsyncPgConnection) -> Result<usize, DieselError> {
    diesel::sql_query("UPDATE counters SET n = n + 1 WHERE id = 3")
        .execute(conn)
        .await
}

/// What a hand-written version check that lost its race returns, having
/// said so (`idem::attempt::lost_race`): a `Stale` the loop replays.
fn lost_a_race() -> AppError {
    idem::attempt::lost_race();
    AppError::Versioned(VersionedError::Stale {
        expected: 0,
        actual: 1,
    })
}

fn is_exhausted(result: &Result<impl std::fmt::Debug, AppError>, cause: RetryCause) -> bool {
    matches!(result, Err(AppError::Idem(idem::Error::Exhausted { last_cause, .. })) if *last_cause == cause)
}
