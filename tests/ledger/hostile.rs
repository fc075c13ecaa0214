//! What an attacker sends: a barrage of malformed, oversized, overflowing and
//! odd requests, then a concurrent flood with duplicate Idempotency-Keys.
//! Every answer is a 2xx or a 4xx `application/problem+json`, never a 5xx or
//! a dropped connection, and afterwards the books reconcile.

use std::collections::HashMap;
use std::sync::Arc;

use axum::http::Method;
use serde_json::{json, Value};

use crate::testkit::{Client, Ledger, RawReply};
use crate::{assert_problem, EUR};

/// One request of the barrage.
struct Hostile {
    method: Method,
    path: String,
    headers: Vec<(&'static str, Vec<u8>)>,
    body: Vec<u8>,
}

impl Hostile {
    fn new(method: Method, path: impl Into<String>) -> Hostile {
        Hostile {
            method,
            path: path.into(),
            headers: Vec::new(),
            body: Vec::new(),
        }
    }

    fn header(mut self, name: &'static str, value: impl AsRef<[u8]>) -> Hostile {
        self.headers.push((name, value.as_ref().to_vec()));
        self
    }

    /// A body sent as `application/json`, whatever it holds.
    fn json_bytes(self, body: impl Into<Vec<u8>>) -> Hostile {
        let mut this = self.header("content-type", "application/json");
        this.body = body.into();
        this
    }

    fn json(self, body: Value) -> Hostile {
        self.json_bytes(serde_json::to_vec(&body).expect("JSON"))
    }

    fn key(self, key: &str) -> Hostile {
        self.header("idempotency-key", format!("\"{key}\""))
    }

