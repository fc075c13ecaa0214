//! The harness of issue 19 against the installed binaries: a replicated
//! PostgreSQL pair through repeated failovers, the synchronous-commit wait
//! on a standby that is down, and a three-node JetStream cluster losing its
//! stream leader. Each test starts its own servers.

use std::time::{Duration, Instant};

use async_nats::jetstream;
use idem_testing::nats_cluster::NatsCluster;
use idem_testing::replica::{Rejoin, ReplicaPair, Replication};
use tokio_postgres::Client;

/// The bound of every wait in these tests.
const WAIT: Duration = Duration::from_secs(30);

async fn connect(url: &str) -> Client {
    idem_testing::connect(url)
        .await
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"))
}

async fn bounded<T>(what: &str, future: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(WAIT, future)
        .await
        .unwrap_or_else(|_| panic!("{what} did not finish within {WAIT:?}"))
}

async fn ids(client: &Client) -> Vec<i32> {
    bounded("SELECT", client.query("SELECT id FROM t ORDER BY id", &[]))
        .await
        .expect("select")
        .iter()
        .map(|row| row.get(0))
        .collect()
}

/// Three times: a committed row is on the standby; the primary is killed and
/// the standby promoted; the multi-host URL reaches the promoted node, which
/// has every row; the old primary rejoins as its synchronous standby, and a
/// write through the multi-host URL commits (which needs that standby).
#[tokio::test]
async fn sync_pair_fails_over_and_rejoins_three_times() {
    let started = Instant::now();
    let pair = ReplicaPair::start(Replication::Sync)
        .await
        .expect("replica pair");
    let url = pair.create_database("failover").await.expect("database");
    let primary = connect(&pair.primary_url_for("failover")).await;
    bounded(
        "setup",
        primary.batch_execute("CREATE TABLE t (id int PRIMARY KEY); INSERT INTO t VALUES (0)"),
    )
    .await
    .expect("setup");
    drop(primary);

    for cycle in 1..=3 {
        pair.wait_caught_up(WAIT).await.expect("caught up");
        let standby = connect(&pair.standby_url_for("failover")).await;
        let expected: Vec<i32> = (0..cycle).collect();
        assert_eq!(
            ids(&standby).await,
            expected,
            "standby before cycle {cycle}"
        );
        drop(standby);

        let (old, new) = (pair.primary_name(), pair.standby_name());
        pair.kill_primary().await.expect("kill the primary");
        pair.promote_standby().await.expect("promote the standby");
        assert_eq!(pair.primary_name(), new);
        assert_eq!(pair.standby_name(), old);

        let client = connect(&url).await;
        let row = bounded(
            "which node",
            client.query_one(
                "SELECT current_setting('cluster_name'), pg_is_in_recovery()",
                &[],
            ),
        )
        .await
        .expect("which node");
        assert_eq!(
            row.get::<_, String>(0),
            new,
            "the multi-host URL reaches the promoted node"
        );
        assert!(!row.get::<_, bool>(1));
        assert_eq!(
            ids(&client).await,
            expected,
            "the promoted node has every committed row"
        );
        drop(client);

        let rejoin = pair.rejoin_old_primary().await.expect("rejoin");
        eprintln!("cycle {cycle}: {old} -> {new}, old primary rejoined: {rejoin:?}");
        // The pair is set up for pg_rewind (wal_log_hints, full_page_writes);
        // the fresh-clone fallback would hide a regression there.
        assert_eq!(rejoin, Rejoin::Rewound, "pg_rewind brought {old} back");

        // A synchronous commit on the new primary: it needs the rejoined standby.
        let client = connect(&url).await;
        bounded(
            "insert",
            client.execute("INSERT INTO t VALUES ($1)", &[&cycle]),
        )
        .await
        .expect("insert");
    }
    pair.wait_caught_up(WAIT).await.expect("caught up");
    let standby = connect(&pair.standby_url_for("failover")).await;
    assert_eq!(ids(&standby).await, vec![0, 1, 2, 3]);
    eprintln!("three failovers in {:?}", started.elapsed());
}

