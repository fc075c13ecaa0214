//! The actions: requeue or discard dead jobs and events (POST, with the
//! checks of [`action_form`]).

use axum::body::Bytes;
use axum::extract::{OriginalUri, State};
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use idem_runtime::operate::{self, OperateError, Page};

use super::handlers::Rendered;
use super::request::{base, Fields};
use super::{csrf, pages, refuse, Admin, Refusal};

/// An action's form, when the request passed: from this page's origin
/// (as the browser says it), with exactly one CSRF cookie, whose token the
/// form carries and this router signed, and no NUL byte in a field.
/// Otherwise the refusal (403; 400 for a NUL byte).
fn action_form(
    admin: &Admin,
    headers: &HeaderMap,
    original: &Uri,
    body: &Bytes,
) -> Result<Fields, Refusal> {
    if let Some(why) = csrf::cross_origin(headers, original) {
        return Err(Refusal(
            StatusCode::FORBIDDEN,
            format!("{why} Nothing was changed."),
        ));
    }
    let cookies = csrf::from_cookies(headers);
    if cookies.len() > 1 {
        return Err(Refusal(
            StatusCode::FORBIDDEN,
            "More than one idem_admin_csrf cookie: another page on this host (another port, say) has set one. Nothing was changed: clear this host's cookies, reload the page and try again.".to_owned(),
        ));
    }
    let form = Fields::parse(std::str::from_utf8(body).unwrap_or(""));
    if !admin.csrf.check(cookies.first().copied(), form.get("csrf")) {
        return Err(Refusal(
            StatusCode::FORBIDDEN,
            "Missing or invalid CSRF token: reload the page and try again. Nothing was changed."
                .to_owned(),
        ));
    }
    form.without_nul()
}

/// What an action asks for.
enum Op {
    One(&'static str, String),
    Selected(&'static str),
    All(&'static str),
}

fn op(form: &Fields) -> Option<Op> {
    let op = form.get("op")?;
    let verb = |v: &str| match v {
        "requeue" => Some("requeue"),
        "discard" => Some("discard"),
        _ => None,
    };
    if let Some((v, id)) = op.split_once(':') {
        return Some(Op::One(verb(v)?, id.to_owned()));
    }
    let (v, which) = op.split_once('_')?;
    match which {
        "selected" => Some(Op::Selected(verb(v)?)),
        "all" => Some(Op::All(verb(v)?)),
        _ => None,
    }
}

impl Op {
    fn verb(&self) -> &'static str {
        match self {
            Op::One(v, _) | Op::Selected(v) | Op::All(v) => v,
        }
    }
}

/// The ids an action names, as `parse` reads them: its one id, the ids
/// selected on the page (at most a page), or the first `limit` of the form
/// (at most a page) of those `all_matching` lists.
async fn targets<T, F, Fut>(
    op: &Op,
    form: &Fields,
    page_size: i64,
    parse: impl Fn(&str) -> Option<T>,
    all_matching: F,
) -> Result<Vec<T>, OperateError>
where
    F: FnOnce(Page) -> Fut,
    Fut: std::future::Future<Output = Result<Vec<T>, OperateError>>,
{
    Ok(match op {
        Op::One(_, id) => parse(id).into_iter().collect(),
        Op::Selected(_) => form
            .all("id")
            .filter_map(parse)
            .take(usize::try_from(page_size).unwrap_or(50))
            .collect(),
        Op::All(_) => {
            let n = form
                .number("limit")
                .unwrap_or(page_size)
                .clamp(1, page_size);
            all_matching(Page {
                limit: n,
                offset: 0,
            })
            .await?
        }
    })
}

fn result_page(
    admin: &Admin,
    headers: &HeaderMap,
    base: String,
    title: &str,
    back: &str,
    lines: &[String],
) -> Response {
    Rendered {
        title: title.into(),
        body: pages::done(back, lines),
        token: admin.token(headers),
        base,
    }
    .into_response()
}

pub(super) async fn jobs_action(
    State(admin): State<Admin>,
    OriginalUri(original): OriginalUri,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let form = match action_form(&admin, &headers, &original, &body) {
        Ok(form) => form,
        Err(refused) => return refused.into_response(),
    };
    let Some(op) = op(&form) else {
        return refuse(StatusCode::BAD_REQUEST, "No such action.");
    };
    let kind = form.text("kind");
    let kind = Some(kind.as_str()).filter(|k| !k.is_empty());
    let pool = &admin.pool;
    let ids = targets(
        &op,
        &form,
        admin.config.page_size,
        |i| i.parse().ok(),
        |page| async move {
            let rows = operate::dead_jobs(pool, kind, page).await?;
            Ok(rows.into_iter().map(|r| r.id).collect())
        },
    )
    .await;
    let ids = match ids {
        Ok(ids) => ids,
        Err(e) => return admin.failed(e).await,
    };
    let verb = op.verb();
    let mut lines = Vec::new();
    for id in ids {
        let line = if verb == "requeue" {
            match operate::requeue_job(&admin.pool, id).await {
                Ok(r) => format!(
                    "job {id}: {}",
                    serde_json::to_value(r)
                        .map(|v| v.as_str().unwrap_or("").to_owned())
                        .unwrap_or_default()
                ),
                Err(e) => return admin.failed(e).await,
            }
        } else {
            match operate::discard_job(&admin.pool, id).await {
                Ok(true) => format!("job {id}: discarded"),
                Ok(false) => format!("job {id}: not dead, left as it is"),
                Err(e) => return admin.failed(e).await,
            }
        };
        lines.push(line);
    }
    let base = base(&original, &uri);
    let back = format!("{base}/jobs");
    result_page(&admin, &headers, base, "Dead jobs", &back, &lines)
}

pub(super) async fn events_action(
    State(admin): State<Admin>,
    OriginalUri(original): OriginalUri,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let form = match action_form(&admin, &headers, &original, &body) {
        Ok(form) => form,
        Err(refused) => return refused.into_response(),
    };
    let Some(op) = op(&form) else {
        return refuse(StatusCode::BAD_REQUEST, "No such action.");
    };
    let key = form.text("key");
    let key = Some(key.as_str()).filter(|k| !k.is_empty());
    let pool = &admin.pool;
    let ids = targets(
        &op,
        &form,
        admin.config.page_size,
        |i| Some(i.to_owned()),
        |page| async move {
            let rows = operate::dead_events(pool, key, page).await?;
            Ok(rows.into_iter().map(|r| r.id).collect())
        },
    )
    .await;
    let ids = match ids {
        Ok(ids) => ids,
        Err(e) => return admin.failed(e).await,
    };
    let verb = op.verb();
    let mut lines = Vec::new();
    for id in ids {
        let done = if verb == "requeue" {
            operate::requeue_event(&admin.pool, &id).await
        } else {
            operate::discard_event(&admin.pool, &id).await
        };
        lines.push(match done {
            Ok(true) => format!("event {id}: {verb}d"),
            Ok(false) => format!("event {id}: not dead, left as it is"),
            Err(OperateError::Invalid(why)) => why,
            Err(e) => return admin.failed(e).await,
        });
    }
    let base = base(&original, &uri);
    let back = format!("{base}/events");
    result_page(&admin, &headers, base, "Dead events", &back, &lines)
}
