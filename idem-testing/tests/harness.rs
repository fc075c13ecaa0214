//! The harness against a real server: with `DATABASE_URL` set the first tests use that
//! server; the cluster and child-process tests exercise the throwaway-cluster path either way.

use std::net::TcpStream;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use idem_testing::{server_url, start_throwaway_cluster, TestDatabase};
use tokio_postgres::{Client, NoTls};

/// Set in the environment of the child processes that some tests spawn.
const CHILD_MARKER: &str = "IDEM_TESTING_CHILD";
/// Prefix of the lines a child prints for its parent to read.
const REPORT_PREFIX: &str = "IDEM_CHILD_REPORT ";

async fn connect(url: &str) -> Client {
    let (client, connection) = tokio_postgres::connect(url, NoTls)
        .await
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"));
    tokio::spawn(connection);
    client
}

async fn table_exists(client: &Client, table: &str) -> bool {
    client
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&table])
        .await
        .unwrap()
        .get(0)
}

async fn database_exists(admin_url: &str, name: &str) -> bool {
    let admin = connect(admin_url).await;
    let count: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_database WHERE datname = $1",
            &[&name],
        )
        .await
        .unwrap()
        .get(0);
    count == 1
}

fn port_accepts_connections(port: u16) -> bool {
    TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_secs(2)).is_ok()
}

fn port_of(url: &str) -> u16 {
    let authority = url
        .split("://")
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .unwrap();
    authority.rsplit(':').next().unwrap().parse().unwrap()
}

