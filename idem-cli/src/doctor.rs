//! `idem doctor`: the operator API's checks, and the NATS stream's.

use std::str::FromStr;

use idem_runtime::operate::{self, CheckState, DoctorOptions, StreamCheck, StreamChoice};
use idem_runtime::outbox::RelayTiming;
use serde_json::json;

use crate::args::{Cli, DoctorArgs};
use crate::context::{pool, Result};
use crate::output::{clean, emit};

/// `idem doctor`.
pub async fn doctor(cli: &Cli, d: &DoctorArgs) -> Result<u8> {
    let url = cli.database_url.as_deref().unwrap_or_default();
    // Every port the URL names (one per host of a multi-host URL).
    let url_ports = tokio_postgres::Config::from_str(url)
        .map(|c| c.get_ports().to_vec())
        .unwrap_or_default();
    let pool = pool(cli)?;
    let options = DoctorOptions {
        pool_sizes: d.pool_sizes.clone(),
        url_ports,
    };
    let mut checks = operate::doctor(&pool, &options).await?;
    if let Some(stream) = stream_check(d) {
        checks.push(operate::check_stream(&stream).await);
    }
    let failed = checks.iter().any(|c| c.state == CheckState::Fail);
    emit(cli, &json!({"ok": !failed, "checks": checks}), || {
        let mut s = String::new();
        for c in &checks {
            let state = match c.state {
                CheckState::Ok => "ok  ",
                CheckState::Warn => "warn",
                CheckState::Fail => "FAIL",
            };
            // A detail may quote the database (a table's name): one line.
            s.push_str(&format!("{state}  {:<15} {}\n", c.name, clean(&c.detail)));
            if let Some(fix) = &c.fix {
                s.push_str(&format!("      {:<15} fix: {}\n", "", clean(fix)));
            }
        }
        s
    })?;
    Ok(if failed { 1 } else { 0 })
}

/// The NATS stream's check, when a NATS URL is given: the stream named
/// (or capturing the subject given) against the horizon of a relay with
/// the default timing, or with the `--relay-*` values given.
fn stream_check(d: &DoctorArgs) -> Option<StreamCheck> {
    let url = d.nats_url.as_deref().filter(|u| !u.trim().is_empty())?;
    let mut timing = RelayTiming::default();
    timing.lease = d.relay_lease.unwrap_or(timing.lease);
    timing.max_attempts = d.relay_max_attempts.unwrap_or(timing.max_attempts);
    timing.backoff_base = d.relay_backoff_base.unwrap_or(timing.backoff_base);
    timing.backoff_max = d.relay_backoff_max.unwrap_or(timing.backoff_max);
    let mut check = StreamCheck::new(url).horizon(timing.horizon());
    if let Some(name) = &d.stream {
        check = check.stream(StreamChoice::Named(name.clone()));
    } else if let Some(subject) = &d.subject {
        check = check.stream(StreamChoice::Capturing(subject.clone()));
    }
    Some(check)
}
