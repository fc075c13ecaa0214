//! An idempotent replay in local mode answers from a transaction that wrote
//! nothing, and ends that transaction with `ROLLBACK` in the background
//! after answering. Here, hundreds of replays, one after another and many at
//! once on a pool of two connections: each one answers the first response;
//! afterwards no backend sits idle in a transaction, the pool has every
//! connection back (the same connections: none was discarded), a new request
//! still runs on it, and the server counted one rollback and no commit per
//! replay.
//!
//! Everything is observed from a connection to another database, so the
//! observing adds nothing to the test database's counters.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idem::pool::{build_pool_with, PoolConfig};
use idem::{idempotent, retryable, IdempotentError, Pool};
use idem_testing::TestDatabase;
use serde::{Deserialize, Serialize};
use tokio::sync::Barrier;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
enum Declined {
    Refused,
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Db(#[from] diesel::result::Error),
    #[error(transparent)]
    Idem(#[from] idem::Error),
    #[error("declined: {0:?}")]
    Declined(Declined),
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
}

const SCHEMA: &str = "
    CREATE TABLE payments (id bigint PRIMARY KEY, amount bigint NOT NULL, memo text NOT NULL);
";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Payment {
    id: i64,
    amount: i64,
    memo: String,
}

#[derive(Debug, Clone)]
struct PayCmd {
    key: String,
    amount: i64,
}

fn cmd(key: &str, amount: i64) -> PayCmd {
    PayCmd {
        key: key.to_owned(),
        amount,
    }
}

/// Each caller proposes its own payment id: a replay that ran the body would
/// answer (or fail on) another id.
#[idempotent(key = cmd.key, fingerprint(cmd.amount), scope = none)]
#[retryable(max = 4, deadline_ms = 30000)]
async fn pay(
    conn: &mut AsyncPgConnection,
    cmd: &PayCmd,
    proposed_id: i64,
) -> Result<Payment, AppError> {
    let memo = format!("payment {proposed_id}");
    diesel::sql_query("INSERT INTO payments (id, amount, memo) VALUES ($1, $2, $3)")
        .bind::<BigInt, _>(proposed_id)
        .bind::<BigInt, _>(cmd.amount)
        .bind::<Text, _>(&memo)
        .execute(conn)
        .await?;
    Ok(Payment {
        id: proposed_id,
        amount: cmd.amount,
        memo,
    })
}

fn pool_of(db: &TestDatabase, size: usize) -> Pool {
    build_pool_with(
        db.url(),
        &PoolConfig {
            max_size: size,
            wait_timeout: Duration::from_secs(60),
            ..Default::default()
        },
    )
    .expect("build the pool")
}

/// A connection to the server's own database, never to the test database.
async fn admin_connection() -> tokio_postgres::Client {
    let url = idem_testing::server_url().expect("the server's URL");
    idem_testing::connect(&url).await.expect("connect")
}

struct Observer {
    admin: tokio_postgres::Client,
    name: String,
}

impl Observer {
    async fn count(&self, condition: &str) -> i64 {
        let query =
            format!("SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND ({condition})");
        self.admin
            .query_one(&query, &[&self.name])
            .await
            .unwrap_or_else(|e| panic!("{query}: {e}"))
            .get(0)
    }

