//! The pages: read the request, call [`crate::operate`], render.

use axum::extract::{OriginalUri, State};
use axum::http::header::{CACHE_CONTROL, SET_COOKIE};
use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri};
use axum::response::{Html, IntoResponse, Response};
use idem_runtime::operate::{self, OperateError};

use super::lists::{given, DeadList, Listing};
use super::request::{base, page, Fields};
use super::{csrf, pages, refuse, Admin};

/// A page, with the CSRF cookie when actions are on (the request's own
/// token kept when it is good, a new one otherwise).
pub(super) struct Rendered {
    pub(super) title: String,
    pub(super) body: String,
    pub(super) token: Option<(String, bool)>,
    pub(super) base: String,
}

impl Admin {
    /// The token for this request's forms: `(token, new)`; none when
    /// read-only. The request's own is kept when it is the only one and
    /// good.
    pub(super) fn token(&self, headers: &HeaderMap) -> Option<(String, bool)> {
        if !self.config.actions {
            return None;
        }
        Some(match csrf::from_cookies(headers)[..] {
            [t] if self.csrf.valid(t) => (t.to_owned(), false),
            _ => (self.csrf.issue(), true),
        })
    }

    /// A failed operator call as a page: when idem's migrations are
    /// missing (every page fails on a missing table then), 503 saying to
    /// run `idem migrate`; otherwise 500 with the error.
    pub(super) async fn failed(&self, e: OperateError) -> Response {
        if let Ok(status) = operate::migration_status(&self.pool).await {
            if !status.pending.is_empty() {
                let missing: Vec<String> = status
                    .pending
                    .iter()
                    .map(|m| format!("{} {}", m.version, m.name))
                    .collect();
                return refuse(
                    StatusCode::SERVICE_UNAVAILABLE,
                    &format!(
                        "idem's migrations are missing from this database ({} of {}: {}): run `idem migrate` (or idem::migrate at the application's start-up), then reload.",
                        missing.len(),
                        status.pending.len() + status.applied.len() + status.mismatched.len(),
                        missing.join(", ")
                    ),
                );
            }
        }
        refuse(
            StatusCode::INTERNAL_SERVER_ERROR,
            &format!("The operator call failed: {e}"),
        )
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
        Err(e) => return admin.failed(e).await,
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

/// A dead list's page ([`DeadList`]): one page of the rows its filter
/// names, with the pager under it.
pub(super) async fn dead_list<L: DeadList>(
    State(admin): State<Admin>,
    OriginalUri(original): OriginalUri,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    let q = match Fields::query(&uri).without_nul() {
        Ok(q) => q,
        Err(refused) => return refused.into_response(),
    };
    let filter = q.text(L::NAMES.filter);
    let page = page(&admin, &q);
    let rows = match L::rows(&admin.pool, given(&filter), page).await {
        Ok(rows) => rows,
        Err(e) => return admin.failed(e).await,
    };
    let base = base(&original, &uri);
    let token = admin.token(&headers);
    let list = Listing {
        base: &base,
        filter: &filter,
        csrf: token.as_ref().map(|(t, _)| t.as_str()),
        show_payloads: admin.config.show_payloads,
        limit: page.limit,
    };
    let mut body = L::render(&list, &rows);
    let more = format!(
        "{base}{}?{}={}",
        L::NAMES.path,
        L::NAMES.filter,
        pages::query_value(&filter)
    );
    body.push_str(&pages::pager(&more, page.offset, page.limit, rows.len()));
    Rendered {
        title: L::NAMES.title.into(),
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
    let q = match Fields::query(&uri).without_nul() {
        Ok(q) => q,
        Err(refused) => return refused.into_response(),
    };
    let page = page(&admin, &q);
    let consumers = match operate::inbox_stats(&admin.pool).await {
        Ok(c) => c,
        Err(e) => return admin.failed(e).await,
    };
    let limit = usize::try_from(admin.config.page_size).unwrap_or(50);
    let consumer = q.text("consumer");
    let letters = if consumer.is_empty() {
        None
    } else {
        match operate::inbox_dead(&admin.pool, &consumer, page).await {
            Ok(l) => Some(l),
            Err(e) => return admin.failed(e).await,
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
    let q = match Fields::query(&uri).without_nul() {
        Ok(q) => q,
        Err(refused) => return refused.into_response(),
    };
    let scope_text = q.text("scope");
    let key = q.text("key");
    let base = base(&original, &uri);
    let mut record = None;
    if !key.is_empty() {
        // A scope must be JSON, as the CLI's --scope: `acme` is refused,
        // not taken as the string "acme" (quoted, it is one).
        let scope: serde_json::Value = if scope_text.is_empty() {
            serde_json::Value::Null
        } else {
            match serde_json::from_str(&scope_text) {
                Ok(scope) => scope,
                Err(e) => {
                    let body = format!(
                        "{}<p class=\"msg\" id=\"bad-scope\">The scope is not JSON ({}): give it as the function's <code>scope = ..</code> gives it, e.g. <code>7</code>, <code>[7,\"u1\"]</code>, <code>\"acme\"</code> (a string in quotes); leave it empty for none. Nothing was looked up.</p>",
                        pages::key_lookup(&base, &scope_text, &key, None, false),
                        pages::esc(&e.to_string())
                    );
                    let page = Rendered {
                        title: "Key lookup".into(),
                        body,
                        token: admin.token(&headers),
                        base,
                    };
                    return (StatusCode::BAD_REQUEST, page).into_response();
                }
            }
        };
        let found = if scope.is_null() {
            operate::show_key(&admin.pool, &(), &key).await
        } else {
            operate::show_key(&admin.pool, &scope, &key).await
        };
        match found {
            Ok(r) => record = Some(r),
            Err(e) => return admin.failed(e).await,
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
