//! Each command: call the operator API, print, pick the exit code.

use std::error::Error as StdError;
use std::str::FromStr;

use idem_runtime::idempotency::Settlement;
use idem_runtime::operate::{self, CheckState, DoctorOptions, Page, StreamCheck, StreamChoice};
use idem_runtime::outbox::RelayTiming;
use idem_runtime::pool::{build_pool_with, Pool, PoolConfig};
use serde::Serialize;
use serde_json::json;

use crate::args::{
    Cli, Command, DoctorArgs, InboxCmd, JobsCmd, KeyCmd, MigrateAction, OutboxCmd, PageArgs,
};
use crate::output::{dur, fields, opt_dur, short, table};

type Result<T> = std::result::Result<T, Box<dyn StdError>>;

/// What a command prints: JSON for `--json`, else the text.
fn emit<T: Serialize>(cli: &Cli, value: &T, text: impl FnOnce() -> String) -> Result<()> {
    if cli.json {
        println!("{}", serde_json::to_string_pretty(value)?);
    } else {
        print!("{}", text());
    }
    Ok(())
}

fn page(p: &PageArgs) -> Page {
    Page {
        limit: p.limit,
        offset: p.offset,
    }
}

fn pool(cli: &Cli) -> Result<Pool> {
    let url = cli
        .database_url
        .as_deref()
        .filter(|u| !u.is_empty())
        .ok_or("no database: give --database-url or set DATABASE_URL")?;
    let config = PoolConfig {
        max_size: 2,
        ..PoolConfig::default()
    };
    Ok(build_pool_with(url, &config)?)
}