    async fn send(&self, client: &Client) -> RawReply {
        let headers: Vec<(&str, &[u8])> = self
            .headers
            .iter()
            .map(|(name, value)| (*name, value.as_slice()))
            .collect();
        client
            .send(self.method.clone(), &self.path, &headers, self.body.clone())
            .await
            .unwrap_or_else(|e| panic!("{} {}: dropped: {e}", self.method, self.path))
    }
}

/// A 2xx, or a 4xx problem: never a 5xx.
fn assert_acceptable(what: &str, reply: &RawReply) {
    assert!(
        (200..300).contains(&reply.status) || (400..500).contains(&reply.status),
        "{what}: {reply:?}"
    );
    if reply.status >= 400 {
        assert_problem(reply);
    }
}

fn nested(depth: usize, leaf: Value) -> Value {
    (0..depth).fold(leaf, |inner, _| json!({ "a": inner }))
}

fn barrage(user: i64, other: i64, dollars: i64) -> Vec<Hostile> {
    use Method as M;
    let top_up = format!("/accounts/{user}/top-ups");
    let account = format!("/accounts/{user}");
    let long = "Z".repeat(50_000);
    let mut all = Vec::new();
    // Paths and methods.
    for path in [
        "/accounts/abc",
        "/accounts/%00",
        "/accounts/%FF",
        "/accounts/-1",
        "/accounts/1.0",
        "/accounts/99999999999999999999",
        "/accounts/0x10",
        "/",
        "/admin",
        "/accounts/",
        "/accounts//top-ups",
        "/transfers/1",
        "/accounts/1/top-ups/1",
        "/%2e%2e/etc/passwd",
    ] {
        all.push(Hostile::new(M::GET, path));
    }
    all.push(Hostile::new(
        M::GET,
        format!("/accounts/{}", "7".repeat(20_000)),
    ));
    all.push(
        Hostile::new(M::POST, "/accounts/abc/top-ups")
            .key("p")
            .json(json!({ "amount": 1, "currency": EUR })),
    );
    for (method, path) in [
        (M::DELETE, account.as_str()),
        (M::PUT, "/transfers"),
        (M::GET, "/transfers"),
        (M::GET, "/accounts"),
        (M::OPTIONS, "/accounts"),
        (M::PATCH, "/transfers"),
        (M::DELETE, top_up.as_str()),
        (M::TRACE, "/accounts"),
        (M::POST, account.as_str()),
    ] {
        all.push(Hostile::new(method, path));
    }
    // Content types, and bodies that are not JSON or too large.
    for content_type in [
        "text/plain",
        "application/xml",
        "multipart/form-data; boundary=x",
        "application/x-www-form-urlencoded",
        "application/jsonx",
        "json",
        "",
    ] {
        let mut h = Hostile::new(M::POST, "/accounts").header("content-type", content_type);
        h.body = br#"{"currency":"EUR"}"#.to_vec();
        all.push(h);
    }
    let mut missing = Hostile::new(M::POST, "/transfers").key("no-type");
    missing.body = br#"{"from_account":1}"#.to_vec();
    all.push(missing);
    for body in [
        vec![b' '; 70_000],
        vec![b'{'; 3 << 20],
        format!("{{\"currency\":\"{}\"}}", "E".repeat(2 << 20)).into_bytes(),
    ] {
        all.push(Hostile::new(M::POST, "/accounts").json_bytes(body.clone()));
        all.push(
            Hostile::new(M::POST, "/transfers")
                .key("huge")
                .json_bytes(body),
        );
    }
    all.push(Hostile::new(M::GET, account.as_str()).json_bytes(vec![b'x'; 5 << 20]));
    // JSON that does not parse, NUL included.
    for body in [
        &b""[..],
        b"{",
        b"[",
        b"null",
        b"\"EUR\"",
        b"{\"currency\":}",
        b"{\"currency\":\"E\0R\"}",
        b"{\"currency\":\"EUR\"} trailing",
        b"\xef\xbb\xbf{\"currency\":\"EUR\"}",
        b"\xff",
        b"{\"currency\":\"\\ud800\"}",
        b"{\"currency\":\"EUR\",\"metadata\":{\"a\":1e999}}",
    ] {
        all.push(Hostile::new(M::POST, "/accounts").json_bytes(body));
    }
    all.push(Hostile::new(M::POST, "/accounts").json_bytes(format!(
        "{{\"currency\":\"EUR\",\"metadata\":{}1{}}}",
        "{\"a\":".repeat(500),
        "}".repeat(500)
    )));
    // Currencies.
    for (i, currency) in [
        "eur",
        "EURO",
        "",
        "€€€",
        "E\u{0}R",
        "$$",
        "$a$",
        "12 ",
        long.as_str(),
    ]
    .into_iter()
    .enumerate()
    {
        all.push(Hostile::new(M::POST, "/accounts").json(json!({ "currency": currency })));
        all.push(
            Hostile::new(M::POST, top_up.as_str())
                .key(&format!("cur-{i}"))
                .json(json!({ "amount": 5, "currency": currency })),
        );
        all.push(
            Hostile::new(M::POST, "/transfers")
                .key(&format!("tcur-{i}"))
                .json(json!({
                    "from_account": user, "to_account": other, "amount": 5, "currency": currency
                })),
        );
    }
    // Metadata: not objects, NUL, deep, large, dollar-quote tags.
    for metadata in [
        json!([]),
        json!([{ "a": 1 }]),
        json!("x"),
        json!(1),
        json!(false),
        json!(null),
        json!({ "a": "\u{0}" }),
        json!({ "\u{0}": "a" }),
        json!({ "a": [[["\u{0}"]]] }),
        nested(40, json!(1)),
        nested(120, json!("deep")),
        json!({ "big": long }),
        json!({ "q": "$$", "t": "$tag$ $tag$", "$$": "$ledger$;DROP TABLE ledger_entries;$ledger$" }),
    ] {
        all.push(
            Hostile::new(M::POST, "/accounts")
                .json(json!({ "currency": EUR, "metadata": metadata.clone() })),
        );
        all.push(
            Hostile::new(M::PATCH, account.as_str())
                .header("if-match", "*")
                .json(json!({ "metadata": metadata })),
        );
    }
    // Amounts: overflow, negative, zero, not integers.
    for (i, amount) in [
        json!(i64::MAX),
        json!(i64::MIN),
        json!(-1),
        json!(0),
        json!(1_000_000_000_001_i64),
        json!(9_223_372_036_854_775_808_u64),
        json!(1.5),
        json!("100"),
        json!(null),
        json!(1e30),
    ]
    .into_iter()
    .enumerate()
    {
        all.push(
            Hostile::new(M::POST, top_up.as_str())
                .key(&format!("amt-{i}"))
                .json(json!({ "amount": amount, "currency": EUR })),
        );
        all.push(
            Hostile::new(M::POST, "/transfers")
                .key(&format!("tamt-{i}"))
                .json(json!({
                    "from_account": user, "to_account": other, "amount": amount, "currency": EUR
                })),
        );
    }
    all.push(Hostile::new(M::POST, "/transfers").key("fx").json(json!({
        "from_account": user, "to_account": dollars, "amount": 1, "currency": EUR
    })));
    // Keys, tenants and If-Match.
    let valid = json!({ "amount": 1, "currency": EUR });
    for key in [
        &b""[..],
        b"\"\"",
        b"\"unterminated",
        b"two words",
        b"\"k\"; p=1",
        b"\"a\", \"b\"",
        b"\"\xe2\x80\x8bzero-width\"",
        b"\"\xff\xfe\"",
        b"(\"x\")",
        b"\"tab\there\"",
    ] {
        all.push(
            Hostile::new(M::POST, top_up.as_str())
                .header("idempotency-key", key)
                .json(valid.clone()),
        );
    }
    let long_key = format!("\"{}\"", "k".repeat(300));
    all.push(
        Hostile::new(M::POST, top_up.as_str())
            .header("idempotency-key", long_key)
            .json(valid.clone()),
    );
    all.push(
        Hostile::new(M::POST, top_up.as_str())
            .key("dup")
            .key("dup")
            .json(valid.clone()),
    );
    for tenant in [&b"abc"[..], b"", b"99999999999999999999", b"1.5", b"\xff"] {
        all.push(Hostile::new(M::GET, account.as_str()).header("x-tenant-id", tenant));
    }
    for tag in [
        "v0",
        "W/\"v0\"",
        "\"v99999999999999999999\"",
        "\"x\"",
        "*, \"v0\"",
        "\"v-1\"",
    ] {
        all.push(
            Hostile::new(M::PATCH, account.as_str())
                .header("if-match", tag)
                .json(json!({ "metadata": {} })),
        );
    }
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_barrage_of_hostile_requests_gets_only_4xx_problems() {
    let mut ledger = Ledger::start().await;
    let user = ledger.client.open_account(EUR).await;
    let other = ledger.client.open_account(EUR).await;
    let dollars = ledger.client.open_account("USD").await;
    assert_eq!(
        ledger.client.top_up("seed", user, 1_000, EUR).await.status,
        201
    );

    let barrage = barrage(user, other, dollars);
    assert!(barrage.len() >= 150, "{} requests", barrage.len());
    let mut statuses: HashMap<u16, usize> = HashMap::new();
    for hostile in &barrage {
        let reply = hostile.send(&ledger.client).await;
        assert_acceptable(&format!("{} {:.80}", hostile.method, hostile.path), &reply);
        *statuses.entry(reply.status).or_default() += 1;
    }
    for status in [400, 404, 405, 413, 415, 422] {
        assert!(
            statuses.contains_key(&status),
            "no {status} among {statuses:?}"
        );
    }
    assert_eq!(ledger.balance(user).await, 1_000, "{statuses:?}");
    ledger.assert_consistent().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_duplicate_keys_moves_money_once_per_key() {
    const KEYS: usize = 40;
    const COPIES: usize = 10;
    let mut ledger = Ledger::start().await;
    let users: Vec<i64> = {
        let mut users = Vec::new();
        for _ in 0..4 {
            users.push(ledger.client.open_account(EUR).await);
        }
        users
    };
    // Each key names one request; its copies are the same request, except
    // every tenth copy, which reuses the key for another body, and the
    // overflow attempts, which must be declined.
    let request = |k: usize, copy: usize| -> (String, Value, String) {
        let amount = if copy == 9 { 7 } else { 10 + k as i64 };
        let amount = if k % 13 == 0 {
            json!(i64::MAX)
        } else {
            json!(amount)
        };
        let key = format!("flood-{k}-$tag$");
        if k % 2 == 0 {
            let user = users[k % users.len()];
            (
                format!("/accounts/{user}/top-ups"),
                json!({ "amount": amount, "currency": EUR }),
                key,
            )
        } else {
            let (from, to) = (users[k % users.len()], users[(k + 1) % users.len()]);
            (
                "/transfers".to_owned(),
                json!({ "from_account": from, "to_account": to, "amount": amount, "currency": EUR }),
                key,
            )
        }
    };
    let start = Arc::new(tokio::sync::Barrier::new(KEYS * COPIES));
    let mut tasks = Vec::new();
    for k in 0..KEYS {
        for copy in 0..COPIES {
            let (path, body, key) = request(k, copy);
            let client = ledger.client.clone();
            let start = start.clone();
            tasks.push(tokio::spawn(async move {
                let hostile = Hostile::new(Method::POST, path).key(&key).json(body);
                start.wait().await;
                (k, copy, hostile.send(&client).await)
            }));
        }
    }
    let mut created: HashMap<usize, Vec<Value>> = HashMap::new();
    let (mut replays, mut refused) = (0, 0);
    for task in tasks {
        let (k, copy, reply) = task.await.expect("a request task");
        assert_acceptable(&format!("key {k} copy {copy}"), &reply);
        replays += usize::from(reply.header("idempotent-replayed") == Some("true"));
        refused += usize::from(reply.status >= 400);
        if reply.status == 201 {
            let body: Value = serde_json::from_slice(&reply.body).expect("JSON");
            created.entry(k).or_default().push(body);
        }
    }
    // Not a flood of one kind of answer: duplicates were replayed, and the
    // overflows and reused keys refused.
    assert!(
        replays > 0 && refused > 0,
        "{replays} replays, {refused} refusals"
    );
    let mut topped_up = 0;
    for (k, bodies) in &created {
        assert!(
            bodies.iter().all(|b| b == &bodies[0]),
            "key {k}: {bodies:?}"
        );
        if bodies[0]["kind"] == "top_up" {
            topped_up += bodies[0]["amount"].as_i64().expect("an amount");
        }
    }
    let (_, movements, entries, _) = ledger.counts().await;
    assert_eq!(
        movements as usize,
        created.len(),
        "one movement per key that succeeded"
    );
    assert_eq!(entries, movements * 2);
    // Counted in the database: the customers hold what was topped up.
    let mut held = 0;
    for &user in &users {
        let balance = ledger.balance(user).await;
        assert_eq!(balance, ledger.entries_balance(user).await);
        assert!(balance >= 0);
        held += balance;
    }
    assert_eq!(held, topped_up);
    ledger.assert_consistent().await;
}
