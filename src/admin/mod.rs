//! An admin page for operators (feature `admin`): an axum [`Router`] the
//! application mounts where it wants, over [`idem::operate`](crate::operate).
//!
//! ```no_run
//! use std::net::SocketAddr;
//! use idem::admin::{self, AdminConfig};
//!
//! # async fn serve(pool: idem::Pool) -> std::io::Result<()> {
//! let app: axum::Router = axum::Router::new()
//!     .nest("/admin", admin::router(pool, AdminConfig::new()));
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! // The peer address is how the admin page tells loopback callers apart:
//! // without it every request is refused.
//! axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await
//! # }
//! ```
//!
//! Server-rendered HTML, no script, one small stylesheet. Pages:
//!
//! | path | shows |
//! |---|---|
//! | `/` | counts and oldest ages: outbox, jobs, idempotency records by state, inbox per consumer; the `metrics` gauges idem exports, each with its value |
//! | `/jobs?kind=..&offset=..` | dead jobs, one page; requeue or discard one, the selected, or all matching (at most a page) |
//! | `/events?key=..&offset=..` | dead outbox events, the same |
//! | `/inbox?consumer=..&offset=..` | consumers, and one consumer's dead letters (no requeue: that runs the consumer's effect) |
//! | `/key?scope=..&key=..` | one idempotency key's record |
//!
//! # Security
//!
//! The defaults ([`AdminConfig::new`]) are the safe ones, and every check
//! runs on every request, in this order:
//!
//! 1. **Loopback only**: a peer that is not a loopback address gets 403,
//!    and so does a request without a peer address (the server was not
//!    started with `into_make_service_with_connect_info::<SocketAddr>()`);
//!    [`AdminConfig::allow_remote`] lifts this (behind a proxy, every peer
//!    is the proxy: use `authorize` then).
//! 2. **`authorize`**: the application's hook ([`AdminConfig::authorize`])
//!    sees the request's head; `false` → 403.
//! 3. **Read-only**: without [`AdminConfig::actions`] no action is offered
//!    and every POST gets 403.
//! 4. **Origin**: a POST whose `Sec-Fetch-Site` is not `same-origin`, or
//!    whose `Origin` does not name the request's own `Host` (host and
//!    port), gets 403: another port of the same host is the same *site*,
//!    which `SameSite` lets through.
//! 5. **CSRF**: an action is a POST whose form carries the token the page
//!    set in a `SameSite=Strict`, `HttpOnly` cookie; the token is signed
//!    with a secret drawn for each router. A missing, different or forged
//!    token, or more than one such cookie (one planted by a page on
//!    another port), gets 403 and changes nothing.
//!
//! A filter holding a NUL byte is answered 400; a database without idem's
//! migrations, 503 saying to run `idem migrate`.
//!
//! Payloads of dead jobs and stored responses are shown only with
//! [`AdminConfig::show_payloads`] (their size otherwise). Every list is one
//! page (at most [`AdminConfig::page_size`] rows, at most
//! [`MAX_PAGE_SIZE`]), and a bulk action touches at most that many rows.

mod actions;
mod config;
mod csrf;
mod handlers;
mod lists;
mod pages;
mod request;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;

pub use config::{AdminConfig, Authorize, MAX_PAGE_SIZE};

use crate::Pool;
use lists::{Events, Jobs};

/// What every handler shares.
#[derive(Clone)]
struct Admin {
    pool: Pool,
    config: Arc<AdminConfig>,
    csrf: csrf::Csrf,
}

/// The admin pages over `pool`, configured by `config`: mount them with
/// `Router::nest("/admin", ..)` (or serve them alone). The router works for
/// any state type of the application's router.
pub fn router<S>(pool: Pool, config: AdminConfig) -> Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    let admin = Admin {
        pool,
        config: Arc::new(config),
        csrf: csrf::Csrf::new(),
    };
    Router::new()
        .route("/", get(handlers::overview))
        .route("/jobs", get(handlers::dead_list::<Jobs>))
        .route("/jobs/action", post(actions::dead_action::<Jobs>))
        .route("/events", get(handlers::dead_list::<Events>))
        .route("/events/action", post(actions::dead_action::<Events>))
        .route("/inbox", get(handlers::inbox))
        .route("/key", get(handlers::key))
        .layer(middleware::from_fn_with_state(admin.clone(), guard))
        .with_state(admin)
}

/// A refusal not yet rendered: its status and why ([`refuse`] renders it).
struct Refusal(StatusCode, String);

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        refuse(self.0, &self.1)
    }
}

/// A refusal, as a small page.
fn refuse(status: StatusCode, why: &str) -> Response {
    (
        status,
        Html(format!(
            "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{code}</title></head>\
<body><h1>{code}</h1><p id=\"refused\">{}</p></body></html>",
            pages::esc(why),
            code = status.as_u16(),
        )),
    )
        .into_response()
}

/// The checks every request passes before a handler sees it: loopback,
/// `authorize`, read-only. (The CSRF token is checked by the action
/// handlers, which read the form.)
async fn guard(State(admin): State<Admin>, request: Request, next: Next) -> Response {
    if !admin.config.allow_remote {
        let peer = request
            .extensions()
            .get::<ConnectInfo<SocketAddr>>()
            .map(|ConnectInfo(addr)| addr.ip().to_canonical());
        match peer {
            Some(ip) if ip.is_loopback() => {}
            Some(_) => {
                return refuse(
                    StatusCode::FORBIDDEN,
                    "The admin page answers loopback peers only (AdminConfig::allow_remote).",
                )
            }
            None => return refuse(
                StatusCode::FORBIDDEN,
                "No peer address: serve with into_make_service_with_connect_info::<SocketAddr>().",
            ),
        }
    }
    let (parts, body) = request.into_parts();
    if let Some(authorize) = &admin.config.authorize {
        if !authorize(&parts) {
            return refuse(StatusCode::FORBIDDEN, "Not authorized.");
        }
    }
    if parts.method == Method::POST && !admin.config.actions {
        return refuse(
            StatusCode::FORBIDDEN,
            "This admin page is read-only (AdminConfig::actions): nothing was changed.",
        );
    }
    next.run(Request::from_parts(parts, body)).await
}
