//! `idem::admin` over plain HTTP against what a hostile pass tried: a CSRF
//! cookie planted from another port of the same host, cross-origin POSTs,
//! NUL bytes in filters, an unmigrated database, a scope that is not JSON,
//! an empty page past the end; and what the two dead lists and their
//! actions answer (filters kept across pages, one line per id, failed
//! database calls). The router is served on a loopback port and
//! asked with a bare HTTP/1.1 client; what changed is counted in the
//! database.

use std::net::SocketAddr;

use hyper::Method;
use idem::admin::{self, AdminConfig};
use idem::pool::build_pool;
use idem_testing::TestDatabase;
use tokio_postgres::Client;

#[path = "admin_browser/raw_http.rs"]
mod raw_http;
use raw_http::{http, Reply};

/// The admin router with actions on, at `/admin` on a loopback port.
async fn serve(db: &TestDatabase) -> SocketAddr {
    serve_with(db, AdminConfig::new().actions(true)).await
}

async fn serve_with(db: &TestDatabase, config: AdminConfig) -> SocketAddr {
    let pool = build_pool(db.url()).expect("pool");
    let app: axum::Router = axum::Router::new().nest("/admin", admin::router(pool, config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
    });
    addr
}

async fn migrated() -> (TestDatabase, Client) {
    let db = TestDatabase::create().await.expect("a database");
    let pool = build_pool(db.url()).expect("pool");
    let mut conn = pool.get().await.expect("conn");
    idem::migrate(&mut conn).await.expect("migrated");
    let client = idem_testing::connect(db.url()).await.expect("connect");
    (db, client)
}

async fn dead_job(client: &Client, kind: &str) -> i64 {
    client
        .query_one(
            "INSERT INTO idem_jobs (kind, key, payload, state, last_error, failed_at)
             VALUES ($1, 'k', '{}', 'dead', 'the bank said no', now()) RETURNING id",
            &[&kind],
        )
        .await
        .expect("a dead job")
        .get(0)
}

async fn dead_jobs(client: &Client) -> i64 {
    client
        .query_one("SELECT count(*) FROM idem_jobs WHERE state = 'dead'", &[])
        .await
        .expect("counted")
        .get(0)
}

/// The token a page set: `idem_admin_csrf=<token>`. (The key lookup
/// without a key asks the database nothing: it sets one on any database.)
async fn token(addr: SocketAddr) -> String {
    let page = http(addr, Method::GET, "/admin/key", &[], "").await;
    assert_eq!(page.status, 200, "{}", page.body);
    let cookie = page.set_cookie.expect("a CSRF cookie");
    let pair = cookie.split(';').next().expect("name=value");
    pair.strip_prefix("idem_admin_csrf=")
        .expect("the cookie")
        .to_owned()
}

const FORM: &str = "application/x-www-form-urlencoded";

/// An action's form posted to `path` as the page posts it, with a token a
/// page set.
async fn post_action(addr: SocketAddr, path: &str, form: &str) -> Reply {
    let csrf = token(addr).await;
    let cookie = format!("idem_admin_csrf={csrf}");
    http(
        addr,
        Method::POST,
        path,
        &[("cookie", &cookie), ("content-type", FORM)],
        &format!("csrf={csrf}&{form}"),
    )
    .await
}

