//! The retry loop sees every failure, whatever diesel call met it: a matrix
//! of every way a body runs SQL ([`shapes`]) against every failure class
//! ([`classes`]), each cell twice, the body returning the error and the body
//! swallowing it and returning `Ok`, against a real PostgreSQL.
//!
//! Each attempt first inserts its effect (a row of `effects` for the cell),
//! then meets the failure; the outcome is checked against the table, never
//! against what the loop reports:
//!
//! * a transient cause (40001, 40P01, idem's own `lock_timeout`, a lost
//!   connection) met on the first attempt only is replayed: the call answers
//!   `Ok` after two attempts, and exactly one effect committed;
//! * idem's own `statement_timeout` (the deadline) ends the call with
//!   `Exhausted { last_cause: DeadlineExceeded }` (503), nothing committed;
//! * any other error (a user's 23505, 22012) is the body's own error after one
//!   attempt when returned, and `Error::RolledBack` when swallowed: nothing
//!   committed either way, never `Ok`.
//!
//! A failure inside `conn.transaction(..)` (a savepoint) that the body
//! swallows was undone by the savepoint's rollback: that body commits, in
//! its first attempt (idem's `statement_timeout` included: it bounds each
//! statement, and the body chose to go on). One it passes on is replayed
//! like any other.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use diesel::result::Error as DieselError;
use diesel_async::AsyncPgConnection;
use idem::retry::retry;
use idem::{Isolation, Pool, RetryCause, RetryPolicy, Versioned, VersionedChanges, VersionedError};
use idem_testing::TestDatabase;
use scoped_futures::ScopedFutureExt;

#[path = "../support/pool.rs"]
mod test_pool;

mod by_hand;
mod classes;
mod shapes;

use classes::{Class, Side};
use shapes::Shape;

diesel::table! {
    counters (id) {
        id -> Int8,
        n -> Int8,
        version -> Int8,
    }
}

/// A versioned row, for the versioned-update shape.
#[derive(Debug, Clone, diesel::Queryable, diesel::Selectable, Versioned)]
#[diesel(table_name = counters)]
#[versioned(tenant = none, version = version, key = id)]
pub struct Counter {
    id: i64,
    n: i64,
    version: i64,
}

#[derive(VersionedChanges)]
#[versioned(model = Counter)]
#[diesel(table_name = counters)]
pub struct SetN {
    n: i64,
}

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error(transparent)]
    Db(#[from] DieselError),
    #[error(transparent)]
    Versioned(#[from] VersionedError),
    #[error(transparent)]
    Idem(#[from] idem::Error),
}

const SCHEMA: &str = "
    CREATE TABLE counters (id bigint PRIMARY KEY, n bigint NOT NULL DEFAULT 0,
                           version bigint NOT NULL DEFAULT 0);
    INSERT INTO counters (id) SELECT generate_series(1, 2000);
    CREATE TABLE effects (cell text NOT NULL, attempt int NOT NULL);
    CREATE TABLE uniq (id bigint PRIMARY KEY);
    INSERT INTO uniq VALUES (1);
    CREATE TABLE sink (v bigint NOT NULL);
    CREATE TABLE deferred_unique (id bigint, UNIQUE (id) DEFERRABLE INITIALLY DEFERRED);
    -- The failures, each a bigint-valued function any shape can run.
    CREATE FUNCTION matrix_lock(r bigint) RETURNS bigint LANGUAGE plpgsql AS
        $$ BEGIN PERFORM 1 FROM counters WHERE id = r FOR UPDATE; RETURN r; END $$;
    CREATE FUNCTION matrix_sleep(s float8) RETURNS bigint LANGUAGE plpgsql AS
        $$ BEGIN PERFORM pg_sleep(s); RETURN 0; END $$;
    CREATE FUNCTION matrix_dup() RETURNS bigint LANGUAGE plpgsql AS
        $$ BEGIN INSERT INTO uniq VALUES (1); RETURN 1; END $$;
    CREATE FUNCTION matrix_div() RETURNS bigint LANGUAGE plpgsql AS
        $$ BEGIN RETURN 1 / 0; END $$;
";

/// Whether the body passes the failure on or swallows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Body {
    Returns,
    Swallows,
}

/// What a cell must end with, read from the table and the call's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// `Ok` after this many attempts, one effect committed.
    Committed { attempts: u32 },
    /// `Exhausted` with this cause, nothing committed.
    Exhausted(RetryCause),
    /// The body's own database error after one attempt, nothing committed.
    BodyError,
    /// `Error::RolledBack` after one attempt, nothing committed.
    RolledBack,
}

