//! Every refusal, whoever makes it (the router, an extractor, the ledger),
//! is an RFC 9457 `application/problem+json` body with the status that says
//! what is wrong, and quotes no input at length; an internal error is a 500
//! problem, logged with its cause.

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};

use axum::http::Method;
use diesel_async::SimpleAsyncConnection;
use serde_json::{json, Value};

use crate::testkit::Ledger;
use crate::{problem, EUR, JSON};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_and_body_refusals_are_problems() {
    let ledger = Ledger::start().await;
    let account = ledger.client.open_account(EUR).await;
    let c = &ledger.client;
    let send = |method: Method,
                path: String,
                headers: &'static [(&'static str, &'static [u8])],
                body: &'static [u8]| async move {
        c.send(method, &path, headers, body)
            .await
            .unwrap_or_else(|e| panic!("{path}: {e}"))
    };

    // An id that is not an integer names no account (was text/plain 400).
    for path in [
        "/accounts/abc",
        "/accounts/1.5",
        "/accounts/%00",
        "/accounts/99999999999999999999",
    ] {
        let reply = send(Method::GET, path.into(), &[], b"").await;
        problem(&reply, 404);
    }
    let reply = send(Method::POST, "/accounts/abc/top-ups".into(), JSON, b"{}").await;
    problem(&reply, 404);
    // Unknown routes (were empty 404s).
    for path in ["/", "/nope", "/accounts/1/top-ups/2", "/ACCOUNTS"] {
        let reply = send(Method::GET, path.into(), &[], b"").await;
        problem(&reply, 404);
    }
    // Wrong methods (were empty 405s), with Allow.
    for (method, path, allowed) in [
        (Method::DELETE, format!("/accounts/{account}"), "PATCH"),
        (Method::PUT, "/transfers".into(), "POST"),
        (Method::GET, "/accounts".into(), "POST"),
    ] {
        let reply = send(method, path, &[], b"").await;
        problem(&reply, 405);
        let allow = reply.header("allow").expect("an Allow header");
        assert!(allow.contains(allowed), "{allow}");
    }
    // Bodies: not JSON, too large, malformed, the wrong shape.
    for (headers, body, status) in [
        (
            &[("content-type", b"text/plain" as &[u8])] as &[_],
            b"{\"currency\":\"EUR\"}" as &[u8],
            415,
        ),
        (&[], b"{\"currency\":\"EUR\"}", 415),
        (JSON, b"{\"currency\":", 400),
        (JSON, b"\xff\xfe", 400),
        (JSON, b"{\"currency\": 5}", 422),
        (JSON, b"[]", 422),
    ] {
        let reply = send(Method::POST, "/accounts".into(), headers, body).await;
        problem(&reply, status);
    }
    // Over the 64 KiB limit (was 400).
    let big = format!(
        "{{\"currency\":\"EUR\",\"pad\":\"{}\"}}",
        " ".repeat(70_000)
    );
    let reply = c
        .send(Method::POST, "/accounts", JSON, big)
        .await
        .expect("a reply, not a reset");
    let body = problem(&reply, 413);
    assert_eq!(body["type"], "urn:ledger:problem:body-too-large");
    // Far over it: the body is read and dropped, the refusal still arrives.
    let huge = vec![b'['; 8 << 20];
    let reply = c
        .send(Method::POST, "/nope", JSON, huge)
        .await
        .expect("a reply, not a reset");
    problem(&reply, 413);
}