#[tokio::test]
async fn a_csrf_cookie_planted_from_another_port_does_not_pass() {
    let (db, client) = migrated().await;
    let addr = serve(&db).await;
    let id = dead_job(&client, "refund").await;
    // The attacker's page (another port of 127.0.0.1) fetched a token of
    // its own; the victim's browser holds another.
    let attackers = token(addr).await;
    let victims = token(addr).await;
    assert_ne!(attackers, victims);
    let form = format!("csrf={attackers}&op=requeue:{id}");
    let own = format!("http://{addr}");
    let other = format!("http://127.0.0.1:{}", addr.port() + 1);
    let planted_first = format!("idem_admin_csrf={attackers}; idem_admin_csrf={victims}");
    let planted_last = format!("idem_admin_csrf={victims}; idem_admin_csrf={attackers}");
    let replaced = format!("idem_admin_csrf={attackers}");
    let by_name = format!("http://localhost:{}", addr.port());
    let refused: Vec<Vec<(&str, &str)>> = vec![
        // Two cookies of that name (the planted one, more specific, first):
        // even from the page's own origin.
        vec![("cookie", &planted_first)],
        vec![("cookie", &planted_last)],
        vec![
            ("cookie", &planted_first),
            ("origin", &own),
            ("sec-fetch-site", "same-origin"),
        ],
        // One cookie (the planted one replaced the victim's), posted from
        // the other port: same site, not same origin.
        vec![
            ("cookie", &replaced),
            ("origin", &other),
            ("sec-fetch-site", "same-site"),
        ],
        vec![("cookie", &replaced), ("origin", &other)],
        vec![("cookie", &replaced), ("sec-fetch-site", "same-site")],
        vec![("cookie", &replaced), ("sec-fetch-site", "cross-site")],
        vec![("cookie", &replaced), ("origin", "null")],
        vec![("cookie", &replaced), ("origin", &by_name)],
    ];
    for headers in &refused {
        let mut with_type = headers.clone();
        with_type.push(("content-type", FORM));
        let reply = http(addr, Method::POST, "/admin/jobs/action", &with_type, &form).await;
        assert_eq!(reply.status, 403, "{headers:?}: {}", reply.body);
        assert!(reply.body.contains("Nothing was changed"), "{}", reply.body);
        assert_eq!(dead_jobs(&client).await, 1, "{headers:?}: still dead");
    }
    // The page's own POST: one cookie, its own origin.
    let reply = http(
        addr,
        Method::POST,
        "/admin/jobs/action",
        &[
            ("cookie", &replaced),
            ("origin", &own),
            ("sec-fetch-site", "same-origin"),
            ("content-type", FORM),
        ],
        &form,
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert!(
        reply.body.contains(&format!("job {id}: due")),
        "{}",
        reply.body
    );
    assert_eq!(dead_jobs(&client).await, 0);
}

#[tokio::test]
async fn nul_bytes_in_filters_are_refused_with_400() {
    let (db, client) = migrated().await;
    let addr = serve(&db).await;
    dead_job(&client, "refund").await;
    for path in [
        "/admin/jobs?kind=%00",
        "/admin/jobs?kind=a%00b&offset=0",
        "/admin/events?key=%00",
        "/admin/inbox?consumer=%00",
        "/admin/key?key=%00",
        "/admin/key?scope=%22%00%22&key=k",
    ] {
        let reply = http(addr, Method::GET, path, &[], "").await;
        assert_eq!(reply.status, 400, "{path}: {}", reply.body);
        assert!(reply.body.contains("NUL"), "{path}: {}", reply.body);
        assert!(!reply.body.contains("database error"), "{}", reply.body);
    }
    // An action whose filter holds one: refused, nothing requeued.
    for (path, form) in [
        ("/admin/jobs/action", "op=requeue_all&kind=%00"),
        ("/admin/events/action", "op=discard_all&key=a%00"),
    ] {
        let reply = post_action(addr, path, form).await;
        assert_eq!(reply.status, 400, "{path}: {}", reply.body);
        assert!(reply.body.contains("NUL"), "{path}: {}", reply.body);
        assert_eq!(dead_jobs(&client).await, 1);
    }
}

#[tokio::test]
async fn an_unmigrated_database_says_to_run_idem_migrate() {
    let db = TestDatabase::create().await.expect("a database");
    let addr = serve(&db).await;
    for path in [
        "/admin",
        "/admin/jobs",
        "/admin/events",
        "/admin/inbox",
        "/admin/inbox?consumer=c",
        "/admin/key?key=k",
    ] {
        let reply = http(addr, Method::GET, path, &[], "").await;
        assert_eq!(reply.status, 503, "{path}: {}", reply.body);
        assert!(
            reply.body.contains("migrations") && reply.body.contains("idem migrate"),
            "{path}: {}",
            reply.body
        );
        assert!(!reply.body.contains("does not exist"), "{}", reply.body);
    }
}

#[tokio::test]
async fn a_scope_that_is_not_json_is_refused() {
    let (db, client) = migrated().await;
    let addr = serve(&db).await;
    // A record under the JSON string "acme": `scope=acme` used to find it.
    let scope = idem::idempotency::scope_hash("acme").expect("scope");
    client
        .execute(
            "INSERT INTO idem_requests (scope, key, operation, fingerprint, mode, state,
                                        expires_at)
             VALUES ($1, 'k', 'pay', decode(repeat('00', 32), 'hex'), 'local', 'unknown',
                     now() + interval '1 day')",
            &[&scope],
        )
        .await
        .expect("a record");
    let reply = http(addr, Method::GET, "/admin/key?scope=acme&key=k", &[], "").await;
    assert_eq!(reply.status, 400, "{}", reply.body);
    assert!(reply.body.contains("not JSON"), "{}", reply.body);
    assert!(!reply.body.contains("id=\"record\""), "{}", reply.body);
    // Quoted, it is found.
    let reply = http(
        addr,
        Method::GET,
        "/admin/key?scope=%22acme%22&key=k",
        &[],
        "",
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert!(reply.body.contains("id=\"record\""), "{}", reply.body);
}

/// A record held as outcome unknown past its retention is not "expired":
/// no purge deletes it and no call takes it over.
#[tokio::test]
async fn an_unknown_record_past_its_retention_shows_kept_until_settled() {
    let (db, client) = migrated().await;
    let addr = serve(&db).await;
    let scope = idem::idempotency::scope_hash("acme").expect("scope");
    let insert = "INSERT INTO idem_requests (scope, key, operation, fingerprint, mode, state,
                                             expires_at)
                  VALUES ($1, 'k', 'pay', decode(repeat('00', 32), 'hex'), 'local', 'unknown',
                          now() - interval '1 day')";
    client.execute(insert, &[&scope]).await.expect("a record");
    let reply = http(
        addr,
        Method::GET,
        "/admin/key?scope=%22acme%22&key=k",
        &[],
        "",
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert!(reply.body.contains("kept until settled"), "{}", reply.body);
    assert!(!reply.body.contains(">expired<"), "{}", reply.body);
}

/// A page past the end says so; the first marks a payload that could not
/// be read back, so that its stored text is not read as a string payload.
#[tokio::test]
async fn an_empty_page_past_the_end_says_no_rows() {
    let (db, client) = migrated().await;
    let addr = serve(&db).await;
    let reply = http(addr, Method::GET, "/admin/jobs?offset=1", &[], "").await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert!(reply.body.contains("no rows"), "{}", reply.body);
    assert!(!reply.body.contains("rows 1–1"), "{}", reply.body);
    // And the first page marks a payload it could not read back (1e400).
    let sql = "UPDATE idem_jobs SET payload = '{\"n\": 1e400}' WHERE id = $1";
    client
        .execute(sql, &[&dead_job(&client, "k").await])
        .await
        .unwrap();
    let reply = http(addr, Method::GET, "/admin/jobs", &[], "").await;
    assert!(reply.body.contains("unreadable as JSON"), "{}", reply.body);
}

/// One, selected and all-matching actions touch what they name, within a
/// page: counted in the table.
#[tokio::test]
async fn bulk_actions_touch_what_they_name_within_a_page() {
    let (db, client) = migrated().await;
    let addr = serve_with(&db, AdminConfig::new().actions(true).page_size(3)).await;
    let mut refunds = Vec::new();
    for _ in 0..6 {
        refunds.push(dead_job(&client, "refund").await);
    }
    let other = dead_job(&client, "email").await;
    // A requeue is refused while a live job of its kind and key exists.
    client
        .execute("UPDATE idem_jobs SET key = 'k' || id", &[])
        .await
        .expect("distinct keys");
    let dead_of = |kind: &'static str| {
        let client = &client;
        async move {
            let n: i64 = client
                .query_one(
                    "SELECT count(*) FROM idem_jobs WHERE state = 'dead' AND kind = $1",
                    &[&kind],
                )
                .await
                .expect("counted")
                .get(0);
            n
        }
    };
    let post = |form: String| async move { post_action(addr, "/admin/jobs/action", &form).await };
    // Four selected and a junk id: the first three (a page) are discarded.
    let selected: String = refunds[..4].iter().map(|id| format!("&id={id}")).collect();
    let reply = post(format!("op=discard_selected{selected}&id=x")).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(dead_of("refund").await, 3);
    // All matching the kind, at most the form's limit.
    let reply = post("op=requeue_all&kind=refund&limit=2".into()).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(dead_of("refund").await, 1);
    assert_eq!(dead_of("email").await, 1);
    // One, by id; an id that is no number names nothing.
    let reply = post(format!("op=discard:{other}")).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let reply = post("op=discard:x".into()).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(dead_of("email").await, 0);
    assert_eq!(dead_of("refund").await, 1);
}