    /// The client backends connected to the test database, by state.
    async fn backends(&self) -> Vec<(i32, Option<String>)> {
        self.admin
            .query(
                "SELECT pid, state FROM pg_stat_activity WHERE datname = $1 \
                 AND backend_type = 'client backend' ORDER BY pid",
                &[&self.name],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect()
    }

    /// `(xact_commit, xact_rollback)` of the test database once no backend of
    /// it is left: a backend flushes its counters at the latest when it
    /// exits, and autovacuum's visits are waited out by the stability check.
    async fn settled_transactions(&self) -> (i64, i64) {
        let until = Instant::now() + Duration::from_secs(30);
        while self.count("true").await > 0 {
            assert!(
                Instant::now() < until,
                "backends of the test database did not exit: {:?}",
                self.backends().await
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let read = || async {
            self.admin
                .batch_execute("SELECT pg_stat_clear_snapshot()")
                .await
                .unwrap();
            let row = self
                .admin
                .query_one(
                    "SELECT xact_commit, xact_rollback FROM pg_stat_database WHERE datname = $1",
                    &[&self.name],
                )
                .await
                .unwrap();
            (row.get::<_, i64>(0), row.get::<_, i64>(1))
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
}

const SEQUENTIAL: i64 = 200;
const CONCURRENT: i64 = 100;

/// Open both connections of a fresh pool of two, so that every window pays
/// the same connection set-up; returns their backend pids.
async fn warm(pool: &Pool, observer: &Observer) -> BTreeSet<i32> {
    let (a, b) = tokio::join!(pool.get(), pool.get());
    drop((a.expect("a connection"), b.expect("a connection")));
    let pids: BTreeSet<i32> = observer.backends().await.iter().map(|b| b.0).collect();
    assert_eq!(pids.len(), 2, "{:?}", observer.backends().await);
    pids
}

/// Replays of `first` on `pool`: `SEQUENTIAL` one after another, then
/// `CONCURRENT` at once. Each is a replay with the first response.
async fn replay(pool: &Pool, first: &Payment) {
    for i in 0..SEQUENTIAL {
        let answer = pay(pool, &cmd("order-1", 3000), 10_000 + i)
            .await
            .expect("a replay is answered");
        assert!(answer.replayed, "sequential replay {i} ran the body");
        assert_eq!(&answer.value, first, "sequential replay {i}");
    }
    let barrier = Arc::new(Barrier::new(CONCURRENT as usize));
    let tasks: Vec<_> = (0..CONCURRENT)
        .map(|i| {
            let pool = pool.clone();
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                pay(&pool, &cmd("order-1", 3000), 20_000 + i).await
            })
        })
        .collect();
    for (i, task) in tasks.into_iter().enumerate() {
        let answer = task.await.expect("the task").expect("a replay is answered");
        assert!(answer.replayed, "concurrent replay {i} ran the body");
        assert_eq!(&answer.value, first, "concurrent replay {i}");
    }
}

/// Once the background rollbacks are done: no backend of the test database
/// is in a transaction, the pool has both connections back, and they are
/// still the `pids` it opened.
async fn assert_clean(pool: &Pool, observer: &Observer, pids: &BTreeSet<i32>) {
    // The replays' ROLLBACKs run after their answers: give them a moment.
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let status = pool.status();
        let busy = observer
            .count("backend_type = 'client backend' AND state IS DISTINCT FROM 'idle'")
            .await;
        if (status.size == status.available && status.waiting == 0 && busy == 0)
            || Instant::now() >= until
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        observer.count("state LIKE 'idle in transaction%'").await,
        0,
        "a backend sits idle in a transaction: {:?}",
        observer.backends().await
    );
    let backends = observer.backends().await;
    assert!(
        backends
            .iter()
            .all(|(_, state)| state.as_deref() == Some("idle")),
        "every backend is idle: {backends:?}"
    );
    let status = pool.status();
    assert_eq!(
        (status.size, status.available, status.waiting),
        (2, 2, 0),
        "every connection is back in the pool: {status:?}"
    );
    let now: BTreeSet<i32> = backends.iter().map(|b| b.0).collect();
    assert_eq!(&now, pids, "the replays kept the pool's connections");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replays_end_their_transactions_with_a_rollback_and_leave_the_pool_clean() {
    let db = TestDatabase::create()
        .await
        .expect("create the test database");
    {
        let mut conn = AsyncPgConnection::establish(db.url())
            .await
            .expect("connect");
        idem::migrate(&mut conn).await.expect("migrate");
        conn.batch_execute(SCHEMA).await.expect("schema");
    }
    let observer = Observer {
        admin: admin_connection().await,
        name: db.name().to_owned(),
    };

    // The first request, on a pool of its own.
    let first = {
        let pool = pool_of(&db, 2);
        let first = pay(&pool, &cmd("order-1", 3000), 1).await.unwrap();
        assert!(!first.replayed);
        first.value
    };

    // Windows of the same shape, with and without the replays: a fresh pool
    // of two, both connections opened, one new request, the pool dropped.
    // Autovacuum may add commits to a window, never take any away, so a
    // clean pair of windows shows the exact difference.
    let mut seen = Vec::new();
    for round in 0..3_i64 {
        let mut deltas = Vec::new();
        for with_replays in [false, true] {
            let before = observer.settled_transactions().await;
            {
                let pool = pool_of(&db, 2);
                let pids = warm(&pool, &observer).await;
                if with_replays {
                    replay(&pool, &first).await;
                    assert_clean(&pool, &observer, &pids).await;
                }
                // A new key still works on the same pool.
                let key = format!("new-{round}-{with_replays}");
                let id = 100 * (round + 1) + i64::from(with_replays);
                let new = pay(&pool, &cmd(&key, 50), id).await.unwrap();
                assert!(!new.replayed);
                assert_eq!(new.value.id, id);
                assert_clean(&pool, &observer, &pids).await;
            }
            let after = observer.settled_transactions().await;
            deltas.push((after.0 - before.0, after.1 - before.1));
        }
        let (without, with) = (deltas[0], deltas[1]);
        seen.push((without, with));
        if with.0 == without.0 && with.1 - without.1 == SEQUENTIAL + CONCURRENT {
            break;
        }
    }
    let (without, with) = *seen.last().unwrap();
    assert_eq!(
        (with.0 - without.0, with.1 - without.1),
        (0, SEQUENTIAL + CONCURRENT),
        "replays must add no commit and one rollback each; (commits, rollbacks) \
         per round, (without replays, with replays): {seen:?}"
    );

    // The body ran once per new request, never for a replay.
    let mut conn = AsyncPgConnection::establish(db.url())
        .await
        .expect("connect");
    #[derive(diesel::QueryableByName)]
    struct Count {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    let payments: Count = diesel::sql_query("SELECT count(*) AS n FROM payments")
        .get_result(&mut conn)
        .await
        .unwrap();
    assert_eq!(payments.n, 1 + 2 * seen.len() as i64);
}
