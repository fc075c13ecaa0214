//! Running a program to completion within a bound: `initdb`,
//! `pg_basebackup` and `pg_rewind` have no timeout of their own, and one
//! that hangs (a full disk, a stuck source server) would hang the test
//! binary with it instead of failing the test that started it.

use std::io::Read;
use std::os::unix::process::CommandExt as _;
use std::process::{Child, Command, Output, Stdio};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crate::HarnessError;

/// The bound of a program the harness runs to completion. `initdb` takes a
/// few seconds, a base backup of a test cluster about as long; this is for
/// a machine many times slower, not for a normal run.
pub(crate) const PROGRAM_BOUND: Duration = Duration::from_secs(120);

/// How often the wait looks at the program again.
const POLL: Duration = Duration::from_millis(10);

/// `cmd`'s exit status and everything it wrote, as [`Command::output`]
/// gives them, if it exits within `bound`. Past the bound it is killed,
/// with every process it started (it runs in a process group of its own,
/// so the kill reaches through a privilege-dropping wrapper to the program
/// and its children), and the answer is [`HarnessError::Timeout`] naming
/// `action`.
pub(crate) fn output_within(
    cmd: &mut Command,
    bound: Duration,
    action: &str,
) -> Result<Output, HarnessError> {
    cmd.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let mut child = cmd.spawn().map_err(|e| HarnessError::io(action, e))?;
    let stdout = read_all(child.stdout.take());
    let stderr = read_all(child.stderr.take());
    let deadline = Instant::now() + bound;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                return Ok(Output {
                    status,
                    stdout: joined(stdout),
                    stderr: joined(stderr),
                })
            }
            Ok(None) if Instant::now() < deadline => thread::sleep(POLL),
            Ok(None) => {
                kill_group(&mut child);
                // The readers are left to finish on their own: a process
                // that left the group may still hold the pipes open.
                return Err(HarnessError::Timeout {
                    action: action.to_owned(),
                    after: bound,
                });
            }
            Err(e) => {
                kill_group(&mut child);
                return Err(HarnessError::io(action, e));
            }
        }
    }
}

/// Reads `pipe` to its end on a thread of its own, so that a program
/// writing more than a pipe holds does not block on a full pipe.
fn read_all(pipe: Option<impl Read + Send + 'static>) -> Option<JoinHandle<Vec<u8>>> {
    pipe.map(|mut pipe| {
        thread::spawn(move || {
            let mut bytes = Vec::new();
            // A read error ends the output where it stopped; the status says the rest.
            let _ = pipe.read_to_end(&mut bytes);
            bytes
        })
    })
}

fn joined(reader: Option<JoinHandle<Vec<u8>>>) -> Vec<u8> {
    reader
        .and_then(|reader| reader.join().ok())
        .unwrap_or_default()
}

/// SIGKILL of the program's process group (its pid is the group's id), and
/// the program reaped.
fn kill_group(child: &mut Child) {
    if let Ok(pgid) = libc::pid_t::try_from(child.id()) {
        // SAFETY: plain syscall on the group this function's caller created.
        unsafe {
            libc::killpg(pgid, libc::SIGKILL);
        }
    }
    let _ = child.wait();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `pid` still runs (a zombie does not).
    fn runs(pid: libc::pid_t) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
            let state = stat[stat.rfind(')').unwrap() + 2..].chars().next();
            !matches!(state, Some('Z' | 'X'))
        })
    }

    #[test]
    fn a_program_that_exits_in_time_gives_its_status_and_output() {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo out; echo err >&2; exit 3"]);
        let output = output_within(&mut cmd, Duration::from_secs(30), "run sh").unwrap();
        assert_eq!(output.status.code(), Some(3));
        assert_eq!(output.stdout, b"out\n");
        assert_eq!(output.stderr, b"err\n");
    }

    #[test]
    fn output_larger_than_a_pipe_does_not_block_the_program() {
        let mut cmd = Command::new("sh");
        cmd.args([
            "-c",
            "head -c 1000000 /dev/zero; head -c 300000 /dev/zero >&2",
        ]);
        let output = output_within(&mut cmd, Duration::from_secs(30), "run sh").unwrap();
        assert!(output.status.success());
        assert_eq!(
            (output.stdout.len(), output.stderr.len()),
            (1_000_000, 300_000)
        );
    }

    /// A program past its bound is killed with the processes it started,
    /// and the error names what was run and the bound.
    #[test]
    fn a_program_past_its_bound_is_killed_with_its_children() {
        let dir =
            std::env::temp_dir().join(format!("idem-bounded-{}", crate::server::unique_suffix()));
        std::fs::create_dir_all(&dir).unwrap();
        let pids = dir.join("pids");
        let mut cmd = Command::new("sh");
        cmd.arg("-c").arg(format!(
            "sleep 60 & echo $! > '{0}'; echo $$ >> '{0}'; wait",
            pids.display()
        ));
        let started = Instant::now();
        let err = output_within(&mut cmd, Duration::from_millis(500), "run a sleeper").unwrap_err();
        let took = started.elapsed();
        let pids: Vec<libc::pid_t> = std::fs::read_to_string(&pids)
            .unwrap()
            .lines()
            .map(|line| line.trim().parse().unwrap())
            .collect();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(
            matches!(&err, HarnessError::Timeout { action, after }
                if action == "run a sleeper" && *after == Duration::from_millis(500)),
            "{err:?}"
        );
        assert!(took < Duration::from_secs(30), "answered after {took:?}");
        assert_eq!(pids.len(), 2, "{pids:?}");
        let deadline = Instant::now() + Duration::from_secs(10);
        while pids.iter().any(|&pid| runs(pid)) && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(20));
        }
        let left: Vec<_> = pids.iter().filter(|&&pid| runs(pid)).collect();
        assert!(left.is_empty(), "still running: {left:?}");
    }
}