/// A dead event of `key`, `seq`; its id.
async fn dead_event(client: &Client, key: &str, seq: i64) -> String {
    client
        .query_one(
            "INSERT INTO idem_outbox (id, key, seq, subject, kind, version, payload, state,
                                      attempts, last_error, created_at)
             VALUES (gen_random_uuid(), $1, $2, 'orders', 'paid', 1, '{}', 'dead', 5,
                     'the broker refused', now() - (100 - $2::bigint) * interval '1 second')
             RETURNING id::text",
            &[&key, &seq],
        )
        .await
        .expect("a dead event")
        .get(0)
}

/// Asserts that `body` (the answer to `what`) holds every one of `shown`
/// and none of `hidden`.
fn assert_shows(what: &str, body: &str, shown: &[String], hidden: &[String]) {
    for s in shown {
        assert!(body.contains(s.as_str()), "{what}: no {s:?} in {body}");
    }
    for s in hidden {
        assert!(!body.contains(s.as_str()), "{what}: {s:?} in {body}");
    }
}

/// Both lists show what their filter names, one page at a time, and their
/// pager and forms keep the filter.
#[tokio::test]
async fn the_lists_keep_their_filter_across_pages() {
    let (db, client) = migrated().await;
    let addr = serve_with(&db, AdminConfig::new().actions(true).page_size(1)).await;
    let first = dead_event(&client, "a b", 1).await;
    let second = dead_event(&client, "a b", 2).await;
    let other = dead_event(&client, "c", 1).await;
    let refund = dead_job(&client, "refund").await;
    let email = dead_job(&client, "e/mail").await;
    let requeue = |id: &str| format!("value=\"requeue:{id}\"");
    let pages: Vec<(&str, Vec<String>, Vec<String>)> = vec![
        (
            "/admin/events?key=a+b",
            vec![
                requeue(&first),
                "<input name=\"key\" value=\"a b\">".into(),
                "<input type=\"hidden\" name=\"key\" value=\"a b\">".into(),
                "<span class=\"note\">rows 1–1</span> <a href=\"/admin/events?key=a%20b&amp;offset=1\">next »</a>".into(),
            ],
            vec![second.clone(), other.clone()],
        ),
        (
            "/admin/events?key=a%20b&offset=1",
            vec![
                requeue(&second),
                "<a href=\"/admin/events?key=a%20b&amp;offset=0\">« previous</a> <span class=\"note\">rows 2–2</span>".into(),
            ],
            vec![first.clone()],
        ),
        (
            "/admin/events?key=a+b&offset=2",
            vec!["<p id=\"empty\">No dead events.</p>".into(), "no rows".into()],
            vec![],
        ),
        ("/admin/events?key=c", vec![other.clone()], vec![first.clone()]),
        // No filter: every dead event, the pager's address without one.
        (
            "/admin/events",
            vec![first.clone(), "href=\"/admin/events?key=&amp;offset=1\"".into()],
            vec![],
        ),
        (
            "/admin/jobs?kind=e%2Fmail",
            vec![
                format!("id=\"job-{email}\""),
                "<input name=\"kind\" value=\"e/mail\">".into(),
                "href=\"/admin/jobs?kind=e%2Fmail&amp;offset=1\"".into(),
            ],
            vec![format!("id=\"job-{refund}\"")],
        ),
        (
            "/admin/jobs?kind=e%2Fmail&offset=1",
            vec![
                "<p id=\"empty\">No dead jobs.</p>".into(),
                "href=\"/admin/jobs?kind=e%2Fmail&amp;offset=0\"".into(),
            ],
            vec![],
        ),
    ];
    for (path, shown, hidden) in &pages {
        let reply = http(addr, Method::GET, path, &[], "").await;
        assert_eq!(reply.status, 200, "{path}: {}", reply.body);
        assert_shows(path, &reply.body, shown, hidden);
    }
}

