//! What stands between the network and the handlers: every request body
//! read whole, within bounds, before any handler runs; handlers run in their
//! own task; and every refusal, whoever makes it, answered as an RFC 9457
//! `application/problem+json`.
//!
//! * A body over [`MAX_BODY_BYTES`] is 413. It is still read to its end (up
//!   to [`MAX_DRAIN_BYTES`]) and dropped: a server that answers without
//!   reading closes a socket with unread data, the kernel resets the
//!   connection, and the client loses the answer. A body declared or found
//!   larger than that is refused at once, and the connection closed.
//! * A body that does not arrive within [`BODY_TIMEOUT`] is 408.
//! * A handler that panics is a logged 500 problem, not a dropped
//!   connection; a client that hangs up does not cancel its request half-way
//!   through a transaction.
//! * Unknown paths are 404 and wrong methods 405 (with `Allow`); any other
//!   4xx or 5xx that arrives without a problem body (axum's own rejections)
//!   becomes one with the same status and headers.

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::header::{CONNECTION, CONTENT_LENGTH, CONTENT_TYPE};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use http_body_util::BodyExt;
use idem::http::{problem_type, Problem, PROBLEM_JSON};

use super::limits::{echo, MAX_BODY_BYTES};

/// The most of a too-large body read (and dropped) so that its 413 reaches
/// the client; past it the connection is closed instead.
pub const MAX_DRAIN_BYTES: usize = 64 * 1024 * 1024;

/// How long a request body may take to arrive.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// `router` with the 404 and 405 problems, and [`guard`] around every route
/// and the fallbacks.
pub fn harden(router: Router) -> Router {
    router
        .method_not_allowed_fallback(wrong_method)
        .fallback(no_route)
        .layer(axum::middleware::from_fn(guard))
}

async fn no_route(uri: Uri) -> Problem {
    Problem::new(
        StatusCode::NOT_FOUND,
        problem_type::NOT_FOUND,
        "Not found",
        format!(
            "there is nothing at \"{}\"; the ledger serves /accounts, /accounts/{{id}}, \
             /accounts/{{id}}/top-ups and /transfers",
            echo(uri.path())
        ),
    )
}

async fn wrong_method(method: Method, uri: Uri) -> Problem {
    Problem::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "urn:ledger:problem:method-not-allowed",
        "Method not allowed",
        format!(
            "{} is not allowed on \"{}\"; the Allow header lists the methods that are",
            echo(method.as_str()),
            echo(uri.path())
        ),
    )
}

/// The middleware: see the module docs.
pub async fn guard(request: Request, next: Next) -> Response {
    let (parts, body) = request.into_parts();
    let bytes = match read_body(&parts.headers, body).await {
        Ok(bytes) => bytes,
        Err(refusal) => return refusal,
    };
    let request = Request::from_parts(parts, Body::from(bytes));
    let response = match tokio::spawn(next.run(request)).await {
        Ok(response) => response,
        Err(e) => {
            tracing::error!(error = %e, "a request handler failed; answered with 500");
            internal()
        }
    };
    as_problem(response)
}

async fn read_body(headers: &HeaderMap, mut body: Body) -> Result<Bytes, Response> {
    let declared = headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_DRAIN_BYTES as u64) {
        return Err(too_large(false));
    }
    let read = async {
        let mut kept = Vec::new();
        let mut seen = 0;
        while let Some(frame) = body.frame().await {
            let Ok(data) = frame.map_err(|_| broken())?.into_data() else {
                continue; // trailers
            };
            seen += data.len();
            if seen > MAX_DRAIN_BYTES {
                return Err(too_large(false));
            }
            if seen <= MAX_BODY_BYTES {
                kept.extend_from_slice(&data);
            }
        }
        if seen > MAX_BODY_BYTES {
            Err(too_large(true))
        } else {
            Ok(Bytes::from(kept))
        }
    };
    match tokio::time::timeout(BODY_TIMEOUT, read).await {
        Ok(read) => read,
        Err(_) => Err(closing(Problem::new(
            StatusCode::REQUEST_TIMEOUT,
            "urn:ledger:problem:body-timeout",
            "Request body too slow",
            format!(
                "the request body did not arrive within {} seconds",
                BODY_TIMEOUT.as_secs()
            ),
        ))),
    }
}

/// 413; `drained` when the whole body was read, so the connection can serve
/// the next request.
fn too_large(drained: bool) -> Response {
    let problem = Problem::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "urn:ledger:problem:body-too-large",
        "Request body too large",
        format!(
            "the request body is over {MAX_BODY_BYTES} bytes; no ledger request is that large \
             (metadata is at most 4096 bytes)"
        ),
    );
    if drained {
        problem.into_response()
    } else {
        closing(problem)
    }
}

fn broken() -> Response {
    closing(Problem::new(
        StatusCode::BAD_REQUEST,
        "urn:ledger:problem:invalid-body",
        "Invalid request body",
        "the request body could not be read to its end (a malformed chunked encoding, or the \
         connection broke)",
    ))
}

/// The response, with `Connection: close`: the rest of the request is not
/// read, so the connection cannot carry another one.
fn closing(problem: Problem) -> Response {
    let mut response = problem.into_response();
    response
        .headers_mut()
        .insert(CONNECTION, HeaderValue::from_static("close"));
    response
}

fn internal() -> Response {
    Problem::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        problem_type::INTERNAL,
        "Internal error",
        "the server failed to handle the request; the details are in its log",
    )
    .into_response()
}

/// A 4xx or 5xx without a problem body becomes one, same status, same
/// headers (`Allow` among them); everything else passes unchanged.
fn as_problem(response: Response) -> Response {
    let status = response.status();
    let is_problem = response
        .headers()
        .get(CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(PROBLEM_JSON.as_bytes()));
    if !(status.is_client_error() || status.is_server_error()) || is_problem {
        return response;
    }
    if status.is_server_error() {
        tracing::error!(%status, "a {status} without a problem body; answered as a problem");
    }
    let (parts, _) = response.into_parts();
    let reason = status.canonical_reason().unwrap_or("Error");
    let mut problem = Problem::new(
        status,
        "about:blank",
        reason,
        format!("the request was refused: {} {reason}", status.as_u16()),
    )
    .into_response();
    for (name, value) in &parts.headers {
        if name != CONTENT_TYPE && name != CONTENT_LENGTH {
            problem.headers_mut().append(name, value.clone());
        }
    }
    problem
}
