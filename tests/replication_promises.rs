//! What a hostile pass found around `Replication::Synchronous`, pinned: a
//! database whose default lowers `synchronous_commit`, a stored decline
//! whose commit waits for the standby, and an external claim made visible by
//! an operator's cancel. Each: the standby stopped, then a failover (the
//! primary killed, the standby promoted, the old primary rewound back), and
//! what the promoted node holds counted there, the outside call counted by
//! the outside system.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use diesel::sql_types::Text;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idem::pool::{build_pool_with, PoolConfig, Replication};
use idem::{idempotent, retryable, Deferred, Pool};
use idem_testing::replica::{self, ReplicaPair};
use tokio_postgres::Client;

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
enum Declined {
    No,
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] idem::Error),
    #[error(transparent)]
    Db(#[from] diesel::result::Error),
    #[error("declined {0:?}")]
    Declined(Declined),
}

impl idem::IdempotentError for AppError {
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

#[derive(diesel::QueryableByName)]
struct Id {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    id: i64,
}

/// Declines while `switch` is closed, else writes an effect.
#[idempotent(key = key, fingerprint(tag), scope = none)]
#[retryable(max = 2, deadline_ms = 3000, commit_timeout_ms = 500)]
async fn pay(conn: &mut AsyncPgConnection, key: &str, tag: &str) -> Result<i64, AppError> {
    let open: Id = diesel::sql_query("SELECT count(*)::bigint AS id FROM switch WHERE open")
        .get_result(conn)
        .await?;
    if open.id == 0 {
        return Err(AppError::Declined(Declined::No));
    }
    let row: Id = diesel::sql_query("INSERT INTO effects (tag) VALUES ($1) RETURNING id")
        .bind::<Text, _>(tag)
        .get_result(conn)
        .await?;
    Ok(row.id)
}

/// The outside system's own count of the calls it received.
static OUTSIDE_CALLS: AtomicU32 = AtomicU32::new(0);

#[idempotent(key = key, fingerprint(tag), mode = external, scope = none)]
#[retryable(max = 5, deadline_ms = 6000, commit_timeout_ms = 500)]
async fn refund(db: &mut Deferred<'_>, key: &str, tag: &str) -> Result<i64, AppError> {
    OUTSIDE_CALLS.fetch_add(1, Ordering::SeqCst);
    let _ = (db, tag);
    Ok(7)
}

const DB: &str = "idem_promises";
const WAIT: Duration = Duration::from_secs(30);

async fn connect(url: &str) -> Client {
    idem_testing::connect(url)
        .await
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"))
}

async fn count(client: &Client, sql: &str) -> i64 {
    tokio::time::timeout(WAIT, client.query_one(sql, &[]))
        .await
        .unwrap_or_else(|_| panic!("{sql}: no answer"))
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .get(0)
}

async fn setup(switch_open: bool) -> (ReplicaPair, Pool) {
    let pair = ReplicaPair::start(replica::Replication::Sync)
        .await
        .expect("a primary and a synchronous standby");
    let url = pair.create_database(DB).await.expect("a database");
    let mut conn = AsyncPgConnection::establish(&pair.primary_url_for(DB))
        .await
        .expect("connect");
    idem::migrate(&mut conn).await.expect("migrate");
    conn.batch_execute(&format!(
        "CREATE TABLE effects (id bigserial PRIMARY KEY, tag text NOT NULL);
         CREATE TABLE switch (open bool NOT NULL); INSERT INTO switch VALUES ({switch_open});"
    ))
    .await
    .expect("schema");
    drop(conn);
    pair.wait_caught_up(WAIT).await.expect("caught up");
    let pool = build_pool_with(
        &url,
        &PoolConfig {
            max_size: 4,
            wait_timeout: Duration::from_secs(10),
            replication: Replication::Synchronous,
            ..PoolConfig::default()
        },
    )
    .expect("a pool");
    (pair, pool)
}

async fn failover(pair: &ReplicaPair) -> Client {
    pair.kill_primary().await.expect("primary killed");
    pair.start_standby().await.expect("standby started");
    pair.promote_standby().await.expect("standby promoted");
    pair.rejoin_old_primary()
        .await
        .expect("old primary rejoined");
    connect(&pair.primary_url_for(DB)).await
}

/// A database whose default is `synchronous_commit = local` (a common
/// tuning): idem sets it back to `on` in its transactions, so a request the
/// standby lacks is not acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lowered_synchronous_commit_does_not_acknowledge_what_the_standby_lacks() {
    let (pair, _) = setup(true).await;
    let admin = connect(&pair.primary_url_for("postgres")).await;
    admin
        .batch_execute(&format!(
            "ALTER DATABASE {DB} SET synchronous_commit = local"
        ))
        .await
        .expect("lower the default");
    let pool = build_pool_with(
        &pair.url_for(DB),
        &PoolConfig {
            max_size: 4,
            replication: Replication::Synchronous,
            ..PoolConfig::default()
        },
    )
    .expect("a pool");
    pair.wait_caught_up(WAIT).await.expect("caught up");
    pair.stop_standby().await.expect("standby stopped");
    let first = pay(&pool, "s", "lowered").await;
    let promoted = failover(&pair).await;
    let records = count(&promoted, "SELECT count(*) FROM idem_requests").await;
    assert!(
        first.is_err() || records == 1,
        "acknowledged {first:?}, and the promoted node has {records} records"
    );
}

/// A decline whose storing `COMMIT` waits for the standby is not reported
/// as the final answer (it is `CommitUnknown`): after a failover the key is
/// new, and a client told "declined" would be charged on its next try.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decline_the_standby_lacks_is_not_reported() {
    let (pair, pool) = setup(false).await;
    pair.stop_standby().await.expect("standby stopped");
    let first = pay(&pool, "d", "declined").await;
    assert!(
        !matches!(first, Err(AppError::Declined(_))),
        "a decline reported while its record waits for the standby"
    );
    assert!(first.is_err(), "{first:?}");
    let promoted = failover(&pair).await;
    assert_eq!(
        count(&promoted, "SELECT count(*) FROM idem_requests").await,
        0
    );
}

/// An external claim whose wait for the standby an operator cancelled is
/// visible on the primary alone: the call does not resume it (and call the
/// outside system) before the standby holds it, so a failover cannot make
/// the outside call happen twice for one key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_external_claim_the_standby_lacks_is_not_resumed() {
    let (pair, pool) = setup(true).await;
    pair.stop_standby().await.expect("standby stopped");
    let primary_url = pair.primary_url_for(DB);
    let operator = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(600)).await;
        let c = connect(&primary_url).await;
        for _ in 0..200 {
            let cancelled = count(
                &c,
                "SELECT count(*) FROM (SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE wait_event = 'SyncRep') s",
            )
            .await;
            if cancelled > 0 {
                return cancelled;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        0
    });
    let first = refund(&pool, "c", "refund").await;
    assert!(
        operator.await.expect("the operator") > 0,
        "a wait was cancelled"
    );
    assert!(first.is_err(), "{first:?}");
    assert_eq!(
        AtomicU32::load(&OUTSIDE_CALLS, Ordering::SeqCst),
        0,
        "the claim the standby lacks was not resumed"
    );
    failover(&pair).await;
    let mut again = refund(&pool, "c", "refund").await;
    for _ in 0..10 {
        if again.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        again = refund(&pool, "c", "refund").await;
    }
    again.expect("the retry on the promoted node");
    assert_eq!(
        AtomicU32::load(&OUTSIDE_CALLS, Ordering::SeqCst),
        1,
        "one outside call"
    );
}