pub async fn run(cli: &Cli) -> Result<u8> {
    match &cli.command {
        Command::Migrate(m) if m.print_sql => {
            let all = idem_runtime::migrate::migrations();
            let value: Vec<_> = all
                .iter()
                .map(|m| json!({"version": m.version(), "name": m.name(), "checksum": m.checksum(), "sql": m.sql()}))
                .collect();
            emit(cli, &value, || {
                all.iter()
                    .map(|m| {
                        format!(
                            "-- idem migration {} ({})\n{}\n",
                            m.version(),
                            m.name(),
                            m.sql()
                        )
                    })
                    .collect()
            })?;
            Ok(0)
        }
        Command::Migrate(m) => {
            let pool = pool(cli)?;
            match m.action {
                Some(MigrateAction::Status) => {
                    let st = operate::migration_status(&pool).await?;
                    emit(cli, &st, || {
                        let mut rows: Vec<Vec<String>> = Vec::new();
                        for (list, state) in [
                            (&st.applied, "applied"),
                            (&st.pending, "pending"),
                            (&st.mismatched, "CHECKSUM MISMATCH"),
                        ] {
                            for m in list {
                                rows.push(vec![
                                    m.version.to_string(),
                                    m.name.clone(),
                                    state.to_owned(),
                                    m.applied_ago
                                        .map_or("-".into(), |d| format!("{} ago", dur(d))),
                                ]);
                            }
                        }
                        rows.sort_by_key(|r| r[0].parse::<i32>().unwrap_or(0));
                        for v in &st.unknown {
                            rows.push(vec![
                                v.to_string(),
                                "?".into(),
                                "unknown (newer idem)".into(),
                                "-".into(),
                            ]);
                        }
                        table(&["version", "name", "state", "applied"], &rows)
                    })?;
                    Ok(if st.is_current() { 0 } else { 1 })
                }
                None => {
                    let applied = operate::migrate(&pool).await?;
                    emit(cli, &applied, || {
                        if applied.is_empty() {
                            "nothing to apply: every idem migration is applied\n".to_owned()
                        } else {
                            applied
                                .iter()
                                .map(|m| format!("applied {} {}\n", m.version, m.name))
                                .collect()
                        }
                    })?;
                    Ok(0)
                }
            }
        }
        Command::Key(KeyCmd::Show { key, show_response }) => {
            let pool = pool(cli)?;
            let Some(mut rec) = operate::show_key(&pool, &key.scope, &key.key).await? else {
                emit(cli, &serde_json::Value::Null, String::new)?;
                eprintln!(
                    "idem: no record of key {:?} under scope {}",
                    key.key, key.scope
                );
                return Ok(1);
            };
            let response = rec.response.take();
            let value = if *show_response {
                let mut v = serde_json::to_value(&rec)?;
                v["response"] = response.clone().unwrap_or(serde_json::Value::Null);
                v
            } else {
                let mut v = serde_json::to_value(&rec)?;
                if let Some(map) = v.as_object_mut() {
                    map.remove("response");
                }
                v
            };
            emit(cli, &value, || {
                let mut pairs = vec![
                    ("key", rec.key.clone()),
                    (
                        "scope",
                        rec.scope_label
                            .clone()
                            .unwrap_or_else(|| "(too long to keep)".into()),
                    ),
                    ("scope hash", rec.scope.clone()),
                    ("operation", rec.operation.clone()),
                    ("mode", rec.mode.clone()),
                    ("state", rec.state.clone()),
                    ("outcome", rec.outcome.clone().unwrap_or_else(|| "-".into())),
                    ("fingerprint", rec.fingerprint.clone()),
                    ("age", dur(rec.age)),
                    (
                        "expires",
                        if rec.expired {
                            "expired".into()
                        } else {
                            format!("in {}", dur(rec.expires_in))
                        },
                    ),
                    ("lease left", opt_dur(rec.lease_left)),
                    ("owner", rec.owner.clone().unwrap_or_else(|| "-".into())),
                ];
                pairs.push((
                    "response",
                    match (&response, show_response) {
                        (None, _) => "-".into(),
                        (Some(r), true) => r.to_string(),
                        (Some(_), false) => "(hidden; --show-response prints it)".into(),
                    },
                ));
                fields(&pairs)
            })?;
            Ok(0)
        }
        Command::Key(KeyCmd::Settle {
            key,
            completed,
            released,
            force,
        }) => {
            let pool = pool(cli)?;
            if !*force {
                let live = operate::show_key(&pool, &key.scope, &key.key)
                    .await?
                    .filter(|rec| rec.state == "in_progress")
                    .and_then(|rec| rec.lease_left)
                    .filter(|left| !left.is_zero());
                if let Some(left) = live {
                    eprintln!(
                        "idem: the claim of key {:?} is held for {} more: its request may still be calling the target; wait for the lease, or pass --force",
                        key.key,
                        dur(left)
                    );
                    return Ok(1);
                }
            }
            let settlement = match (completed, released) {
                (Some(response), false) => Settlement::Completed(response.clone()),
                _ => Settlement::Released,
            };
            let found = operate::settle(&pool, &key.scope, &key.key, settlement).await?;
            let what = if *released { "released" } else { "completed" };
            emit(
                cli,
                &json!({"key": key.key, "settled": found, "as": what}),
                || {
                    if found {
                        format!("settled {:?}: {what}\n", key.key)
                    } else {
                        format!(
                            "no record of {:?} left to settle (none, or already completed)\n",
                            key.key
                        )
                    }
                },
            )?;
            Ok(if found { 0 } else { 1 })
        }
        Command::Outbox(cmd) => outbox(cli, cmd).await,
        Command::Jobs(cmd) => jobs(cli, cmd).await,
        Command::Inbox(cmd) => inbox(cli, cmd).await,
        Command::Purge(p) => {
            let pool = pool(cli)?;
            let report = operate::purge_expired(&pool, p.batch, p.outbox_sent_older_than).await?;
            emit(cli, &report, || {
                let mut s = fields(&[
                    ("deleted", format!("{} expired record(s)", report.deleted)),
                    (
                        "marked unknown",
                        format!("{} record(s) whose lease ran out", report.marked_unknown),
                    ),
                    (
                        "unknown",
                        format!("{} record(s) waiting for `idem key settle`", report.unknown),
                    ),
                ]);
                if p.outbox_sent_older_than.is_some() {
                    s.push_str(&fields(&[(
                        "outbox",
                        format!("{} sent event(s) deleted", report.outbox_sent_deleted),
                    )]));
                }
                s
            })?;
            Ok(0)
        }
        Command::Doctor(d) => {
            let url = cli.database_url.as_deref().unwrap_or_default();
            let url_port = tokio_postgres::Config::from_str(url)
                .ok()
                .and_then(|c| c.get_ports().first().copied());
            let pool = pool(cli)?;
            let options = DoctorOptions {
                pool_sizes: d.pool_sizes.clone(),
                url_port,
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
                    s.push_str(&format!("{state}  {:<15} {}\n", c.name, c.detail));
                    if let Some(fix) = &c.fix {
                        s.push_str(&format!("      {:<15} fix: {fix}\n", ""));
                    }
                }
                s
            })?;
            Ok(if failed { 1 } else { 0 })
        }
    }
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

