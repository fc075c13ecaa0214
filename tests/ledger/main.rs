//! The ledger example over real HTTP against a real PostgreSQL, one server
//! and database per test.
//!
//! * `books`: concurrency, idempotency and If-Match keep the books right.
//! * `limits`: amounts, currencies and metadata are bounded and validated
//!   before anything is written; no balance overflows.
//! * `problems`: every refusal is `application/problem+json` with the status
//!   that says what is wrong and no input quoted at length; a 500 is logged
//!   with its cause.
//! * `hostile`: a barrage of hostile requests and a flood of duplicate keys
//!   get 2xx or 4xx problems only, and the books still reconcile.

#[path = "../../examples/ledger/app/mod.rs"]
#[allow(dead_code)]
mod app;
#[path = "../../examples/ledger/testkit.rs"]
#[allow(dead_code)]
mod testkit;

mod books;
mod hostile;
mod limits;
mod problems;

use serde_json::Value;
use testkit::RawReply;

const EUR: &str = "EUR";

/// A refusal's body bound: nothing the client sent is echoed at length.
const SMALL_BODY: usize = 1024;

/// The body of a refusal with `status`: `application/problem+json`, the four
/// standard members, and short.
fn problem(reply: &RawReply, status: u16) -> Value {
    assert_eq!(reply.status, status, "{reply:?}");
    assert_problem(reply)
}

/// Any 4xx: `application/problem+json` (RFC 9457) whose `status` member is
/// the response's, with a `type`, `title` and `detail`, in a small body.
fn assert_problem(reply: &RawReply) -> Value {
    assert_eq!(
        reply.header("content-type"),
        Some("application/problem+json"),
        "{reply:?}"
    );
    assert!(
        reply.body.len() <= SMALL_BODY,
        "a {}-byte refusal: {:?}",
        reply.body.len(),
        String::from_utf8_lossy(&reply.body[..SMALL_BODY.min(reply.body.len())])
    );
    let body: Value = serde_json::from_slice(&reply.body).expect("a JSON problem");
    assert_eq!(body["status"], reply.status, "{body}");
    for member in ["type", "title", "detail"] {
        assert!(body[member].is_string(), "{member} in {body}");
    }
    body
}

/// `content-type: application/json` and nothing else, for `Client::send`.
const JSON: &[(&str, &[u8])] = &[("content-type", b"application/json")];
