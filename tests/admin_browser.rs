//! `idem::admin` in a real browser: headless Chromium driven through
//! chromedriver (WebDriver over HTTP, a small client below) against the
//! admin router over a fresh database whose records, events and jobs the
//! library made. Needs `apt-get install chromium chromium-driver`; without
//! them the test fails, it does not skip.
//!
//! `IDEM_ADMIN_SCREENSHOT=docs/admin-overview.png` (relative to the crate)
//! also writes the overview's screenshot there; it always goes to
//! `target/tmp/admin-overview.png`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use diesel::sql_types::{BigInt, Double, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use hyper::Method;
use idem::admin::{self, AdminConfig};
use idem::jobs::{enqueue, Enqueued, Job, Ladder, Worker};
use idem::outbox::{emit, EmitError, Event, EventId};
use idem::pool::build_pool;
use idem::{idempotent, Pool};
use idem_testing::TestDatabase;
use scoped_futures::ScopedFutureExt;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Db(#[from] diesel::result::Error),
    #[error(transparent)]
    Idem(#[from] idem::Error),
    #[error(transparent)]
    Emit(#[from] EmitError),
    #[error(transparent)]
    Enqueue(#[from] idem::jobs::EnqueueError),
    #[error("refused")]
    Refused,
}

impl idem::IdempotentError for AppError {
    type Final = ();
    fn to_final(&self) -> Option<()> {
        None
    }
    fn from_final(_: ()) -> Self {
        AppError::Refused
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Refund {
    order: String,
}

impl Event for Refund {
    const KIND: &'static str = "paid";
    const VERSION: u32 = 1;
    fn key(&self) -> String {
        self.order.clone()
    }
}

impl Job for Refund {
    const KIND: &'static str = "refund";
    fn key(&self) -> String {
        self.order.clone()
    }
}

/// A payment: its idempotency record, an event and a compensation job.
#[idempotent(key = key, scope = tenant, fingerprint(amount))]
async fn pay(
    conn: &mut AsyncPgConnection,
    tenant: i64,
    key: &str,
    amount: i64,
) -> Result<i64, AppError> {
    let paid = Refund {
        order: format!("order-{amount}"),
    };
    let _: EventId = emit(conn, &paid).await?;
    let _: Enqueued = enqueue(conn, &paid).await?;
    Ok(amount * 100)
}

/// Whether the refund handler fails (the bank says no).
static BANK_SAYS_NO: AtomicBool = AtomicBool::new(true);

/// A worker whose first failure parks a job (no ladder steps).
fn worker(pool: &Pool) -> Worker {
    Worker::new(pool.clone())
        .ladder(Ladder::new(Vec::new()))
        .handle(|_conn, _job: &Refund| {
            async move {
                if AtomicBool::load(&BANK_SAYS_NO, Ordering::SeqCst) {
                    Err("the bank said <b>no</b>".to_owned())
                } else {
                    Ok(())
                }
            }
            .scope_boxed()
        })
}

#[derive(diesel::QueryableByName)]
struct Count {
    #[diesel(sql_type = Text)]
    state: String,
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// Rows of `table` by state, as the database holds them.
async fn counts(pool: &Pool, table: &str) -> Vec<(String, i64)> {
    let mut conn = pool.get().await.expect("conn");
    let rows: Vec<Count> = diesel::sql_query(format!(
        "SELECT state::text AS state, count(*) AS n FROM {table} GROUP BY state ORDER BY state"
    ))
    .load(&mut conn)
    .await
    .expect("counted");
    rows.into_iter().map(|c| (c.state, c.n)).collect()
}

fn count_of(counts: &[(String, i64)], state: &str) -> i64 {
    counts
        .iter()
        .find(|(s, _)| s == state)
        .map_or(0, |(_, n)| *n)
}

#[derive(diesel::QueryableByName)]
struct GaugeTruth {
    #[diesel(sql_type = Double)]
    idem_outbox_pending: f64,
    #[diesel(sql_type = Double)]
    idem_outbox_dead: f64,
    #[diesel(sql_type = Double)]
    idem_outbox_oldest_pending_seconds: f64,
    #[diesel(sql_type = Double)]
    idem_jobs_due: f64,
    #[diesel(sql_type = Double)]
    idem_jobs_running: f64,
    #[diesel(sql_type = Double)]
    idem_jobs_dead: f64,
    #[diesel(sql_type = Double)]
    idem_jobs_oldest_due_seconds: f64,
}

/// The gauges' values as the database holds them now, by SQL of the
/// test's own (absent ages are 0, as the gauges set them).
async fn gauge_truth(pool: &Pool) -> Vec<(&'static str, f64)> {
    let mut conn = pool.get().await.expect("conn");
    let t: GaugeTruth = diesel::sql_query(
        "SELECT (SELECT count(*) FROM idem_outbox WHERE state = 'pending')::float8 AS idem_outbox_pending,
                (SELECT count(*) FROM idem_outbox WHERE state = 'dead')::float8 AS idem_outbox_dead,
                coalesce(extract(epoch FROM now() - (SELECT min(created_at) FROM idem_outbox
                                                      WHERE state = 'pending')), 0)::float8
                    AS idem_outbox_oldest_pending_seconds,
                (SELECT count(*) FROM idem_jobs WHERE state = 'due')::float8 AS idem_jobs_due,
                (SELECT count(*) FROM idem_jobs WHERE state = 'running')::float8 AS idem_jobs_running,
                (SELECT count(*) FROM idem_jobs WHERE state = 'dead')::float8 AS idem_jobs_dead,
                coalesce(extract(epoch FROM now() - (SELECT min(run_at) FROM idem_jobs
                                                      WHERE state = 'due' AND run_at <= now())), 0)::float8
                    AS idem_jobs_oldest_due_seconds",
    )
    .get_result(&mut conn)
    .await
    .expect("the gauges' truth");
    vec![
        ("idem_outbox_pending", t.idem_outbox_pending),
        ("idem_outbox_dead", t.idem_outbox_dead),
        (
            "idem_outbox_oldest_pending_seconds",
            t.idem_outbox_oldest_pending_seconds,
        ),
        ("idem_jobs_due", t.idem_jobs_due),
        ("idem_jobs_running", t.idem_jobs_running),
        ("idem_jobs_dead", t.idem_jobs_dead),
        (
            "idem_jobs_oldest_due_seconds",
            t.idem_jobs_oldest_due_seconds,
        ),
    ]
}

/// The overview's gauge table names every gauge idem exports, each with
/// the value the database holds: counts equal, ages between the database's
/// just before and just after the page was rendered. Returns the values.
async fn assert_gauges(browser: &Session<'_>, pool: &Pool, overview: &str) -> Vec<f64> {
    let before = gauge_truth(pool).await;
    browser.go(overview).await;
    let after = gauge_truth(pool).await;
    assert_eq!(
        browser.count("#gauges tr").await,
        1 + before.len(),
        "one row a gauge"
    );
    let mut shown = Vec::new();
    for ((name, low), (_, high)) in before.iter().zip(&after) {
        let text = browser.text(&format!("#gauge-{name}")).await;
        let value: f64 = text
            .parse()
            .unwrap_or_else(|e| panic!("{name}: {text:?}: {e}"));
        if name.ends_with("_seconds") {
            // Shown to the millisecond.
            assert!(
                *low - 0.0005 <= value && value <= *high + 0.0005,
                "{name}: {value} not within [{low}, {high}]"
            );
        } else {
            assert_eq!((value, *low), (*high, *high), "{name}");
        }
        shown.push(value);
    }
    shown
}

#[path = "admin_browser/raw_http.rs"]
mod raw_http;
use raw_http::http;

#[path = "admin_browser/client.rs"]
mod client;
use client::*;

// ---- the test ----

async fn serve(app: Router, with_peer: bool) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        if with_peer {
            axum::serve(
                listener,
                app.into_make_service_with_connect_info::<SocketAddr>(),
            )
            .await
        } else {
            axum::serve(listener, app).await
        }
    });
    addr
}

#[tokio::test]
async fn the_admin_page_in_headless_chromium() {
    let started = Instant::now();
    // Fail early, before any database work, when the browser is missing.
    let driver = Driver::start().await;

    let db = TestDatabase::create().await.expect("database");
    let pool = build_pool(db.url()).expect("pool");
    let mut conn = pool.get().await.expect("conn");
    idem::migrate(&mut conn).await.expect("migrated");

    // Two payments: two records, two events, two refund jobs.
    for (key, amount) in [("pay-1", 12), ("pay-2", 13)] {
        pay(&pool, 7, key, amount).await.expect("paid");
    }
    // The bank refuses: the worker parks both jobs (no ladder steps).
    let round = worker(&pool).run_once().await.expect("a round");
    assert_eq!(round.dead, 2, "{round:?}");
    // One event is parked as the relay would after its attempts; the other
    // has waited 90 s (the oldest-pending gauge).
    diesel::sql_query(
        "UPDATE idem_outbox SET state = 'dead', attempts = 5, last_error = 'the broker refused'
         WHERE key = 'order-12'",
    )
    .execute(&mut conn)
    .await
    .expect("event parked");
    diesel::sql_query(
        "UPDATE idem_outbox SET created_at = now() - interval '90 seconds' WHERE key = 'order-13'",
    )
    .execute(&mut conn)
    .await
    .expect("event aged");
    drop(conn);

    let app = Router::new()
        .nest(
            "/admin",
            admin::router(pool.clone(), AdminConfig::new().actions(true)),
        )
        .nest("/ro", admin::router(pool.clone(), AdminConfig::new()))
        .nest(
            "/authz",
            admin::router(
                pool.clone(),
                AdminConfig::new().authorize(Arc::new(|parts: &axum::http::request::Parts| {
                    parts.headers.contains_key("x-operator")
                })),
            ),
        );
    let addr = serve(app.clone(), true).await;
    let base = format!("http://{addr}");
    let browser = driver.session().await;

    // 1. The overview shows the counts the database holds.
    browser.go(&format!("{base}/admin")).await;
    let jobs = counts(&pool, "idem_jobs").await;
    let outbox = counts(&pool, "idem_outbox").await;
    let records = counts(&pool, "idem_requests").await;
    for (css, want) in [
        ("#jobs-dead", count_of(&jobs, "dead")),
        ("#jobs-due", count_of(&jobs, "due")),
        ("#outbox-dead", count_of(&outbox, "dead")),
        ("#outbox-pending", count_of(&outbox, "pending")),
        ("#records-completed", count_of(&records, "completed")),
        ("#records-unknown", count_of(&records, "unknown")),
    ] {
        assert_eq!(browser.text(css).await, want.to_string(), "{css}");
    }
    assert_eq!((count_of(&jobs, "dead"), count_of(&outbox, "dead")), (2, 1));
    // The gauges, as the database holds them: one pending event 90 s old,
    // one dead; two dead jobs, none due.
    let shown = assert_gauges(&browser, &pool, &format!("{base}/admin")).await;
    assert_eq!(
        (shown[0], shown[1], shown[3], shown[5], shown[6]),
        (1.0, 1.0, 0.0, 2.0, 0.0),
        "{shown:?}"
    );
    assert!((90.0..120.0).contains(&shown[2]), "{shown:?}");
    let png = browser.screenshot().await;
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "a PNG");
    let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("admin-overview.png");
    std::fs::write(&tmp, &png).expect("screenshot written");
    if let Ok(path) = std::env::var("IDEM_ADMIN_SCREENSHOT") {
        std::fs::write(Path::new(env!("CARGO_MANIFEST_DIR")).join(path), &png)
            .expect("screenshot written");
    }

    // 2. The dead jobs are listed, with their kind, key and error.
    let dead = idem::operate::dead_jobs(&pool, None, idem::operate::Page::default())
        .await
        .expect("dead jobs");
    let job = dead
        .iter()
        .find(|j| j.key == "order-12")
        .expect("order-12's job")
        .id;
    browser.go(&format!("{base}/admin/jobs")).await;
    assert_eq!(browser.count("tr.job").await, 2);
    let row = browser.text(&format!("#job-{job}")).await;
    assert!(
        row.contains("refund")
            && row.contains("order-12")
            && row.contains("the bank said <b>no</b>"),
        "{row}"
    );
    assert!(row.contains("hidden"), "payloads hidden by default: {row}");

    // 3. A POST without the token, or with a forged one, is refused and
    //    changes nothing (sent by the browser, which has the cookie).
    let action = format!("{base}/admin/jobs/action");
    let op = format!("requeue:{job}");
    browser.post_form(&action, &[("op", &op)]).await;
    assert!(
        browser.text("#refused").await.contains("CSRF"),
        "no token refused"
    );
    browser.go(&format!("{base}/admin/jobs")).await;
    browser
        .post_form(
            &action,
            &[("op", &op), ("csrf", &format!("{:0>16}.{:0>64}", 0, 0))],
        )
        .await;
    assert!(
        browser.text("#refused").await.contains("CSRF"),
        "forged token refused"
    );
    let raw = http(
        addr,
        Method::POST,
        "/admin/jobs/action",
        &[("content-type", "application/x-www-form-urlencoded")],
        &format!("op=requeue%3A{job}"),
    )
    .await;
    assert_eq!(raw.status, 403, "{}", raw.body);
    assert_eq!(count_of(&counts(&pool, "idem_jobs").await, "dead"), 2);

    // 4. The read-only router lists without actions and refuses a POST.
    browser.go(&format!("{base}/ro/jobs")).await;
    assert_eq!(browser.count("tr.job").await, 2);
    assert_eq!(browser.count("button[name=op]").await, 0, "no actions");
    browser
        .post_form(&format!("{base}/ro/jobs/action"), &[("op", &op)])
        .await;
    assert!(
        browser.text("#refused").await.contains("read-only"),
        "read-only refused"
    );
    let raw = http(
        addr,
        Method::POST,
        "/ro/jobs/action",
        &[("content-type", "application/x-www-form-urlencoded")],
        &format!("op=requeue%3A{job}"),
    )
    .await;
    assert_eq!(raw.status, 403, "{}", raw.body);
    assert_eq!(count_of(&counts(&pool, "idem_jobs").await, "dead"), 2);

    // 5. The authorize hook and the loopback rule refuse.
    browser.go(&format!("{base}/authz")).await;
    assert!(browser.text("#refused").await.contains("Not authorized"));
    let raw = http(addr, Method::GET, "/authz", &[("x-operator", "me")], "").await;
    assert_eq!(raw.status, 200, "authorized");
    let without_peer = serve(app, false).await;
    let raw = http(without_peer, Method::GET, "/ro", &[], "").await;
    assert_eq!(raw.status, 403, "no peer address: refused");

    // 6. Requeue from the page: the job is due, and a worker runs it.
    browser.go(&format!("{base}/admin/jobs")).await;
    browser.click(&format!("#requeue-{job}")).await;
    let result = browser.text("#result").await;
    assert!(result.contains(&format!("job {job}: due")), "{result}");
    let jobs = counts(&pool, "idem_jobs").await;
    assert_eq!(
        (count_of(&jobs, "due"), count_of(&jobs, "dead")),
        (1, 1),
        "{jobs:?}"
    );
    // The requeued job is due (overdue since the click): the jobs' gauges
    // say so.
    let shown = assert_gauges(&browser, &pool, &format!("{base}/admin")).await;
    assert_eq!((shown[3], shown[5]), (1.0, 1.0), "{shown:?}");
    BANK_SAYS_NO.store(false, Ordering::SeqCst);
    let round = worker(&pool).run_once().await.expect("a round");
    assert_eq!(round.done, 1, "{round:?}");
    let jobs = counts(&pool, "idem_jobs").await;
    assert_eq!(jobs, vec![("dead".to_owned(), 1)], "the requeued job ran");
    browser.go(&format!("{base}/admin")).await;
    assert_eq!(browser.text("#jobs-dead").await, "1");
    assert_eq!(browser.text("#jobs-due").await, "0");

    browser.quit().await;
    eprintln!("admin in headless Chromium: {:?}", started.elapsed());
}
