//! What the binary's tests share.

use std::process::Command;

/// Runs the binary with `--database-url url` and `args`, with neither
/// `DATABASE_URL` nor `NATS_URL` from the environment (a NATS URL only as
/// `args` give it); returns the exit code, stdout and stderr.
pub fn idem(url: &str, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .env_remove("DATABASE_URL")
        .env_remove("NATS_URL")
        .arg("--database-url")
        .arg(url)
        .args(args)
        .output()
        .expect("the binary runs");
    (
        out.status.code().expect("exited, not killed"),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// stdout as JSON.
pub fn json(stdout: &str) -> serde_json::Value {
    serde_json::from_str(stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"))
}