pub struct Env {
    pub pool: Pool,
    pub client: tokio_postgres::Client,
    pub db: TestDatabase,
}

impl Env {
    pub async fn new() -> Env {
        let db = TestDatabase::create()
            .await
            .expect("create the test database");
        let client = idem_testing::connect(db.url()).await.expect("connect");
        client
            .batch_execute(SCHEMA)
            .await
            .expect("create the schema");
        let pool = test_pool::test_pool(&db, 4, Duration::from_secs(10));
        Env { pool, client, db }
    }

    /// Another session, holding `row` of `counters` locked until it rolls back.
    pub async fn hold_row(&self, row: i64) -> tokio_postgres::Client {
        let holder = idem_testing::connect(self.db.url()).await.unwrap();
        holder
            .batch_execute(&format!(
                "BEGIN; SELECT 1 FROM counters WHERE id = {row} FOR UPDATE"
            ))
            .await
            .unwrap();
        holder
    }

    pub async fn effects(&self, cell: &str) -> i64 {
        self.client
            .query_one("SELECT count(*) FROM effects WHERE cell = $1", &[&cell])
            .await
            .unwrap()
            .get(0)
    }
}

/// Wait until backend `pid` satisfies `condition` (SQL over pg_stat_activity).
pub async fn wait_for_backend(client: &tokio_postgres::Client, pid: i32, condition: &str) {
    let query =
        format!("SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND {condition})");
    let until = Instant::now() + Duration::from_secs(20);
    while !client
        .query_one(&query, &[&pid])
        .await
        .unwrap()
        .get::<_, bool>(0)
    {
        assert!(
            Instant::now() < until,
            "backend {pid} never reached {condition}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The policy of a cell: a short deadline for the class that runs into it,
/// room for two attempts otherwise.
fn policy(class: Class) -> RetryPolicy {
    let policy = RetryPolicy::new().max_attempts(3);
    match class {
        Class::StatementTimeout => policy.deadline(Duration::from_millis(400)),
        Class::Serialization => policy
            .deadline(Duration::from_secs(4))
            .isolation(Isolation::RepeatableRead),
        // idem's lock_timeout is half the time left: 600 ms on the first attempt.
        Class::LockTimeout => policy.deadline(Duration::from_millis(1200)),
        _ => policy.deadline(Duration::from_secs(4)),
    }
}

fn expect(shape: Shape, class: Class, body: Body) -> Expect {
    // A savepoint's rollback undid the failure (a lost connection cannot be
    // undone): the body that swallows it commits, in its first attempt.
    if shape == Shape::Nested && body == Body::Swallows && class != Class::ConnectionLost {
        return Expect::Committed { attempts: 1 };
    }
    if let Some(cause) = class.deadline_cause() {
        return Expect::Exhausted(cause);
    }
    match (class.transient(), body) {
        (true, _) => Expect::Committed { attempts: 2 },
        (false, Body::Returns) => Expect::BodyError,
        (false, Body::Swallows) => Expect::RolledBack,
    }
}

/// Run one cell and check it; `row` is the cell's own counters row.
async fn cell(env: &Env, shape: Shape, class: Class, body: Body, row: i64) {
    let name = format!("{shape:?}/{class:?}/{body:?}");
    let side = Arc::new(Side::prepare(env, class, row).await);
    let runs = AtomicU32::new(0);
    let outcome: Result<(), AppError> = retry(&env.pool, policy(class), "matrix", |conn| {
        let (name, side, runs) = (&name, Arc::clone(&side), &runs);
        async move {
            let attempt = runs.fetch_add(1, Ordering::SeqCst) + 1;
            record_effect(conn, name, attempt).await?;
            side.before(env, conn, attempt).await;
            let met = shape.run(conn, &class.sql(row), row).await;
            match (met, body) {
                (Err(e), Body::Returns) => Err(e),
                _ => Ok(()),
            }
        }
        .scope_boxed()
    })
    .await;
    side.finish(env).await;
    let effects = env.effects(&name).await;
    let attempts = runs.load(Ordering::SeqCst);
    let expected = expect(shape, class, body);
    let held = match (expected, &outcome) {
        (Expect::Committed { attempts: a }, Ok(())) => effects == 1 && attempts == a,
        (
            Expect::Exhausted(cause),
            Err(AppError::Idem(idem::Error::Exhausted { last_cause, .. })),
        ) => effects == 0 && *last_cause == cause,
        (Expect::BodyError, Err(AppError::Db(_) | AppError::Versioned(_))) => {
            effects == 0 && attempts == 1
        }
        (Expect::RolledBack, Err(AppError::Idem(idem::Error::RolledBack))) => {
            effects == 0 && attempts == 1
        }
        _ => false,
    };
    assert!(
        held,
        "{name}: expected {expected:?}, got {outcome:?} after {attempts} attempt(s) with {effects} effect(s) committed"
    );
}

pub async fn record_effect(
    conn: &mut AsyncPgConnection,
    cell: &str,
    attempt: u32,
) -> Result<(), AppError> {
    use diesel_async::RunQueryDsl;
    diesel::sql_query("INSERT INTO effects (cell, attempt) VALUES ($1, $2)")
        .bind::<diesel::sql_types::Text, _>(cell)
        .bind::<diesel::sql_types::Integer, _>(attempt as i32)
        .execute(conn)
        .await?;
    Ok(())
}

/// Every shape against `classes`, both bodies; rows are numbered from `first`.
async fn run_classes(classes: &[Class], first: i64) {
    let env = Env::new().await;
    let mut row = first;
    for &class in classes {
        for shape in Shape::ALL {
            if !shape.meets(class) {
                continue;
            }
            for body in [Body::Returns, Body::Swallows] {
                row += 1;
                cell(&env, shape, class, body, row).await;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn serialization_failures_are_replayed() {
    run_classes(&[Class::Serialization], 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deadlocks_are_replayed() {
    run_classes(&[Class::Deadlock], 100).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idems_lock_timeout_is_replayed() {
    run_classes(&[Class::LockTimeout], 200).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idems_statement_timeout_ends_the_call_with_503() {
    run_classes(&[Class::StatementTimeout], 300).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lost_connection_is_replayed() {
    run_classes(&[Class::ConnectionLost], 400).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn other_errors_are_the_bodys_and_never_commit() {
    run_classes(&[Class::UniqueViolation, Class::DivisionByZero], 500).await;
}

/// A row held longer than the deadline: a versioned update waits on it,
/// attempt after attempt, and the call ends with 503's cause.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_versioned_update_on_a_held_row_is_replayed_until_the_deadline() {
    let env = Env::new().await;
    for (row, body) in [(900, Body::Returns), (901, Body::Swallows)] {
        let holder = env.hold_row(row).await;
        let runs = AtomicU32::new(0);
        let started = Instant::now();
        let policy = RetryPolicy::new()
            .max_attempts(5)
            .deadline(Duration::from_millis(1500));
        let outcome: Result<(), AppError> = retry(&env.pool, policy, "held", |conn| {
            let runs = &runs;
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                let met = Shape::Versioned.run(conn, "", row).await;
                match (met, body) {
                    (Err(e), Body::Returns) => Err(e),
                    _ => Ok(()),
                }
            }
            .scope_boxed()
        })
        .await;
        let elapsed = started.elapsed();
        holder.batch_execute("ROLLBACK").await.unwrap();
        assert!(
            matches!(
                &outcome,
                Err(AppError::Idem(idem::Error::Exhausted { last_cause, .. })) if last_cause.is_timeout()
            ),
            "{body:?}: {outcome:?}"
        );
        assert!(runs.load(Ordering::SeqCst) >= 2, "{body:?}: replayed");
        assert!(
            elapsed < Duration::from_secs(10),
            "{body:?}: bounded, took {elapsed:?}"
        );
        let version: i64 = env
            .client
            .query_one("SELECT version FROM counters WHERE id = $1", &[&row])
            .await
            .unwrap()
            .get(0);
        assert_eq!(version, 0, "{body:?}: nothing committed");
    }
}
