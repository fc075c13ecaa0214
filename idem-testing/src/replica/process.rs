//! Stopping a postmaster and everything it started, by pid.
//!
//! `pg_ctl start` makes the postmaster a session leader, but every child of
//! the postmaster calls `setsid` too, so there is no process group to signal
//! as a whole: the children are found through `/proc` by their parent pid.
//! Orphans are reparented to pid 1, which in containers may reap them late,
//! so a zombie counts as gone (it holds no port and no shared memory).

use std::fs;
use std::net::TcpListener;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::thread::sleep;
use std::time::{Duration, Instant};

/// How often the blocking waits look again.
const POLL: Duration = Duration::from_millis(50);

/// Whether `pid` is a process that still runs (not gone, not a zombie).
pub(crate) fn is_alive(pid: libc::pid_t) -> bool {
    match stat_fields(pid) {
        Some((state, _)) => state != 'Z' && state != 'X',
        None => false,
    }
}

/// Whether `pid` is a postmaster of `data_dir`: it keeps its command line,
/// `postgres -D <data_dir> ...`. Checked before signalling a pid read from
/// a `postmaster.pid`, which may by now belong to another process.
pub(crate) fn runs_from(pid: libc::pid_t, data_dir: &Path) -> bool {
    let Ok(cmdline) = fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let data_dir = data_dir.as_os_str().as_bytes();
    is_alive(pid) && cmdline.split(|&b| b == 0).any(|arg| arg == data_dir)
}

/// The processes whose parent is `pid` and that still run.
pub(crate) fn children(pid: libc::pid_t) -> Vec<libc::pid_t> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<libc::pid_t>().ok())
        .filter(|&child| matches!(stat_fields(child), Some((state, ppid)) if ppid == pid && state != 'Z'))
        .collect()
}

/// The state letter and parent pid from `/proc/<pid>/stat`.
fn stat_fields(pid: libc::pid_t) -> Option<(char, libc::pid_t)> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may itself contain spaces or parentheses.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    Some((state, ppid))
}

/// Sends `signal` to `pid`; a process that is already gone is not an error.
pub(crate) fn signal(pid: libc::pid_t, signal: libc::c_int) {
    if pid > 0 {
        // SAFETY: plain syscall on a pid this pair started; ESRCH is harmless.
        unsafe {
            libc::kill(pid, signal);
        }
    }
}

/// SIGKILLs the postmaster `pid` and every process it started, all at
/// once, the way a crashed host loses them. The postmaster is stopped first
/// so that it cannot fork a new backend between the listing of its
/// children and their end. Returns every pid that was killed.
pub(crate) fn kill_tree(pid: libc::pid_t) -> Vec<libc::pid_t> {
    signal(pid, libc::SIGSTOP);
    let mut pids = children(pid);
    signal(pid, libc::SIGKILL);
    for &child in &pids {
        signal(child, libc::SIGKILL);
    }
    pids.push(pid);
    pids
}

/// Waits until none of `pids` runs any more; false if `timeout` ran out.
pub(crate) fn wait_gone(pids: &[libc::pid_t], timeout: Duration) -> bool {
    wait_for(timeout, || pids.iter().all(|&pid| !is_alive(pid)))
}

/// Whether nothing listens on 127.0.0.1:`port` (the standard library sets
/// `SO_REUSEADDR`, as PostgreSQL does, so lingering TIME_WAIT connections
/// do not count).
pub(crate) fn port_is_free(port: u16) -> bool {
    TcpListener::bind(("127.0.0.1", port)).is_ok()
}

/// Polls `done` until it holds or `timeout` runs out.
pub(crate) fn wait_for(timeout: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if done() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        sleep(POLL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sees_itself_alive_and_its_parent() {
        let me = std::process::id() as libc::pid_t;
        assert!(is_alive(me));
        // SAFETY: getppid has no preconditions.
        let parent = unsafe { libc::getppid() };
        assert!(children(parent).contains(&me));
        assert!(!is_alive(-1));
    }
}
