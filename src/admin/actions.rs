//! The actions: requeue or discard dead jobs and events (POST, with the
//! checks of [`action_form`]).

use axum::body::Bytes;
use axum::extract::{OriginalUri, State};
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use idem_runtime::operate::{OperateError, Page};

use super::handlers::Rendered;
use super::lists::{given, DeadList};
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

/// The ids an action names: its one id, the ids selected on the page (at
/// most a page), or the first `limit` of the form (at most a page) of the
/// rows `filter` names.
async fn targets<L: DeadList>(
    admin: &Admin,
    op: &Op,
    form: &Fields,
    filter: Option<&str>,
) -> Result<Vec<L::Id>, OperateError> {
    let page_size = admin.config.page_size;
    Ok(match op {
        Op::One(_, id) => id.parse().into_iter().collect(),
        Op::Selected(_) => form
            .all("id")
            .filter_map(|id| id.parse().ok())
            .take(usize::try_from(page_size).unwrap_or(50))
            .collect(),
        Op::All(_) => {
            let n = form
                .number("limit")
                .unwrap_or(page_size)
                .clamp(1, page_size);
            let page = Page {
                limit: n,
                offset: 0,
            };
            let rows = L::rows(&admin.pool, filter, page).await?;
            rows.into_iter().map(L::id).collect()
        }
    })
}

/// A dead list's action ([`DeadList`]): requeue or discard what it names,
/// one line for each id on the result page.
pub(super) async fn dead_action<L: DeadList>(
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
    let filter = form.text(L::NAMES.filter);
    let ids = match targets::<L>(&admin, &op, &form, given(&filter)).await {
        Ok(ids) => ids,
        Err(e) => return admin.failed(e).await,
    };
    let mut lines = Vec::new();
    for id in ids {
        match L::act(&admin.pool, op.verb(), id).await {
            Ok(line) => lines.push(line),
            Err(e) => return admin.failed(e).await,
        }
    }
    let base = base(&original, &uri);
    let back = format!("{base}{}", L::NAMES.path);
    Rendered {
        title: L::NAMES.title.into(),
        body: pages::done(&back, &lines),
        token: admin.token(&headers),
        base,
    }
    .into_response()
}