/// What each action did to each id, one line each, on a page that links
/// back to its list.
#[tokio::test]
async fn actions_say_what_they_did_to_each_id() {
    let (db, client) = migrated().await;
    let addr = serve_with(&db, AdminConfig::new().actions(true).page_size(2)).await;
    let [a1, a2, a3] = [
        dead_event(&client, "a", 1).await,
        dead_event(&client, "a", 2).await,
        dead_event(&client, "a", 3).await,
    ];
    let b1 = dead_event(&client, "b", 1).await;
    let job = dead_job(&client, "refund").await;
    let dead = dead_job(&client, "email").await;
    let (events, jobs) = ("/admin/events/action", "/admin/jobs/action");
    let not_an_id = "<li>&quot;x&quot; is not an event id (a UUID)".to_owned();
    // In order: each acts on what the ones before left.
    let steps: Vec<(&str, String, Vec<String>, Vec<String>)> = vec![
        (
            events,
            format!("op=requeue:{b1}"),
            vec![
                "<title>Dead events · idem admin</title>".into(),
                format!("<div class=\"msg\" id=\"result\"><ul><li>event {b1}: requeued</li></ul></div><p><a href=\"/admin/events\">Back</a></p>"),
            ],
            vec![],
        ),
        (
            events,
            format!("op=discard:{b1}"),
            vec![format!("<li>event {b1}: not dead, left as it is</li>")],
            vec![],
        ),
        (events, "op=discard:x".into(), vec![not_an_id.clone()], vec![]),
        // All matching the key, at most a page (two), oldest first.
        (
            events,
            "op=discard_all&key=a&limit=9".into(),
            vec![
                format!("<ul><li>event {a1}: discarded</li>"),
                format!("<li>event {a2}: discarded</li>"),
            ],
            vec![a3.clone()],
        ),
        // A page of the selection (two): `x` names nothing, `b1` is past it.
        (
            events,
            format!("op=requeue_selected&id={a3}&id=x&id={b1}"),
            vec![format!("<li>event {a3}: requeued</li>{not_an_id}")],
            vec![b1.clone()],
        ),
        (
            events,
            "op=requeue_all&key=nobody".into(),
            vec!["<li>Nothing matched.</li>".into()],
            vec![],
        ),
        (
            jobs,
            format!("op=requeue:{job}"),
            vec![
                "<title>Dead jobs · idem admin</title>".into(),
                format!("<li>job {job}: due</li></ul></div><p><a href=\"/admin/jobs\">Back</a></p>"),
            ],
            vec![],
        ),
        (
            jobs,
            format!("op=requeue:{job}"),
            vec![format!("<li>job {job}: not_dead</li>")],
            vec![],
        ),
        (
            jobs,
            format!("op=discard:{job}"),
            vec![format!("<li>job {job}: not dead, left as it is</li>")],
            vec![],
        ),
        (
            jobs,
            "op=discard_all".into(),
            vec![format!("<ul><li>job {dead}: discarded</li></ul>")],
            vec![],
        ),
    ];
    for (path, form, shown, hidden) in &steps {
        let reply = post_action(addr, path, form).await;
        assert_eq!(reply.status, 200, "{path} {form}: {}", reply.body);
        assert_shows(&format!("{path} {form}"), &reply.body, shown, hidden);
    }
    // Without a token the events' actions are refused as the jobs' are.
    let reply = http(addr, Method::POST, events, &[], "").await;
    assert_eq!(reply.status, 403, "{}", reply.body);
}