async fn outbox(cli: &Cli, cmd: &OutboxCmd) -> Result<u8> {
    let pool = pool(cli)?;
    match cmd {
        OutboxCmd::Stats => {
            let s = operate::outbox_stats(&pool).await?;
            emit(cli, &s, || {
                fields(&[
                    ("pending", s.pending.to_string()),
                    ("dead", s.dead.to_string()),
                    ("oldest pending", opt_dur(s.oldest_pending)),
                ])
            })?;
            Ok(0)
        }
        OutboxCmd::Dead { key, page: p } => {
            let dead = operate::dead_events(&pool, key.as_deref(), page(p)).await?;
            emit(cli, &dead, || {
                let rows: Vec<Vec<String>> = dead
                    .iter()
                    .map(|e| {
                        vec![
                            e.id.clone(),
                            e.key.clone(),
                            e.seq.to_string(),
                            e.subject.clone(),
                            e.attempts.to_string(),
                            dur(e.age),
                            short(e.last_error.as_deref().unwrap_or("-"), 60),
                        ]
                    })
                    .collect();
                table(
                    &[
                        "id",
                        "key",
                        "seq",
                        "subject",
                        "attempts",
                        "age",
                        "last error",
                    ],
                    &rows,
                )
            })?;
            Ok(0)
        }
        OutboxCmd::Requeue { id: Some(id), .. } => {
            let woken = operate::requeue_event(&pool, id).await?;
            emit(cli, &json!({"id": id, "requeued": woken}), || {
                if woken {
                    format!("requeued {id}\n")
                } else {
                    format!("{id} is not dead (never was, requeued already, or unknown)\n")
                }
            })?;
            Ok(if woken { 0 } else { 1 })
        }
        OutboxCmd::Requeue { key, limit, .. } => {
            let woken = operate::requeue_dead_events(&pool, key.as_deref(), *limit).await?;
            emit(cli, &json!({"requeued": woken}), || {
                format!("requeued {} dead event(s)\n", woken.len())
            })?;
            Ok(0)
        }
        OutboxCmd::Discard { id } => {
            let gone = operate::discard_event(&pool, id).await?;
            emit(cli, &json!({"id": id, "discarded": gone}), || {
                if gone {
                    format!("discarded {id}\n")
                } else {
                    format!("{id} is not a dead event; nothing discarded\n")
                }
            })?;
            Ok(if gone { 0 } else { 1 })
        }
    }
}

