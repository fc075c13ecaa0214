//! idem on a primary with a synchronous standby: a `COMMIT` that waits for a
//! standby that is down is never cancelled by idem, so what idem has not
//! told a client is done never becomes visible, and never replayed, before
//! the standby holds it. Counted on the servers themselves: the records and
//! effects each node holds, and the backend waiting in `SyncRep`.
//!
//! The hole it closes: PostgreSQL turns a cancelled wait for the synchronous
//! standby into a local commit (`WARNING: canceling wait for synchronous
//! replication ... already committed locally`). idem used to cancel a
//! `COMMIT` unanswered within `commit_timeout`: the record became visible on
//! the primary alone, a retry of the key replayed it, and a failover then
//! erased the record and its effect, after the client had been told "done".

use std::time::Duration;

use diesel::sql_types::Text;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idem::pool::{build_pool_with, PoolConfig, Replication};
use idem::{idempotent, retryable, Pool};
use idem_testing::replica::{self, ReplicaPair};
use tokio_postgres::Client;

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] idem::Error),
    #[error(transparent)]
    Db(#[from] diesel::result::Error),
}

impl idem::IdempotentError for AppError {
    type Final = ();
    fn to_final(&self) -> Option<()> {
        None
    }
    fn from_final(_: ()) -> Self {
        AppError::Idem(idem::Error::ClaimLost)
    }
}

#[derive(diesel::QueryableByName)]
struct Id {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    id: i64,
}

#[idempotent(key = key, fingerprint(tag), scope = none)]
#[retryable(max = 2, deadline_ms = 3000, commit_timeout_ms = 500)]
async fn pay(conn: &mut AsyncPgConnection, key: &str, tag: &str) -> Result<i64, AppError> {
    insert_effect(conn, tag).await
}

/// `pay` with a longer wait for `COMMIT`'s answer before the cancel: the
/// cancel must meet the commit waiting for the standby (already committed
/// locally), not a commit still on its way there, which a loaded machine can
/// hold past `pay`'s 500 ms (the cancel then aborts it, and nothing is
/// visible). The same operation as `pay`, whose duplicates meet its record.
#[idempotent(key = key, fingerprint(tag), scope = none, operation = "replication::pay")]
#[retryable(max = 1, deadline_ms = 8000, commit_timeout_ms = 3000)]
async fn pay_cancelled_late(
    conn: &mut AsyncPgConnection,
    key: &str,
    tag: &str,
) -> Result<i64, AppError> {
    insert_effect(conn, tag).await
}

/// The effect both write: one row of `effects`, its id returned.
async fn insert_effect(conn: &mut AsyncPgConnection, tag: &str) -> Result<i64, AppError> {
    let row: Id = diesel::sql_query("INSERT INTO effects (tag) VALUES ($1) RETURNING id")
        .bind::<Text, _>(tag)
        .get_result(conn)
        .await?;
    Ok(row.id)
}

const DATABASE: &str = "idem_sync";
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

