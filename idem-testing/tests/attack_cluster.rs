//! Hostile tests of the throwaway-cluster API (`start_throwaway_cluster`,
//! `start_throwaway_cluster_with`, `Cluster`, `HarnessError`), written from
//! the rustdoc alone (session 51's pass). The tests take turns (see
//! `support::snapshot`): they look at the process table and the temp
//! directory, and one sets `IDEM_PG_BIN`. Every case checks that no server
//! process and no directory of the cluster's is left behind.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

use idem_testing::{start_throwaway_cluster, start_throwaway_cluster_with, Cluster, HarnessError};
use tokio_postgres::NoTls;

#[path = "attack_cluster/support.rs"]
mod support;
use support::*;

// ---------- the happy path and lifecycle ----------

/// Inside a tokio runtime: the URL works, the accessors agree, drop removes everything.
#[test]
fn url_works_inside_a_runtime_and_drop_cleans_up() {
    let before = snapshot();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(inside_a_runtime(&before));
}

async fn inside_a_runtime(before: &Snapshot) {
    let cluster = start_throwaway_cluster().expect("start");
    assert!(cluster
        .url()
        .ends_with(&format!(":{}/postgres", cluster.port())));
    assert!(cluster.data_dir().starts_with(cluster.dir()));
    assert!(cluster.bin_dir().join("postgres").is_file());
    assert!(cluster.data_dir().join("PG_VERSION").is_file());
    let client = connect(cluster.url()).await;
    assert_eq!(show(&client, "port").await, cluster.port().to_string());
    assert_eq!(show(&client, "lc_messages").await, "C");
    let user: String = client
        .query_one("SELECT current_user", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(user, "postgres");
    assert!(
        !pids_in(cluster.dir()).is_empty(),
        "no server process found"
    );
    let dir = cluster.dir().to_owned();
    drop(client);
    drop(cluster);
    assert!(!dir.exists(), "{} survived drop", dir.display());
    assert_nothing_left(before, "after drop");
}

/// Outside any runtime (plain thread), start works and drop cleans up.
#[test]
fn url_works_outside_a_runtime() {
    let before = snapshot();
    let cluster = start_throwaway_cluster().expect("start");
    let port = rt().block_on(async {
        let client = connect(cluster.url()).await;
        show(&client, "port").await
    });
    assert_eq!(port, cluster.port().to_string());
    drop(cluster);
    assert_nothing_left(&before, "after drop");
}

/// Settings given by the caller take effect (`SHOW`), including ones only a start can change.
#[test]
fn settings_take_effect() {
    let before = snapshot();
    let cluster = start_throwaway_cluster_with(&[
        ("max_prepared_transactions", "4"),
        ("work_mem", "'3MB'"),
        ("log_line_prefix", "'%m it''s # \\\\ '"),
        // Overrides one of the harness's own, later lines win.
        ("max_connections", "50"),
    ])
    .expect("start");
    rt().block_on(async {
        let client = connect(cluster.url()).await;
        assert_eq!(show(&client, "max_prepared_transactions").await, "4");
        assert_eq!(show(&client, "work_mem").await, "3MB");
        assert_eq!(show(&client, "log_line_prefix").await, "%m it's # \\ ");
        assert_eq!(show(&client, "max_connections").await, "50");
    });
    drop(cluster);
    assert_nothing_left(&before, "after drop");
}

/// Dropping with open connections (and a query in flight) stops the server and
/// the connections then fail instead of hanging.
#[test]
fn drop_with_open_connections() {
    let before = snapshot();
    let cluster = start_throwaway_cluster().expect("start");
    let url = cluster.url().to_owned();
    rt().block_on(async move {
        let a = connect(&url).await;
        let b = connect(&url).await;
        a.batch_execute("BEGIN; CREATE TABLE t (id int); INSERT INTO t VALUES (1)")
            .await
            .unwrap();
        let sleeper = tokio::spawn(async move { b.query("SELECT pg_sleep(30)", &[]).await });
        tokio::time::sleep(Duration::from_millis(300)).await;
        let started = Instant::now();
        tokio::task::spawn_blocking(move || drop(cluster))
            .await
            .unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "drop took {:?}",
            started.elapsed()
        );
        let slept = tokio::time::timeout(Duration::from_secs(10), sleeper)
            .await
            .expect("in-flight query hung after drop")
            .unwrap();
        assert!(slept.is_err(), "in-flight query succeeded after drop");
        let after = tokio::time::timeout(Duration::from_secs(10), a.query("SELECT 1", &[]))
            .await
            .expect("query hung after drop");
        assert!(after.is_err(), "query succeeded after drop");
        assert!(
            tokio_postgres::connect(&url, NoTls).await.is_err(),
            "URL still answers"
        );
    });
    assert_nothing_left(&before, "after drop with open connections");
}