/// A request whose refusal must not quote its 60 KB of `Q`s.
struct Echo {
    what: &'static str,
    path: String,
    key: Option<&'static str>,
    body: Vec<u8>,
    status: u16,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_input_is_echoed_at_length() {
    let ledger = Ledger::start().await;
    let account = ledger.client.open_account(EUR).await;
    let long = "Q".repeat(60_000);
    let top_up = format!("/accounts/{account}/top-ups");
    let echo = |what, path: &str, key, body: Value, status| Echo {
        what,
        path: path.to_owned(),
        key,
        body: serde_json::to_vec(&body).expect("JSON"),
        status,
    };
    let sends = [
        echo("open", "/accounts", None, json!({ "currency": long }), 400),
        echo(
            "open once",
            "/accounts",
            Some("\"o\""),
            json!({ "currency": long }),
            400,
        ),
        echo(
            "top-up",
            &top_up,
            Some("\"t\""),
            json!({ "amount": 5, "currency": long }),
            400,
        ),
        echo(
            "transfer",
            "/transfers",
            Some("\"x\""),
            json!({ "from_account": account, "to_account": 9, "amount": 5, "currency": long }),
            400,
        ),
        // serde's own messages quote the value, or the path to it.
        echo(
            "amount",
            &top_up,
            Some("\"a\""),
            json!({ "amount": long, "currency": EUR }),
            422,
        ),
        Echo {
            what: "key in a path",
            path: "/accounts".into(),
            key: None,
            body: format!("{{\"currency\":\"EUR\",\"metadata\":{{\"{long}\":1e999}}}}")
                .into_bytes(),
            status: 400,
        },
        // Over the body limit: refused before anyone parses it.
        echo(
            "2 MB",
            "/accounts",
            None,
            json!({ "currency": "Q".repeat(2 << 20) }),
            413,
        ),
    ];
    for Echo {
        what,
        path,
        key,
        body,
        status,
    } in sends
    {
        let mut headers = JSON.to_vec();
        if let Some(key) = key {
            headers.push(("idempotency-key", key.as_bytes()));
        }
        let reply = ledger
            .client
            .send(Method::POST, &path, &headers, body)
            .await
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let problem = problem(&reply, status);
        let text = problem.to_string();
        assert!(!text.contains(&"Q".repeat(100)), "{what}: {text}");
    }
    let path = format!("/accounts/{}", "9".repeat(60_000));
    let reply = ledger
        .client
        .send(Method::GET, &path, &[], Vec::new())
        .await
        .expect("a reply");
    problem(&reply, 404);
}

/// A `Write` into a shared buffer: the log the test reads.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("the log").extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The process's one subscriber, writing ERROR events into a buffer.
fn captured_log() -> Captured {
    static LOG: OnceLock<Captured> = OnceLock::new();
    LOG.get_or_init(|| {
        let log = Captured::default();
        let writer = log.clone();
        tracing_subscriber::fmt()
            .with_env_filter("error")
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .init();
        log
    })
    .clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_internal_error_is_a_500_problem_logged_with_its_cause() {
    let log = captured_log();
    let mut ledger = Ledger::start().await;
    let account = ledger.client.open_account(EUR).await;
    // A constraint only this test has: every movement now fails in the
    // database, which no client can cause or fix.
    ledger
        .conn
        .batch_execute(
            "ALTER TABLE ledger_transfers \
             ADD CONSTRAINT test_refuses_every_movement CHECK (amount < 0) NOT VALID",
        )
        .await
        .expect("the constraint");

    let reply = ledger.client.top_up("broken", account, 5, EUR).await;
    assert_eq!(reply.status, 500, "{reply:?}");
    assert_eq!(reply.body["type"], "urn:idem:problem:internal");
    assert!(
        !reply.to_owned().body.to_string().contains("test_refuses"),
        "the cause is logged, not sent: {reply:?}"
    );
    let log = String::from_utf8_lossy(&log.0.lock().expect("the log")).into_owned();
    assert!(
        log.contains("ERROR") && log.contains("test_refuses_every_movement"),
        "the log names the cause: {log}"
    );
}

/// idem's admin page at `/admin`, as the example mounts it by default:
/// HTML (outside the problem guard), counting what the ledger wrote, and
/// read-only: a POST is refused with 403 and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_page_is_mounted_read_only() {
    let mut ledger = Ledger::start().await;
    let account = ledger.client.open_account(EUR).await;
    let reply = ledger.client.top_up("admin-1", account, 500, EUR).await;
    assert_eq!(reply.status, 201, "{reply:?}");

    let page = ledger
        .client
        .send(Method::GET, "/admin", &[], Vec::new())
        .await
        .expect("an answer");
    let html = String::from_utf8_lossy(&page.body);
    assert_eq!(page.status, 200, "{html}");
    assert!(
        page.header("content-type")
            .is_some_and(|t| t.starts_with("text/html")),
        "{page:?}"
    );
    assert!(html.contains("<h1>Overview</h1>"), "{html}");
    assert!(html.contains("read-only"), "{html}");
    assert!(html.contains("id=\"records-completed\">1</td>"), "{html}");

    let before = ledger.counts().await;
    let refused = ledger
        .client
        .send(
            Method::POST,
            "/admin/jobs/action",
            &[("content-type", b"application/x-www-form-urlencoded")],
            "op=requeue-all&kind=",
        )
        .await
        .expect("an answer");
    let html = String::from_utf8_lossy(&refused.body);
    assert_eq!(refused.status, 403, "{html}");
    assert!(html.contains("read-only"), "{html}");
    assert_eq!(ledger.counts().await, before);
}