async fn jobs(cli: &Cli, cmd: &JobsCmd) -> Result<u8> {
    let pool = pool(cli)?;
    match cmd {
        JobsCmd::Stats => {
            let s = operate::job_stats(&pool).await?;
            emit(cli, &s, || {
                fields(&[
                    ("due", s.due.to_string()),
                    ("running", s.running.to_string()),
                    ("dead", s.dead.to_string()),
                    ("oldest due", opt_dur(s.oldest_due)),
                ])
            })?;
            Ok(0)
        }
        JobsCmd::Dead {
            kind,
            show_payload,
            page: p,
        } => {
            let dead = operate::dead_jobs(&pool, kind.as_deref(), page(p)).await?;
            // A payload may hold personal data: its size only, unless asked.
            let mut value = serde_json::to_value(&dead)?;
            if !*show_payload {
                for (row, j) in value.as_array_mut().into_iter().flatten().zip(&dead) {
                    if let Some(map) = row.as_object_mut() {
                        map.remove("payload");
                        map.insert("payload_bytes".into(), j.payload_bytes().into());
                    }
                }
            }
            emit(cli, &value, || {
                let rows: Vec<Vec<String>> = dead
                    .iter()
                    .map(|j| {
                        vec![
                            j.id.to_string(),
                            j.kind.clone(),
                            j.key.clone(),
                            j.attempts.to_string(),
                            dur(j.dead_for),
                            short(&j.last_error, 60),
                            if *show_payload {
                                j.payload.to_string()
                            } else {
                                format!("hidden, {} B", j.payload_bytes())
                            },
                        ]
                    })
                    .collect();
                table(
                    &[
                        "id",
                        "kind",
                        "key",
                        "attempts",
                        "dead for",
                        "last error",
                        "payload",
                    ],
                    &rows,
                )
            })?;
            Ok(0)
        }
        JobsCmd::Requeue { id: Some(id), .. } => {
            let r = operate::requeue_job(&pool, *id).await?;
            emit(cli, &json!({"id": id, "result": r}), || match r {
                operate::JobRequeue::Due => format!("requeued job {id}: due now\n"),
                operate::JobRequeue::LiveExists => {
                    format!("job {id} left dead: a live job of its kind and key exists\n")
                }
                _ => format!("job {id} is not dead\n"),
            })?;
            Ok(if r == operate::JobRequeue::Due { 0 } else { 1 })
        }
        JobsCmd::Requeue { kind, limit, .. } => {
            let done = operate::requeue_dead_jobs(&pool, kind.as_deref(), *limit).await?;
            let value: Vec<_> = done
                .iter()
                .map(|(id, r)| json!({"id": id, "result": r}))
                .collect();
            emit(cli, &value, || {
                let due = done
                    .iter()
                    .filter(|(_, r)| *r == operate::JobRequeue::Due)
                    .count();
                format!("requeued {due} of {} dead job(s)\n", done.len())
            })?;
            Ok(0)
        }
        JobsCmd::Discard { id } => {
            let gone = operate::discard_job(&pool, *id).await?;
            emit(cli, &json!({"id": id, "discarded": gone}), || {
                if gone {
                    format!("discarded job {id}\n")
                } else {
                    format!("job {id} is not dead; nothing discarded\n")
                }
            })?;
            Ok(if gone { 0 } else { 1 })
        }
    }
}

async fn inbox(cli: &Cli, cmd: &InboxCmd) -> Result<u8> {
    let pool = pool(cli)?;
    match cmd {
        InboxCmd::Stats => {
            let s = operate::inbox_stats(&pool).await?;
            emit(cli, &s, || {
                let rows: Vec<Vec<String>> = s
                    .iter()
                    .map(|c| vec![c.consumer.clone(), c.done.to_string(), c.dead.to_string()])
                    .collect();
                table(&["consumer", "done", "dead"], &rows)
            })?;
            Ok(0)
        }
        InboxCmd::Dead { consumer, page: p } => {
            let dead = operate::inbox_dead(&pool, consumer, page(p)).await?;
            emit(cli, &dead, || {
                let rows: Vec<Vec<String>> = dead
                    .iter()
                    .map(|l| {
                        vec![
                            l.msg_id.clone(),
                            l.deliveries.to_string(),
                            format!("{} B", l.payload_bytes),
                            short(&l.last_error, 60),
                        ]
                    })
                    .collect();
                table(&["msg id", "deliveries", "payload", "last error"], &rows)
            })?;
            Ok(0)
        }
        InboxCmd::Purge {
            consumer,
            older_than,
            batch,
        } => {
            let n = operate::inbox_purge(&pool, consumer, *older_than, *batch).await?;
            emit(cli, &json!({"consumer": consumer, "deleted": n}), || {
                format!("deleted {n} done record(s) of {consumer}\n")
            })?;
            Ok(0)
        }
    }
}