/// A migrated database with an `effects` table on a synchronous pair, and
/// a pool of `replication` on its multi-host URL.
async fn setup(replication: Replication) -> (ReplicaPair, Pool) {
    let pair = ReplicaPair::start(replica::Replication::Sync)
        .await
        .expect("a primary and a synchronous standby");
    let url = pair.create_database(DATABASE).await.expect("a database");
    let mut conn = AsyncPgConnection::establish(&pair.primary_url_for(DATABASE))
        .await
        .expect("connect");
    idem::migrate(&mut conn).await.expect("migrate");
    conn.batch_execute("CREATE TABLE effects (id bigserial PRIMARY KEY, tag text NOT NULL)")
        .await
        .expect("schema");
    drop(conn);
    pair.wait_caught_up(WAIT).await.expect("caught up");
    let pool = build_pool_with(
        &url,
        &PoolConfig {
            max_size: 4,
            wait_timeout: Duration::from_secs(10),
            replication,
            ..PoolConfig::default()
        },
    )
    .expect("a pool");
    (pair, pool)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_waiting_for_the_standby_is_never_reported_or_replayed_and_a_failover_loses_nothing_acknowledged(
) {
    let (pair, pool) = setup(Replication::Synchronous).await;
    pair.stop_standby().await.expect("standby stopped");

    // The COMMIT waits for the standby past commit_timeout: not done.
    let first = pay(&pool, "k1", "first").await;
    assert!(
        first.is_err(),
        "a commit the standby lacks was reported: {first:?}"
    );
    let primary = connect(&pair.primary_url_for(DATABASE)).await;
    assert_eq!(
        count(
            &primary,
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'"
        )
        .await,
        1,
        "the COMMIT still waits for the standby: idem did not cancel it"
    );
    for table in ["idem_requests", "effects"] {
        assert_eq!(
            count(&primary, &format!("SELECT count(*) FROM {table}")).await,
            0,
            "{table}: nothing the standby lacks is visible on the primary"
        );
    }
    // A duplicate waits behind the first (its lock), and is not a replay.
    let duplicate = pay(&pool, "k1", "first").await;
    assert!(
        duplicate.is_err(),
        "replayed what the standby lacks: {duplicate:?}"
    );

    // The primary dies; the standby, which never received the commit, is
    // promoted; the old primary rejoins as its standby (rewound).
    pair.kill_primary().await.expect("primary killed");
    pair.start_standby().await.expect("standby started");
    pair.promote_standby().await.expect("standby promoted");
    pair.rejoin_old_primary()
        .await
        .expect("old primary rejoined");
    let promoted = connect(&pair.primary_url_for(DATABASE)).await;
    assert_eq!(
        count(&promoted, "SELECT count(*) FROM idem_requests").await,
        0,
        "the record was lost with the old primary: no client was told it was done"
    );

    // The client's retry, through the same pool: it finds the promoted node
    // and runs the request once there.
    let mut retried = pay(&pool, "k1", "first").await;
    for _ in 0..10 {
        if retried.is_ok() {
            break;
        }
        // The pool's connections to the dead primary are discarded as the
        // attempts meet them.
        tokio::time::sleep(Duration::from_millis(300)).await;
        retried = pay(&pool, "k1", "first").await;
    }
    let retried = retried.expect("the retry runs on the promoted node");
    assert!(!retried.replayed);
    assert_eq!(count(&promoted, "SELECT count(*) FROM effects").await, 1);
    let again = pay(&pool, "k1", "first").await.expect("a replay");
    assert!(again.replayed);
    assert_eq!(again.value, retried.value);
    assert_eq!(count(&promoted, "SELECT count(*) FROM effects").await, 1);
}

/// A record made visible on the primary alone (its commit's wait for the
/// standby was cancelled: here by a pool left at `Replication::Single`, as
/// an operator's `pg_cancel_backend` or `client_connection_check_interval`
/// would) is not replayed by a `Replication::Synchronous` pool until the
/// standby holds it: the duplicate is answered 503 at its deadline, and
/// replays once the standby is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_visible_on_the_primary_alone_is_not_replayed_until_the_standby_holds_it() {
    let (pair, pool) = setup(Replication::Synchronous).await;
    let cancelling = build_pool_with(
        &pair.url_for(DATABASE),
        &PoolConfig {
            max_size: 2,
            wait_timeout: Duration::from_secs(10),
            ..PoolConfig::default()
        },
    )
    .expect("a pool");
    pair.stop_standby().await.expect("standby stopped");
    let first = pay_cancelled_late(&cancelling, "k2", "second").await;
    assert!(first.is_err(), "{first:?}");
    let primary = connect(&pair.primary_url_for(DATABASE)).await;
    assert_eq!(
        count(
            &primary,
            "SELECT count(*) FROM idem_requests WHERE key = 'k2'"
        )
        .await,
        1,
        "the cancelled wait committed the record locally: visible, not replicated"
    );

    let duplicate = pay(&pool, "k2", "second").await;
    assert!(
        duplicate.is_err(),
        "replayed a record the standby does not hold: {duplicate:?}"
    );

    pair.start_standby().await.expect("standby back");
    let replayed = pay(&pool, "k2", "second")
        .await
        .expect("a replay, now that the standby holds it");
    assert!(replayed.replayed);
    assert_eq!(
        count(
            &primary,
            "SELECT count(*) FROM effects WHERE tag = 'second'"
        )
        .await,
        1
    );
}

