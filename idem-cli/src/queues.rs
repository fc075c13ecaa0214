//! `idem outbox`, `idem jobs`, `idem inbox`: counts, dead rows, requeue,
//! discard, purge.

use idem_runtime::operate;
use serde_json::json;

use crate::args::{Cli, InboxCmd, JobsCmd, OutboxCmd};
use crate::context::{page, pool, Result};
use crate::output::{dur, emit, fields, opt_dur, short, table};

pub async fn outbox(cli: &Cli, cmd: &OutboxCmd) -> Result<u8> {
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

pub async fn jobs(cli: &Cli, cmd: &JobsCmd) -> Result<u8> {
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
                            match (*show_payload, j.payload_unreadable) {
                                (true, false) => j.payload.to_string(),
                                (true, true) => format!("unreadable: {}", j.payload),
                                (false, false) => format!("hidden, {} B", j.payload_bytes()),
                                (false, true) => {
                                    format!("hidden, {} B, unreadable", j.payload_bytes())
                                }
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
            let due = done
                .iter()
                .filter(|(_, r)| *r == operate::JobRequeue::Due)
                .count();
            // Left dead beside a live job of its kind and key: as for one
            // id, exit 1, so that a script does not take it as done. One
            // requeued or discarded meanwhile (not dead any more) is not.
            let left = done
                .iter()
                .filter(|(_, r)| *r == operate::JobRequeue::LiveExists)
                .count();
            emit(cli, &value, || {
                let mut line = format!("requeued {due} of {} dead job(s)", done.len());
                if left > 0 {
                    line += &format!("; {left} left dead: a live job of its kind and key exists");
                }
                line + "\n"
            })?;
            Ok(u8::from(left > 0))
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

pub async fn inbox(cli: &Cli, cmd: &InboxCmd) -> Result<u8> {
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