/// Polls until the backend `pid` waits with `wait_event = 'SyncRep'`.
async fn wait_for_syncrep(observer: &Client, pid: i32) {
    let deadline = Instant::now() + WAIT;
    loop {
        let event: Option<String> = observer
            .query_one(
                "SELECT wait_event FROM pg_stat_activity WHERE pid = $1",
                &[&pid],
            )
            .await
            .expect("pg_stat_activity")
            .get(0);
        if event.as_deref() == Some("SyncRep") {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "backend {pid} never waited on SyncRep (last wait_event: {event:?})"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The synchronous-wait hole, observed on the pair alone: with the standby
/// down, a COMMIT waits (`SyncRep`) and other sessions do not see its row;
/// once the standby is back the COMMIT returns. And a waiting COMMIT whose
/// backend is terminated reports an error to its client although the row is
/// committed on the primary: an outcome the client cannot know.
#[tokio::test]
async fn sync_commit_waits_while_the_standby_is_down() {
    let pair = ReplicaPair::start(Replication::Sync)
        .await
        .expect("replica pair");
    pair.create_database("hole").await.expect("database");
    let db_url = pair.primary_url_for("hole");
    let observer = connect(&db_url).await;
    bounded(
        "setup",
        observer.batch_execute("CREATE TABLE t (id int PRIMARY KEY)"),
    )
    .await
    .expect("setup");

    // 1. The wait, released by the standby's return.
    pair.stop_standby().await.expect("stop the standby");
    let writer = connect(&db_url).await;
    let pid: i32 = writer
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pid")
        .get(0);
    let pending =
        tokio::spawn(async move { writer.execute("INSERT INTO t VALUES (1)", &[]).await });
    wait_for_syncrep(&observer, pid).await;
    assert!(!pending.is_finished(), "the COMMIT waits for the standby");
    assert_eq!(
        ids(&observer).await,
        Vec::<i32>::new(),
        "not visible while it waits"
    );
    pair.start_standby().await.expect("start the standby");
    let inserted = bounded("the waiting COMMIT", pending)
        .await
        .expect("task")
        .expect("the COMMIT completes once the standby is back");
    assert_eq!(inserted, 1);
    assert_eq!(ids(&observer).await, vec![1]);

    // 2. The hole: the waiting backend is terminated; its client gets an error,
    //    yet the row committed locally and is visible, and reaches the standby later.
    pair.stop_standby().await.expect("stop the standby");
    let writer = connect(&db_url).await;
    let pid: i32 = writer
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pid")
        .get(0);
    let pending =
        tokio::spawn(async move { writer.execute("INSERT INTO t VALUES (2)", &[]).await });
    wait_for_syncrep(&observer, pid).await;
    observer
        .execute("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .expect("terminate");
    let outcome = bounded("the terminated COMMIT", pending)
        .await
        .expect("task");
    assert!(
        outcome.is_err(),
        "its client is told it failed: {outcome:?}"
    );
    assert_eq!(
        ids(&observer).await,
        vec![1, 2],
        "yet it committed on the primary"
    );
    pair.start_standby().await.expect("start the standby");
    pair.wait_caught_up(WAIT).await.expect("caught up");
    let standby = connect(&pair.standby_url_for("hole")).await;
    assert_eq!(ids(&standby).await, vec![1, 2]);
}

/// Publishes with `Nats-Msg-Id: id` until the cluster acknowledges it
/// (while a new leader is elected, a publish may fail or time out).
async fn publish_until_acked(
    js: &jetstream::Context,
    id: &str,
    payload: &'static str,
) -> jetstream::publish::PublishAck {
    let deadline = Instant::now() + WAIT;
    loop {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", id);
        let attempt = async {
            js.publish_with_headers("events.created", headers, payload.into())
                .await?
                .await
                .map_err(async_nats::Error::from)
        };
        match tokio::time::timeout(Duration::from_secs(5), attempt).await {
            Ok(Ok(ack)) => return ack,
            failed => assert!(
                Instant::now() < deadline,
                "publish {id} not acknowledged within {WAIT:?}: {failed:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn message_count(js: &jetstream::Context) -> u64 {
    let mut stream = js.get_stream("EVENTS").await.expect("stream");
    stream.info().await.expect("info").state.messages
}

/// An R3 stream loses its leader to SIGKILL: another node is elected, a
/// republished message (same `Nats-Msg-Id`) is acknowledged as a duplicate
/// and the stream holds one copy; the killed node restarts and catches up.
#[tokio::test]
async fn r3_stream_survives_its_leader_and_deduplicates() {
    let started = Instant::now();
    let cluster = NatsCluster::start().await.expect("NATS cluster");
    let client = async_nats::connect(cluster.urls()).await.expect("connect");
    let js = jetstream::new(client);
    cluster
        .create_r3_stream(&js, "EVENTS", &["events.>"])
        .await
        .expect("R3 stream");

    let first = publish_until_acked(&js, "evt-1", "one").await;
    assert!(!first.duplicate);

    let killed = cluster
        .kill_leader("EVENTS")
        .await
        .expect("kill the leader");
    assert!(!cluster.is_running(&killed).unwrap());
    let leader = cluster
        .wait_stream_leader("EVENTS", WAIT)
        .await
        .expect("a new leader");
    assert_ne!(leader, killed, "a running node leads");

    let again = publish_until_acked(&js, "evt-1", "one").await;
    assert!(
        again.duplicate,
        "the new leader knows the message id: {again:?}"
    );
    assert_eq!(again.sequence, first.sequence);
    assert_eq!(message_count(&js).await, 1, "one copy");

    cluster.restart(&killed).await.expect("restart");
    cluster
        .wait_stream_current("EVENTS", WAIT)
        .await
        .expect("the restarted node catches up");
    let second = publish_until_acked(&js, "evt-2", "two").await;
    assert!(!second.duplicate);
    assert_eq!(message_count(&js).await, 2);
    eprintln!(
        "leader {killed} killed, {leader} elected; whole test {:?}",
        started.elapsed()
    );
}