/// Several clusters at once from several threads: distinct ports and
/// directories, each answers, and all are cleaned up.
#[test]
fn many_clusters_at_once() {
    let before = snapshot();
    let clusters: Vec<Cluster> = (0..4)
        .map(|_| std::thread::spawn(start_throwaway_cluster))
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().unwrap().expect("start"))
        .collect();
    let ports: BTreeSet<u16> = clusters.iter().map(Cluster::port).collect();
    let dirs: BTreeSet<&Path> = clusters.iter().map(Cluster::dir).collect();
    assert_eq!(ports.len(), 4, "ports collide: {ports:?}");
    assert_eq!(dirs.len(), 4, "dirs collide: {dirs:?}");
    rt().block_on(async {
        for cluster in &clusters {
            let client = connect(cluster.url()).await;
            assert_eq!(show(&client, "port").await, cluster.port().to_string());
            let dd = show(&client, "data_directory").await;
            assert_eq!(Path::new(&dd), cluster.data_dir());
        }
    });
    drop(clusters);
    assert_nothing_left(&before, "after dropping 4 clusters");
}

/// A panic in a test while a cluster is alive still stops and removes it.
#[test]
fn panic_while_cluster_alive_cleans_up() {
    let before = snapshot();
    let handle = std::thread::spawn(|| {
        let cluster = start_throwaway_cluster().expect("start");
        assert!(!pids_in(cluster.dir()).is_empty());
        panic!("deliberate panic with cluster on port {}", cluster.port());
    });
    assert!(handle.join().is_err());
    assert_nothing_left(&before, "after a panic");
}

/// `Cluster` can be moved to and shared between threads (e.g. a static, spawn_blocking).
#[test]
fn cluster_is_send_and_sync() {
    fn check<T: Send + Sync + 'static>() {}
    check::<Cluster>();
    check::<HarnessError>();
}

// ---------- bad settings that PostgreSQL itself refuses ----------

