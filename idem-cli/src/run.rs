//! Each command: call the operator API, print, pick the exit code.

use idem_runtime::operate;
use serde_json::json;

use crate::args::{Cli, Command, KeyCmd, MigrateAction};
use crate::context::{pool, Result};
use crate::output::{dur, emit, fields, table, write_out};
use crate::{doctor, key, queues};

pub async fn run(cli: &Cli) -> Result<u8> {
    match &cli.command {
        Command::Migrate(m) if m.print_sql => {
            let all = idem_runtime::migrate::migrations();
            let value: Vec<_> = all
                .iter()
                .map(|m| json!({"version": m.version(), "name": m.name(), "checksum": m.checksum(), "sql": m.sql()}))
                .collect();
            if cli.json {
                emit(cli, &value, String::new)?;
            } else {
                // One script, in one transaction, that also records each
                // migration as `idem migrate` does. Printed as it is, tabs
                // and all: it is this build's SQL, not stored data.
                write_out(&idem_runtime::migrate::script())?;
            }
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
            key::show(cli, &pool(cli)?, key, *show_response).await
        }
        Command::Key(KeyCmd::Settle {
            key,
            completed,
            released,
            force,
        }) => key::settle(cli, &pool(cli)?, key, completed.as_ref(), *released, *force).await,
        Command::Outbox(cmd) => queues::outbox(cli, cmd).await,
        Command::Jobs(cmd) => queues::jobs(cli, cmd).await,
        Command::Inbox(cmd) => queues::inbox(cli, cmd).await,
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
        Command::Doctor(d) => doctor::doctor(cli, d).await,
    }
}
