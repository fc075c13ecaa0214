//! `idem key`: one idempotency record, shown or settled.

use idem_runtime::idempotency::Settlement;
use idem_runtime::operate;
use idem_runtime::pool::Pool;
use serde_json::json;

use crate::args::{Cli, KeyArgs};
use crate::output::{clean, dur, emit, fields, opt_dur};
use crate::run::Result;

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
    let found = operate::settle(pool, &key.scope, &key.key, settlement).await?;
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