/// A failed database call: 503 naming `idem migrate` where the migrations
/// are missing, 500 with the error otherwise; on the lists and the actions
/// alike.
#[tokio::test]
async fn failed_database_calls_are_503_or_500() {
    let db = TestDatabase::create().await.expect("a database");
    let addr = serve(&db).await;
    let uuid = "00000000-0000-0000-0000-000000000001";
    let actions = [
        ("/admin/jobs/action", "op=requeue_all".to_owned()),
        ("/admin/jobs/action", "op=requeue:1".to_owned()),
        ("/admin/jobs/action", "op=discard_selected&id=1".to_owned()),
        ("/admin/events/action", "op=discard_all&key=k".to_owned()),
        ("/admin/events/action", format!("op=requeue:{uuid}")),
        ("/admin/events/action", format!("op=discard:{uuid}")),
    ];
    for (path, form) in &actions {
        let reply = post_action(addr, path, form).await;
        assert_eq!(reply.status, 503, "{path} {form}: {}", reply.body);
        assert!(reply.body.contains("run `idem migrate`"), "{}", reply.body);
    }
    for path in ["/admin/jobs?kind=k&offset=3", "/admin/events?key=k"] {
        let reply = http(addr, Method::GET, path, &[], "").await;
        assert_eq!(reply.status, 503, "{path}: {}", reply.body);
    }

    // Migrated, then the tables gone: the error itself.
    let pool = build_pool(db.url()).expect("pool");
    let mut conn = pool.get().await.expect("conn");
    idem::migrate(&mut conn).await.expect("migrated");
    let client = idem_testing::connect(db.url()).await.expect("connect");
    client
        .batch_execute("DROP TABLE idem_jobs CASCADE; DROP TABLE idem_outbox CASCADE")
        .await
        .expect("dropped");
    for path in ["/admin/jobs?kind=k", "/admin/events?key=k&offset=1"] {
        let reply = http(addr, Method::GET, path, &[], "").await;
        assert_eq!(reply.status, 500, "{path}: {}", reply.body);
        assert!(
            reply
                .body
                .contains("<p id=\"refused\">The operator call failed: "),
            "{path}: {}",
            reply.body
        );
    }
    for (path, form) in &actions {
        let reply = post_action(addr, path, form).await;
        assert_eq!(reply.status, 500, "{path} {form}: {}", reply.body);
        assert!(
            reply.body.contains("The operator call failed"),
            "{}",
            reply.body
        );
    }
}
