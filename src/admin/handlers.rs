//! The handlers: read the request, call [`operate`](crate::operate),
//! render a page.

use axum::body::Bytes;
use axum::extract::{OriginalUri, State};
use axum::http::header::{CACHE_CONTROL, COOKIE, SET_COOKIE};
use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri};
use axum::response::{Html, IntoResponse, Response};
use idem_runtime::operate::{self, OperateError, Page};

use super::{csrf, pages, refuse, Admin};

/// A request's query or form fields, decoded.
struct Fields(Vec<(String, String)>);

impl Fields {
    fn parse(s: &str) -> Fields {
        Fields(
            s.split('&')
                .filter(|p| !p.is_empty())
                .map(|p| {
                    let (k, v) = p.split_once('=').unwrap_or((p, ""));
                    (decode(k), decode(v))
                })
                .collect(),
        )
    }
    fn query(uri: &Uri) -> Fields {
        Fields::parse(uri.query().unwrap_or(""))
    }
    fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
    fn text(&self, name: &str) -> String {
        self.get(name).unwrap_or("").trim().to_owned()
    }
    fn all<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.0
            .iter()
            .filter(move |(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
    fn number(&self, name: &str) -> Option<i64> {
        self.get(name)?.trim().parse().ok()
    }
}

/// `application/x-www-form-urlencoded` decoding (`+` is a space).
fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok();
                match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(b) => {
                        out.push(b);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Where the router is mounted: the original path minus the router's own.
fn base(original: &Uri, own: &Uri) -> String {
    let full = original.path();
    let rest = own.path().trim_end_matches('/');
    full.strip_suffix(rest)
        .unwrap_or("")
        .trim_end_matches('/')
        .to_owned()
}

/// The request's page: `offset` from the query, `limit` the config's size.
fn page(admin: &Admin, q: &Fields) -> Page {
    Page {
        limit: admin.config.page_size,
        offset: q.number("offset").unwrap_or(0).max(0),
    }
}

/// A page, with the CSRF cookie when actions are on (the request's own
/// token kept when it is good, a new one otherwise).
struct Rendered {
    title: String,
    body: String,
    token: Option<(String, bool)>,
    base: String,
}

impl Admin {
    /// The token for this request's forms: `(token, new)`; none when read-only.
    fn token(&self, headers: &HeaderMap) -> Option<(String, bool)> {
        if !self.config.actions {
            return None;
        }
        let cookie = csrf::from_cookies(headers.get(COOKIE).and_then(|v| v.to_str().ok()));
        Some(match cookie {
            Some(t) if self.csrf.valid(t) => (t.to_owned(), false),
            _ => (self.csrf.issue(), true),
        })
    }
}

impl IntoResponse for Rendered {
    fn into_response(self) -> Response {
        let read_only = self.token.is_none();
        let html = pages::layout(&self.base, &self.title, read_only, &self.body);
        let mut response = Html(html).into_response();
        let headers = response.headers_mut();
        headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if let Some((token, true)) = self.token {
            let path = if self.base.is_empty() {
                "/"
            } else {
                &self.base
            };
            let cookie = format!(
                "{}={token}; Path={path}; HttpOnly; SameSite=Strict",
                csrf::COOKIE
            );
            if let Ok(v) = HeaderValue::from_str(&cookie) {
                headers.insert(SET_COOKIE, v);
            }
        }
        response
    }
}

fn failed(e: OperateError) -> Response {
    refuse(
        StatusCode::INTERNAL_SERVER_ERROR,
        &format!("The operator call failed: {e}"),
    )
}

pub(super) async fn overview(
    State(admin): State<Admin>,
    OriginalUri(original): OriginalUri,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    let pool = &admin.pool;
    let counts = async {
        Ok::<_, OperateError>((
            operate::record_stats(pool).await?,
            operate::outbox_stats(pool).await?,
            operate::job_stats(pool).await?,
            operate::inbox_stats(pool).await?,
        ))
    };
    let (records, outbox, jobs, inbox) = match counts.await {
        Ok(all) => all,
        Err(e) => return failed(e),
    };
    let limit = usize::try_from(admin.config.page_size).unwrap_or(50);
    let more = inbox.len() > limit;
    Rendered {
        title: "Overview".into(),
        body: pages::overview(
            &records,
            &outbox,
            &jobs,
            &inbox[..inbox.len().min(limit)],
            more,
        ),
        token: admin.token(&headers),
        base: base(&original, &uri),
    }
    .into_response()
}

pub(super) async fn jobs(
    State(admin): State<Admin>,
    OriginalUri(original): OriginalUri,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    let q = Fields::query(&uri);
    let kind = q.text("kind");
    let page = page(&admin, &q);
    let rows = match operate::dead_jobs(
        &admin.pool,
        Some(&kind).filter(|k| !k.is_empty()).map(|k| k.as_str()),
        page,
    )
    .await
    {
        Ok(rows) => rows,
        Err(e) => return failed(e),
    };
    let base = base(&original, &uri);
    let token = admin.token(&headers);
    let mut body = pages::dead_jobs(
        &base,
        &kind,
        &rows,
        token.as_ref().map(|(t, _)| t.as_str()),
        admin.config.show_payloads,
        page.limit,
    );
    body.push_str(&pages::pager(
        &format!("{base}/jobs?kind={}", pages::query_value(&kind)),
        page.offset,
        page.limit,
        rows.len(),
    ));
    Rendered {
        title: "Dead jobs".into(),
        body,
        token,
        base,
    }
    .into_response()
}

pub(super) async fn events(
    State(admin): State<Admin>,
    OriginalUri(original): OriginalUri,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    let q = Fields::query(&uri);
    let key = q.text("key");
    let page = page(&admin, &q);
    let rows = match operate::dead_events(
        &admin.pool,
        Some(&key).filter(|k| !k.is_empty()).map(|k| k.as_str()),
        page,
    )
    .await
    {
        Ok(rows) => rows,
        Err(e) => return failed(e),
    };
    let base = base(&original, &uri);
    let token = admin.token(&headers);
    let mut body = pages::dead_events(
        &base,
        &key,
        &rows,
        token.as_ref().map(|(t, _)| t.as_str()),
        page.limit,
    );
    body.push_str(&pages::pager(
        &format!("{base}/events?key={}", pages::query_value(&key)),
        page.offset,
        page.limit,
        rows.len(),
    ));
    Rendered {
        title: "Dead events".into(),
        body,
        token,
        base,
    }
    .into_response()
}

pub(super) async fn inbox(
    State(admin): State<Admin>,
    OriginalUri(original): OriginalUri,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    let q = Fields::query(&uri);
    let page = page(&admin, &q);
    let consumers = match operate::inbox_stats(&admin.pool).await {
        Ok(c) => c,
        Err(e) => return failed(e),
    };
    let limit = usize::try_from(admin.config.page_size).unwrap_or(50);
    let consumer = q.text("consumer");
    let letters = if consumer.is_empty() {
        None
    } else {
        match operate::inbox_dead(&admin.pool, &consumer, page).await {
            Ok(l) => Some(l),
            Err(e) => return failed(e),
        }
    };
    let base = base(&original, &uri);
    let mut body = pages::inbox(
        &base,
        &consumers[..consumers.len().min(limit)],
        letters.as_deref().map(|l| (consumer.as_str(), l)),
    );
    if let Some(l) = &letters {
        body.push_str(&pages::pager(
            &format!("{base}/inbox?consumer={}", pages::query_value(&consumer)),
            page.offset,
            page.limit,
            l.len(),
        ));
    }
    Rendered {
        title: "Inbox".into(),
        body,
        token: admin.token(&headers),
        base,
    }
    .into_response()
}

pub(super) async fn key(
    State(admin): State<Admin>,
    OriginalUri(original): OriginalUri,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    let q = Fields::query(&uri);
    let scope_text = q.text("scope");
    let key = q.text("key");
    let base = base(&original, &uri);
    let mut record = None;
    if !key.is_empty() {
        // A scope that is no JSON is taken as a JSON string.
        let scope: serde_json::Value = if scope_text.is_empty() {
            serde_json::Value::Null
        } else {
            serde_json::from_str(&scope_text)
                .unwrap_or_else(|_| serde_json::Value::String(scope_text.clone()))
        };
        let found = if scope.is_null() {
            operate::show_key(&admin.pool, &(), &key).await
        } else {
            operate::show_key(&admin.pool, &scope, &key).await
        };
        match found {
            Ok(r) => record = Some(r),
            Err(e) => return failed(e),
        }
    }
    let body = pages::key_lookup(
        &base,
        &scope_text,
        &key,
        record.as_ref().map(Option::as_ref),
        admin.config.show_payloads,
    );
    Rendered {
        title: "Key lookup".into(),
        body,
        token: admin.token(&headers),
        base,
    }
    .into_response()
}

/// An action's form, when its token passed.
fn action_form(admin: &Admin, headers: &HeaderMap, body: &Bytes) -> Option<Fields> {
    let form = Fields::parse(std::str::from_utf8(body).unwrap_or(""));
    let cookie = csrf::from_cookies(headers.get(COOKIE).and_then(|v| v.to_str().ok()));
    admin.csrf.check(cookie, form.get("csrf")).then_some(form)
}

fn bad_token() -> Response {
    refuse(
        StatusCode::FORBIDDEN,
        "Missing or invalid CSRF token: reload the page and try again. Nothing was changed.",
    )
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
    let Some(form) = action_form(&admin, &headers, &body) else {
        return bad_token();
    };
    let Some(op) = op(&form) else {
        return refuse(StatusCode::BAD_REQUEST, "No such action.");
    };
    let limit = admin.config.page_size;
    let kind = form.text("kind");
    let kind = Some(kind.as_str()).filter(|k| !k.is_empty());
    let ids: Vec<i64> = match &op {
        Op::One(_, id) => id.parse().ok().into_iter().collect(),
        Op::Selected(_) => form
            .all("id")
            .filter_map(|i| i.parse().ok())
            .take(usize::try_from(limit).unwrap_or(50))
            .collect(),
        Op::All(_) => {
            let n = form.number("limit").unwrap_or(limit).clamp(1, limit);
            match operate::dead_jobs(
                &admin.pool,
                kind,
                Page {
                    limit: n,
                    offset: 0,
                },
            )
            .await
            {
                Ok(rows) => rows.into_iter().map(|r| r.id).collect(),
                Err(e) => return failed(e),
            }
        }
    };
    let verb = match op {
        Op::One(v, _) | Op::Selected(v) | Op::All(v) => v,
    };
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
                Err(e) => return failed(e),
            }
        } else {
            match operate::discard_job(&admin.pool, id).await {
                Ok(true) => format!("job {id}: discarded"),
                Ok(false) => format!("job {id}: not dead, left as it is"),
                Err(e) => return failed(e),
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
    let Some(form) = action_form(&admin, &headers, &body) else {
        return bad_token();
    };
    let Some(op) = op(&form) else {
        return refuse(StatusCode::BAD_REQUEST, "No such action.");
    };
    let limit = admin.config.page_size;
    let key = form.text("key");
    let key = Some(key.as_str()).filter(|k| !k.is_empty());
    let ids: Vec<String> = match &op {
        Op::One(_, id) => vec![id.clone()],
        Op::Selected(_) => form
            .all("id")
            .map(str::to_owned)
            .take(usize::try_from(limit).unwrap_or(50))
            .collect(),
        Op::All(_) => {
            let n = form.number("limit").unwrap_or(limit).clamp(1, limit);
            match operate::dead_events(
                &admin.pool,
                key,
                Page {
                    limit: n,
                    offset: 0,
                },
            )
            .await
            {
                Ok(rows) => rows.into_iter().map(|r| r.id).collect(),
                Err(e) => return failed(e),
            }
        }
    };
    let verb = match op {
        Op::One(v, _) | Op::Selected(v) | Op::All(v) => v,
    };
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
            Err(e) => return failed(e),
        });
    }
    let base = base(&original, &uri);
    let back = format!("{base}/events");
    result_page(&admin, &headers, base, "Dead events", &back, &lines)
}
