//! The service processes: this same executable, started again with
//! `--serve`, one OS process each.

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use crate::service::ServeArgs;

/// Where a child finds its database URL: in its environment, not on its
/// command line, where `ps` would show a password.
pub const URL_ENV: &str = "IDEM_SCALE_DATABASE_URL";

/// Running service processes; killed if still running when dropped.
pub struct Fleet {
    children: Vec<(Child, ChildStdout)>,
    /// Each process's HTTP port on 127.0.0.1, in process order.
    pub ports: Vec<u16>,
}

impl Fleet {
    /// Start `n` processes serving `url`, and wait until each listens.
    pub fn start(
        n: usize,
        url: &str,
        transaction_pooling: bool,
        pool_size: usize,
    ) -> Result<Fleet, Box<dyn std::error::Error>> {
        let exe = std::env::current_exe()?;
        let mut fleet = Fleet {
            children: Vec::new(),
            ports: Vec::new(),
        };
        for process in 0..n {
            let mut child = Command::new(&exe)
                .args(["--serve", "--process", &process.to_string()])
                .args(["--pool-size", &pool_size.to_string()])
                .args(transaction_pooling.then_some("--transaction-pooling"))
                .env(URL_ENV, url)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()?;
            let mut stdout = BufReader::new(child.stdout.take().expect("piped"));
            // Pushed before reading, so Drop kills it if it never answers.
            let mut line = String::new();
            let read = stdout.read_line(&mut line);
            fleet.children.push((child, stdout.into_inner()));
            read?;
            let port = line
                .trim()
                .strip_prefix("listening ")
                .and_then(|port| port.parse().ok())
                .ok_or_else(|| {
                    format!("process {process} said {line:?}, not `listening <port>`")
                })?;
            fleet.ports.push(port);
        }
        Ok(fleet)
    }

    /// Close every process's stdin, which stops it, and wait for them.
    pub fn stop(mut self) {
        for (child, _) in &mut self.children {
            drop(child.stdin.take());
        }
        let until = Instant::now() + Duration::from_secs(10);
        for (child, _) in &mut self.children {
            while Instant::now() < until {
                if matches!(child.try_wait(), Ok(Some(_))) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        // Drop kills any that did not stop.
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for (child, _) in &mut self.children {
            if !matches!(child.try_wait(), Ok(Some(_))) {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// The settings of a child, from its command line and environment.
pub fn serve_args(args: &[String]) -> Result<ServeArgs, String> {
    let value = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .ok_or_else(|| format!("{name} needs a value"))
    };
    Ok(ServeArgs {
        url: std::env::var(URL_ENV).map_err(|_| format!("{URL_ENV} is not set"))?,
        transaction_pooling: args.iter().any(|a| a == "--transaction-pooling"),
        pool_size: value("--pool-size")?
            .parse()
            .map_err(|e| format!("--pool-size: {e}"))?,
        process: value("--process")?
            .parse()
            .map_err(|e| format!("--process: {e}"))?,
    })
}