/// Without the right to read the standbys' positions (the role that ran
/// `idem::migrate` is neither a superuser nor in `pg_read_all_stats`), a
/// replay with `Replication::Synchronous` is refused with an error that says
/// so, rather than waiting for a position it cannot see, or replaying.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_that_cannot_read_the_standbys_positions_is_told_so() {
    let pair = ReplicaPair::start(replica::Replication::Sync)
        .await
        .expect("a primary and a synchronous standby");
    pair.create_database("idem_app").await.expect("a database");
    let admin = connect(&pair.primary_url_for("idem_app")).await;
    admin
        .batch_execute(
            "CREATE ROLE app LOGIN; ALTER DATABASE idem_app OWNER TO app;
             ALTER SCHEMA public OWNER TO app;",
        )
        .await
        .expect("an unprivileged owner");
    let as_app = |url: String| url.replace("postgres://postgres@", "postgres://app@");
    let mut conn = AsyncPgConnection::establish(&as_app(pair.primary_url_for("idem_app")))
        .await
        .expect("connect as app");
    idem::migrate(&mut conn).await.expect("migrate as app");
    conn.batch_execute("CREATE TABLE effects (id bigserial PRIMARY KEY, tag text NOT NULL)")
        .await
        .expect("schema");
    drop(conn);
    let pool = build_pool_with(
        &as_app(pair.url_for("idem_app")),
        &PoolConfig {
            max_size: 2,
            replication: Replication::Synchronous,
            ..PoolConfig::default()
        },
    )
    .expect("a pool");
    let fresh = pay(&pool, "k3", "third").await.expect("a fresh request");
    assert!(!fresh.replayed);
    let duplicate = pay(&pool, "k3", "third").await;
    let message = format!("{duplicate:?}");
    assert!(
        duplicate.is_err() && message.contains("pg_stat_replication"),
        "{message}"
    );
}

/// A body that sends its own `COMMIT` (queued, then `Ok`, or then an
/// error) under a plain `#[retryable]` on a `Replication::Synchronous`
/// pool.
#[retryable(max = 1, deadline_ms = 3000, commit_timeout_ms = 500)]
async fn commit_by_hand(
    conn: &mut AsyncPgConnection,
    tag: &str,
    fail: bool,
) -> Result<i64, AppError> {
    use futures_util::FutureExt;
    let id = insert_effect(conn, tag).await?;
    drop(conn.batch_execute("COMMIT").now_or_never());
    tokio::time::sleep(Duration::from_millis(50)).await;
    match fail {
        true => Err(AppError::Idem(idem::Error::ClaimLost)),
        false => Ok(id),
    }
}

/// The body's own `COMMIT`, waiting for the standby past
/// `commit_timeout_ms`, is not cancelled either (a cancel would commit it
/// locally: visible on the primary, not replicated): idem reads it a second
/// `commit_timeout_ms`, then closes the connection with the backend still
/// waiting, and answers that the body ended the transaction, its writes
/// perhaps committed. Nothing is visible on the primary meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_the_body_sent_waiting_for_the_standby_is_not_cancelled() {
    let (pair, pool) = setup(Replication::Synchronous).await;
    pair.stop_standby().await.expect("standby stopped");
    for (tag, fail) in [("ok-end", false), ("error-end", true)] {
        let r = commit_by_hand(&pool, tag, fail).await;
        assert!(
            matches!(
                r,
                Err(AppError::Idem(idem::Error::TransactionEnded {
                    committed: true
                }))
            ),
            "{tag}: {r:?}"
        );
    }
    let primary = connect(&pair.primary_url_for(DATABASE)).await;
    let waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'";
    assert_eq!(
        count(&primary, waiting).await,
        2,
        "both COMMITs still wait for the standby"
    );
    assert_eq!(
        count(&primary, "SELECT count(*) FROM effects").await,
        0,
        "a cancelled wait made a body's commit visible on the primary alone"
    );
    pair.start_standby().await.expect("standby back");
    let replicated = || async { count(&primary, "SELECT count(*) FROM effects").await == 2 };
    let mut seen = false;
    for _ in 0..100 {
        if replicated().await {
            seen = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(seen, "the two commits complete once the standby is back");
}
