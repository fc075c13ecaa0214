//! `idem key`: one idempotency record, shown or settled.

use idem_runtime::idempotency::Settlement;
use idem_runtime::operate::{self, Forced};
use idem_runtime::pool::Pool;
use serde_json::json;

use crate::args::{Cli, KeyArgs};
use crate::context::Result;
use crate::output::{clean, dur, emit, fields, opt_dur};

/// `idem key show`.
pub async fn show(cli: &Cli, pool: &Pool, key: &KeyArgs, show_response: bool) -> Result<u8> {
    let Some(mut rec) = operate::show_key(pool, &key.scope, &key.key).await? else {
        emit(cli, &serde_json::Value::Null, String::new)?;
        eprintln!(
            "idem: no record of key {:?} under scope {}",
            key.key, key.scope
        );
        return Ok(1);
    };
    let response = rec.response.take();
    let value = if show_response {
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
                } else if rec.state != "completed" {
                    // No purge or call acts on its retention (KeyRecord::expired).
                    "kept until settled".into()
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

/// `idem key settle`.
pub async fn settle(
    cli: &Cli,
    pool: &Pool,
    key: &KeyArgs,
    completed: Option<&serde_json::Value>,
    released: bool,
    force: bool,
) -> Result<u8> {
    let what = if released { "released" } else { "completed" };
    if !force {
        let live = operate::show_key(pool, &key.scope, &key.key)
            .await?
            .filter(|rec| rec.state == "in_progress")
            .and_then(|rec| rec.lease_left)
            .filter(|left| !left.is_zero());
        if let Some(left) = live {
            let why = format!(
                "the claim of key {:?} is held for {} more: its request may still be calling the target; wait for the lease, or pass --force",
                key.key,
                dur(left)
            );
            // --json answers with a document here too, as when nothing is found.
            if cli.json {
                let doc = json!({"key": key.key, "settled": false, "as": what,
                                 "refused": why, "lease_left": left.as_secs_f64()});
                emit(cli, &doc, String::new)?;
            }
            eprintln!("idem: {}", clean(&why));
            return Ok(1);
        }
    }
    let settlement = match (completed, released) {
        (Some(response), false) => Settlement::Completed(response.clone()),
        _ => Settlement::Released,
    };
    if force {
        // Whatever the state: a completed record is corrected, too.
        let forced = operate::settle_forced(pool, &key.scope, &key.key, settlement).await?;
        let done = forced != Forced::NotFound;
        let doc = json!({"key": key.key, "settled": done, "as": what,
                         "overwritten": forced == Forced::Overwritten});
        emit(cli, &doc, || match forced {
            Forced::Settled => format!("settled {:?}: {what}\n", key.key),
            Forced::Overwritten if released => format!(
                "released {:?}: its completed record is deleted, the key is new again\n",
                key.key
            ),
            Forced::Overwritten => format!(
                "settled {:?}: completed, its stored response replaced\n",
                key.key
            ),
            _ => format!("no record of {:?} to settle\n", key.key),
        })?;
        return Ok(if done { 0 } else { 1 });
    }
    if operate::settle(pool, &key.scope, &key.key, settlement).await? {
        let doc = json!({"key": key.key, "settled": true, "as": what, "overwritten": false});
        emit(cli, &doc, || format!("settled {:?}: {what}\n", key.key))?;
        return Ok(0);
    }
    // Nothing settled: no record, or a completed one, which only --force
    // changes.
    let completed = operate::show_key(pool, &key.scope, &key.key)
        .await?
        .is_some_and(|rec| rec.state == "completed");
    let mut doc = json!({"key": key.key, "settled": false, "as": what, "overwritten": false});
    if completed {
        let why = format!(
            "the record of key {:?} is completed: duplicates get its stored response. --force replaces that response (with --completed) or deletes the record so the key is new again (with --released)",
            key.key
        );
        if cli.json {
            doc["refused"] = why.clone().into();
            emit(cli, &doc, String::new)?;
        }
        eprintln!("idem: {}", clean(&why));
        return Ok(1);
    }
    emit(cli, &doc, || {
        format!("no record of {:?} to settle\n", key.key)
    })?;
    Ok(1)
}