#[tokio::test]
async fn databases_are_distinct_and_isolated() {
    let a = TestDatabase::create().await.unwrap();
    let b = TestDatabase::create().await.unwrap();
    assert_ne!(a.name(), b.name());
    assert_ne!(a.url(), b.url());
    assert!(a.name().starts_with("idem_t_"), "{}", a.name());

    let client_a = connect(a.url()).await;
    let client_b = connect(b.url()).await;
    let current: String = client_a
        .query_one("SELECT current_database()", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(current, a.name());

    client_a
        .batch_execute("CREATE TABLE only_in_a (id int); INSERT INTO only_in_a VALUES (1)")
        .await
        .unwrap();
    assert!(table_exists(&client_a, "only_in_a").await);
    assert!(!table_exists(&client_b, "only_in_a").await);
    // Both databases live on the selected server, so they must be visible from its admin URL.
    let admin = server_url().unwrap();
    assert!(database_exists(&admin, a.name()).await);
    assert!(database_exists(&admin, b.name()).await);
}

#[tokio::test]
async fn dropping_removes_the_database_even_with_open_connections() {
    let admin = server_url().unwrap();
    let db = TestDatabase::create().await.unwrap();
    let name = db.name().to_owned();
    // Held across the drop: WITH (FORCE) has to kick it out for the DROP to succeed.
    let still_connected = connect(db.url()).await;
    still_connected.batch_execute("SELECT 1").await.unwrap();
    assert!(database_exists(&admin, &name).await);

    drop(db);

    assert!(!database_exists(&admin, &name).await);
    assert!(still_connected.batch_execute("SELECT 1").await.is_err());
}

#[tokio::test]
async fn throwaway_cluster_runs_and_is_removed_on_drop() {
    let cluster = tokio::task::spawn_blocking(start_throwaway_cluster)
        .await
        .unwrap()
        .unwrap();
    let port = cluster.port();
    let dir = cluster.dir().to_owned();
    assert!(cluster.data_dir().join("PG_VERSION").is_file());
    assert_eq!(port_of(cluster.url()), port);
    if let Ok(url) = std::env::var("DATABASE_URL") {
        assert_ne!(cluster.url(), url, "must ignore DATABASE_URL");
    }

    let client = connect(cluster.url()).await;
    let version: String = client
        .query_one("SELECT version()", &[])
        .await
        .unwrap()
        .get(0);
    assert!(version.starts_with("PostgreSQL "), "{version}");
    for (setting, expected) in [
        ("fsync", "off"),
        ("synchronous_commit", "off"),
        ("full_page_writes", "off"),
        ("max_connections", "300"),
        ("lc_messages", "C"),
    ] {
        let value: String = client
            .query_one(&format!("SHOW {setting}"), &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(value, expected, "{setting}");
    }
    let data_directory: String = client
        .query_one("SHOW data_directory", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(PathBuf::from(data_directory), cluster.data_dir());

    // Test databases work on it too.
    let db = TestDatabase::create_on(cluster.url()).await.unwrap();
    let in_db = connect(db.url()).await;
    in_db
        .batch_execute("CREATE TABLE t (id int)")
        .await
        .unwrap();
    drop(db);
    drop(client);

    drop(cluster);
    assert!(!port_accepts_connections(port), "port {port} still open");
    assert!(!dir.exists(), "{} still exists", dir.display());
}

/// Runs one `#[ignore]`d child test of this binary in a new process and returns its report lines.
fn run_child(test: &str, database_url: Option<&str>) -> Vec<(String, String)> {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        test,
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(CHILD_MARKER, "1");
    match database_url {
        Some(url) => cmd.env("DATABASE_URL", url),
        None => cmd.env_remove("DATABASE_URL"),
    };
    let output = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "child {test} failed: {}\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let report: Vec<(String, String)> = stdout
        .lines()
        // With --nocapture the harness's own "test name ... " may precede the first report on its line.
        .filter_map(|line| line.split_once(REPORT_PREFIX).map(|(_, kv)| kv))
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    assert!(
        !report.is_empty(),
        "child {test} reported nothing:\n{stdout}"
    );
    report
}

fn get<'a>(report: &'a [(String, String)], key: &str) -> &'a str {
    &report.iter().find(|(k, _)| k == key).unwrap().1
}

/// A child run with DATABASE_URL pointing at a cluster this test owns must create its
/// database there and start no cluster of its own.
#[tokio::test]
async fn server_url_honours_database_url() {
    let cluster = tokio::task::spawn_blocking(start_throwaway_cluster)
        .await
        .unwrap()
        .unwrap();
    let url = cluster.url().to_owned();
    let report = tokio::task::spawn_blocking(move || {
        run_child("child_reports_server_and_keeps_a_database", Some(&url))
    })
    .await
    .unwrap();

    assert_eq!(get(&report, "server_url"), cluster.url());
    assert_eq!(
        PathBuf::from(get(&report, "data_directory")),
        cluster.data_dir()
    );
    assert!(database_exists(cluster.url(), get(&report, "database")).await);
}

/// Without DATABASE_URL a child starts the shared cluster; once it exits, its atexit hook
/// must have stopped the server and deleted the directory.
#[tokio::test]
async fn shared_cluster_is_removed_when_the_process_exits() {
    let report = tokio::task::spawn_blocking(|| {
        run_child("child_reports_server_and_keeps_a_database", None)
    })
    .await
    .unwrap();
    let url = get(&report, "server_url");
    let data_directory = PathBuf::from(get(&report, "data_directory"));
    let cluster_dir = data_directory.parent().unwrap();
    assert!(
        cluster_dir
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("idem-pg-"),
        "{}",
        data_directory.display()
    );

    assert!(!port_accepts_connections(port_of(url)), "{url} still up");
    assert!(
        !cluster_dir.exists(),
        "{} still exists",
        cluster_dir.display()
    );
}

#[tokio::test]
#[ignore = "run in a child process by server_url_honours_database_url and shared_cluster_is_removed_when_the_process_exits"]
async fn child_reports_server_and_keeps_a_database() {
    if std::env::var_os(CHILD_MARKER).is_none() {
        return;
    }
    let url = tokio::task::spawn_blocking(server_url)
        .await
        .unwrap()
        .unwrap();
    let db = TestDatabase::create().await.unwrap();
    let client = connect(db.url()).await;
    let data_directory: String = client
        .query_one("SHOW data_directory", &[])
        .await
        .unwrap()
        .get(0);
    println!("{REPORT_PREFIX}server_url={url}");
    println!("{REPORT_PREFIX}data_directory={data_directory}");
    println!("{REPORT_PREFIX}database={}", db.name());
    // Left in place so the parent can see where it was created.
    std::mem::forget(db);
}