/// One test per bad setting list: `ServerDidNotStart` mentioning `needle`, nothing left behind.
macro_rules! refused {
    ($($(#[doc = $doc:literal])* $name:ident: $settings:expr => $needle:expr;)*) => {$(
        $(#[doc = $doc])*
        #[test]
        fn $name() {
            expect_start_refused($settings, $needle);
        }
    )*};
}

refused! {
    /// An unknown setting name.
    unknown_setting_name_is_refused: &[("no_such_setting_xyz", "1")]
        => "unrecognized configuration parameter \"no_such_setting_xyz\"";
    /// A value PostgreSQL refuses (negative max_connections).
    refused_max_connections_is_refused: &[("max_connections", "-5")] => "max_connections";
    /// A value PostgreSQL refuses (non-boolean fsync).
    refused_fsync_is_refused: &[("fsync", "maybe")] => "fsync";
    /// A missing library in `shared_preload_libraries`, named in the error.
    missing_preload_library_is_refused: &[("shared_preload_libraries", "'no_such_lib_xyz'")]
        => "no_such_lib_xyz";
    /// A value the server cannot parse (a word that is no token there):
    /// its error points at a line of a file gone with the cluster, so the
    /// caller's settings are named beside it.
    a_server_syntax_error_names_the_callers_settings: &[("work_mem", "3-")]
        => "with the caller's settings: work_mem = 3-";
}

// ---------- environment ----------

/// `IDEM_PG_BIN` naming nothing: `NoServerBinaries` naming it, no directory made.
#[test]
fn bad_idem_pg_bin_is_refused() {
    let before = snapshot();
    std::env::set_var("IDEM_PG_BIN", "/nonexistent/pg/bin");
    let result = start_throwaway_cluster();
    std::env::remove_var("IDEM_PG_BIN");
    let err = result.expect_err("started with a bogus IDEM_PG_BIN");
    assert!(
        matches!(err, HarnessError::NoServerBinaries { .. }),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("IDEM_PG_BIN=/nonexistent/pg/bin"),
        "{err}"
    );
    assert_nothing_left(&before, "after NoServerBinaries");
}

/// A failing `initdb` (fake bin dir): `InitdbFailed` with its stderr, directory removed.
#[test]
fn failing_initdb_is_refused_and_cleaned_up() {
    let before = snapshot();
    let bin = std::env::temp_dir().join(format!("attack-bin-{}", std::process::id()));
    std::fs::create_dir_all(&bin).unwrap();
    for name in ["initdb", "pg_ctl", "postgres"] {
        let path = bin.join(name);
        std::fs::write(&path, "#!/bin/sh\necho \"fake $0 refuses\" >&2\nexit 3\n").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    std::fs::set_permissions(&bin, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    std::env::set_var("IDEM_PG_BIN", &bin);
    let result = start_throwaway_cluster();
    std::env::remove_var("IDEM_PG_BIN");
    std::fs::remove_dir_all(&bin).unwrap();
    let err = result.expect_err("started with a fake initdb");
    match &err {
        HarnessError::InitdbFailed {
            stderr, data_dir, ..
        } => {
            assert!(stderr.contains("fake"), "{stderr}");
            assert!(!data_dir.exists(), "{} left behind", data_dir.display());
        }
        other => panic!("expected InitdbFailed, got {other:?}"),
    }
    assert_nothing_left(&before, "after InitdbFailed");
}

// ---------- settings refused before anything starts ----------

/// Found by this pass (each started a cluster before): a line break in a
/// name or value wrote a second setting nobody asked for
/// (`("work_mem", "64kB\nstatement_timeout = 1234")` started with
/// `statement_timeout` = 1234ms); an empty value, an `=` in a name, a quote
/// left open or a trailing backslash failed with a syntax error naming a
/// line of a file removed with the cluster.
#[test]
fn what_is_not_one_line_of_postgresql_conf_is_refused() {
    for (name, value) in [
        ("work_mem", "64kB\nstatement_timeout = 1234"),
        ("statement_timeout = 4321\nwork_mem", "128kB"),
        ("log_line_prefix", "'a\nb'"),
        ("", "1"),
        ("work_mem", ""),
        ("work_mem=1MB", "2MB"),
        ("log_line_prefix", "'it's'"),
        ("log_line_prefix", "'a\\'"),
        ("log_line_prefix", "'open"),
    ] {
        expect_setting_refused(name, value);
    }
}

/// Found: an unquoted `#` began a comment (`("search_path", "a#b")` started
/// with `search_path` = `a`), silently. Refused now; quoted, it arrives whole.
#[test]
fn an_unquoted_value_with_a_comment_or_a_space_is_refused_and_quoted_arrives_whole() {
    let msg = expect_setting_refused("search_path", "a#b");
    assert!(msg.contains("quoted"), "{msg}");
    expect_setting_refused("search_path", "a b");
    let before = snapshot();
    let cluster =
        start_throwaway_cluster_with(&[("search_path", "'a#b, \"c d\"'")]).expect("start");
    let shown = rt().block_on(async { show(&connect(cluster.url()).await, "search_path").await });
    assert_eq!(shown, "a#b, \"c d\"");
    drop(cluster);
    assert_nothing_left(&before, "after a quoted search_path");
}

/// Found: the settings the harness owns were taken or ignored as they came.
/// `("port", "5432")` was silently replaced by the harness's own;
/// `("listen_addresses", "''")` gave `Ok` with a URL that refused every
/// connection; `("data_directory", <another data directory>)` started a
/// server there that `pg_ctl -w` never saw, answered `ServerDidNotStart`
/// after 61 s, and left that server running after the error. Each is
/// refused now, in any case of its name, before anything starts.
#[test]
fn the_settings_the_harness_owns_are_refused() {
    for (name, value) in [
        ("port", "5432"),
        ("PORT", "5432"),
        ("listen_addresses", "''"),
        ("listen_addresses", "'*'"),
        ("unix_socket_directories", "'/tmp'"),
        ("data_directory", "'/var/lib/postgresql/15/main'"),
        ("config_file", "'/etc/postgresql/15/main/postgresql.conf'"),
        ("hba_file", "'/nonexistent/pg_hba.conf'"),
        ("ident_file", "'/nonexistent/pg_ident.conf'"),
        ("include", "'/nonexistent/attack.conf'"),
        ("include_dir", "'/nonexistent'"),
        ("include_if_exists", "'/nonexistent/attack.conf'"),
    ] {
        let msg = expect_setting_refused(name, value);
        assert!(msg.contains("the harness sets it"), "{msg}");
    }
}

/// Found: a cluster kept in a `static` (the way to share one with settings
/// of its own between a binary's tests) was never dropped, and its server
/// and directory outlived the test process. Every cluster still alive at
/// the process's exit is stopped then, as the shared one always was.
#[test]
fn a_cluster_in_a_static_is_stopped_when_the_process_exits() {
    static CELL: std::sync::OnceLock<Cluster> = std::sync::OnceLock::new();
    if std::env::var_os("ATTACK_CHILD").is_some() {
        let cluster = CELL.get_or_init(|| {
            start_throwaway_cluster_with(&[("max_prepared_transactions", "2")]).expect("start")
        });
        println!("ATTACK_DIR {}", cluster.dir().display());
        return;
    }
    let before = snapshot();
    let (dirs, left) = left_by_child("a_cluster_in_a_static_is_stopped_when_the_process_exits");
    assert_eq!(dirs.len(), 1, "the child named {dirs:?}");
    assert!(
        left.is_empty(),
        "left after the child exited (dir, exists, pids): {left:?}"
    );
    assert_nothing_left(&before, "after the child");
}

/// The same for the other servers the harness starts for a caller (NATS,
/// Redis, PgBouncer; kept in `static`s, never dropped): each is stopped,
/// and its directory removed, when the process exits. Before, only the
/// servers the harness shares itself were. PgBouncer's part needs the
/// program (`.ci/run` installs it); without it the child says so and the
/// other two are checked.
#[test]
fn servers_kept_in_statics_are_stopped_when_the_process_exits() {
    use idem_testing::nats::NatsServer;
    use idem_testing::pgbouncer::PgBouncer;
    use idem_testing::redis::RedisServer;
    static NATS: std::sync::OnceLock<NatsServer> = std::sync::OnceLock::new();
    static REDIS: std::sync::OnceLock<RedisServer> = std::sync::OnceLock::new();
    static BOUNCER: std::sync::OnceLock<PgBouncer> = std::sync::OnceLock::new();
    const TEST: &str = "servers_kept_in_statics_are_stopped_when_the_process_exits";
    if std::env::var_os("ATTACK_CHILD").is_some() {
        let nats = NATS.get_or_init(|| NatsServer::start().expect("nats-server"));
        let redis = REDIS.get_or_init(|| RedisServer::start().expect("redis-server"));
        println!("ATTACK_DIR {}", nats.dir().display());
        println!("ATTACK_DIR {}", redis.dir().display());
        let url = idem_testing::server_url().expect("a server");
        match PgBouncer::start(&url) {
            Ok(bouncer) => println!(
                "ATTACK_DIR {}",
                BOUNCER.get_or_init(|| bouncer).dir().display()
            ),
            Err(e @ HarnessError::NoPgBouncer { .. }) => eprintln!("not checked: {e}"),
            Err(e) => panic!("{e}"),
        }
        return;
    }
    let before = snapshot();
    let (dirs, left) = left_by_child(TEST);
    assert!(dirs.len() >= 2, "the child named {dirs:?}");
    assert!(
        left.is_empty(),
        "left after the child exited (dir, exists, pids): {left:?}"
    );
    assert_nothing_left(&before, "after the child");
}

/// The same for the harness's two multi-server fixtures: a `ReplicaPair`
/// and a `NatsCluster` kept in `static`s (never dropped) are stopped, and
/// their directories removed, when the process exits. Before, their
/// servers outlived the test binary.
#[test]
fn a_replica_pair_and_a_nats_cluster_in_statics_are_stopped_when_the_process_exits() {
    use idem_testing::nats_cluster::NatsCluster;
    use idem_testing::replica::{ReplicaPair, Replication};
    static PAIR: std::sync::OnceLock<ReplicaPair> = std::sync::OnceLock::new();
    static NATS: std::sync::OnceLock<NatsCluster> = std::sync::OnceLock::new();
    const TEST: &str =
        "a_replica_pair_and_a_nats_cluster_in_statics_are_stopped_when_the_process_exits";
    if std::env::var_os("ATTACK_CHILD").is_some() {
        let rt = rt();
        let pair = rt
            .block_on(ReplicaPair::start(Replication::Sync))
            .expect("pair");
        let nats = rt.block_on(NatsCluster::start()).expect("nats cluster");
        println!("ATTACK_DIR {}", PAIR.get_or_init(|| pair).dir().display());
        println!("ATTACK_DIR {}", NATS.get_or_init(|| nats).dir().display());
        return;
    }
    // Also this binary's turn: another test may set `IDEM_PG_BIN`, which the child inherits.
    let before = snapshot();
    let (dirs, left) = left_by_child(TEST);
    assert_eq!(dirs.len(), 2, "the child named {dirs:?}");
    assert!(
        left.is_empty(),
        "left after the child exited (dir, exists, pids): {left:?}"
    );
    assert_nothing_left(&before, "after the child");
}
