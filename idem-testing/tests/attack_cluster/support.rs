//! Helpers of `attack_cluster.rs`: leak checks (directories, processes), connections.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use idem_testing::{start_throwaway_cluster_with, HarnessError};
use tokio_postgres::{Client, NoTls};
/// The prefix of every directory the harness makes for this process.
pub fn dir_prefix() -> String {
    format!("idem-pg-{}-", std::process::id())
}

/// This process's cluster directories in the temp dir.
pub fn my_dirs() -> BTreeSet<PathBuf> {
    let prefix = dir_prefix();
    std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .map(|e| e.path())
        .collect()
}

/// Pids of processes whose cwd or command line is inside one of this process's cluster dirs
/// (every postgres backend chdirs into its data directory).
pub fn my_server_pids() -> BTreeSet<u32> {
    pids_in(&std::env::temp_dir().join(dir_prefix()))
        .into_iter()
        .collect()
}

/// What was there before a test, so leaks of one test do not fail the next.
/// It holds this binary's one lock while it lives: the checks read the whole
/// process table and temp directory, and a test sets `IDEM_PG_BIN`, so the
/// tests take turns even where `cargo test` runs them on several threads.
pub struct Snapshot {
    pub dirs: BTreeSet<PathBuf>,
    pub pids: BTreeSet<u32>,
    _turn: MutexGuard<'static, ()>,
}

pub fn snapshot() -> Snapshot {
    static TURN: Mutex<()> = Mutex::new(());
    // A test that failed while holding it leaves nothing the next one needs.
    let turn = TURN.lock().unwrap_or_else(PoisonError::into_inner);
    Snapshot {
        dirs: my_dirs(),
        pids: my_server_pids(),
        _turn: turn,
    }
}

/// Asserts no new cluster directory and (after up to 10 s) no new server process.
pub fn assert_nothing_left(before: &Snapshot, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut pids: Vec<u32>;
    loop {
        pids = my_server_pids().difference(&before.pids).copied().collect();
        if pids.is_empty() || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let dirs: Vec<PathBuf> = my_dirs().difference(&before.dirs).cloned().collect();
    assert!(
        pids.is_empty(),
        "{what}: server processes left behind: {pids:?}"
    );
    assert!(
        dirs.is_empty(),
        "{what}: cluster directories left behind: {dirs:?}"
    );
}

/// Pids whose cwd or command line starts with / contains `dir` (a prefix, not only a directory).
pub fn pids_in(dir: &Path) -> Vec<u32> {
    let needle = dir.to_string_lossy().into_owned();
    let read =
        |p: PathBuf| std::fs::read(p).map(|b| String::from_utf8_lossy(&b).replace('\0', " "));
    let procs = std::fs::read_dir("/proc").unwrap().flatten();
    procs
        .filter_map(|e| {
            let pid = e.file_name().to_string_lossy().parse::<u32>().ok()?;
            let cwd = std::fs::read_link(e.path().join("cwd")).unwrap_or_default();
            let cmdline = read(e.path().join("cmdline")).unwrap_or_default();
            (cwd.to_string_lossy().starts_with(&needle) || cmdline.contains(&needle)).then_some(pid)
        })
        .collect()
}

pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

pub async fn connect(url: &str) -> Client {
    let (client, connection) = tokio_postgres::connect(url, NoTls)
        .await
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"));
    tokio::spawn(connection);
    client
}

pub async fn show(client: &Client, name: &str) -> String {
    client
        .query_one(&format!("SHOW {name}"), &[])
        .await
        .unwrap_or_else(|e| panic!("SHOW {name}: {e}"))
        .get(0)
}

/// Starts with `settings`, expects `ServerDidNotStart` whose message contains
/// `needle`, and that nothing is left behind.
pub fn expect_start_refused(settings: &[(&str, &str)], needle: &str) -> String {
    let before = snapshot();
    expect_refused_after(&before, settings, needle)
}

fn expect_refused_after(before: &Snapshot, settings: &[(&str, &str)], needle: &str) -> String {
    let result = start_throwaway_cluster_with(settings);
    let err = match result {
        Ok(cluster) => panic!(
            "settings {settings:?} were accepted (port {}), expected an error",
            cluster.port()
        ),
        Err(e) => e,
    };
    assert!(
        matches!(err, HarnessError::ServerDidNotStart { .. }),
        "expected ServerDidNotStart for {settings:?}, got {err:?}"
    );
    let msg = err.to_string();
    eprintln!("error for {settings:?}:\n{msg}");
    assert!(
        msg.contains(needle),
        "error for {settings:?} does not mention {needle:?}:\n{msg}"
    );
    assert_nothing_left(before, &format!("after refusing {settings:?}"));
    msg
}

/// Starts with `(name, value)`, expects `InvalidSetting` naming both, at
/// once (nothing started: well under `initdb`'s time), and nothing left.
pub fn expect_setting_refused(name: &str, value: &str) -> String {
    let before = snapshot();
    let started = Instant::now();
    let err =
        match start_throwaway_cluster_with(&[("max_prepared_transactions", "2"), (name, value)]) {
            Ok(cluster) => panic!(
                "{name:?} = {value:?} was accepted (port {})",
                cluster.port()
            ),
            Err(e) => e,
        };
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "refused after {:?}: something was started first",
        started.elapsed()
    );
    match &err {
        HarnessError::InvalidSetting {
            name: n,
            value: v,
            reason,
        } => {
            assert_eq!((n.as_str(), v.as_str()), (name, value));
            assert!(!reason.is_empty());
        }
        other => panic!("expected InvalidSetting for {name:?} = {value:?}, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(msg.contains(&format!("{name:?}")), "{msg}");
    assert_nothing_left(&before, &format!("after refusing {name:?} = {value:?}"));
    msg
}

/// Kills what a test found left running in `dir`, so the machine is left
/// as found whatever the assertion then says.
pub fn kill_left(dir: &Path) {
    for pid in pids_in(dir) {
        // SAFETY: plain syscall on a pid read from /proc just now.
        unsafe {
            libc::kill(pid as libc::pid_t, libc::SIGKILL);
        }
    }
}

/// A directory a child left: whether it still exists, the processes in it.
pub type Left = (PathBuf, bool, Vec<u32>);

/// Runs this binary's `test` alone in a child process with `ATTACK_CHILD`
/// set, which prints `ATTACK_DIR <dir>` for each server it keeps in a
/// `static` and exits. Returns those directories, and each one that is
/// still there or still has processes in it (given 10 s: the exit hook
/// stops the servers before the child exits, their backends may take a
/// moment more), with what it found; whatever was left is then killed and
/// removed, so the machine is left as found whatever the test asserts.
pub fn left_by_child(test: &str) -> (Vec<PathBuf>, Vec<Left>) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env("ATTACK_CHILD", "1")
        .output()
        .unwrap();
    assert!(out.status.success(), "the child failed: {out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let dirs: Vec<PathBuf> = stdout
        .lines()
        .filter_map(|l| {
            l.split_once("ATTACK_DIR ")
                .map(|(_, d)| PathBuf::from(d.trim()))
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while dirs.iter().any(|dir| !pids_in(dir).is_empty()) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    let left = dirs
        .iter()
        .map(|dir| (dir.clone(), dir.exists(), pids_in(dir)))
        .filter(|(_, exists, pids)| *exists || !pids.is_empty())
        .collect();
    for dir in &dirs {
        kill_left(dir);
        let _ = std::fs::remove_dir_all(dir);
    }
    (dirs, left)
}
