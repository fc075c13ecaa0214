//! Hostile pass (helper, session 70) on 1e3a967 and f15572c: a handler that
//! swaps the connection it was lent and returns `Ok` makes its job dead;
//! dead listings mark a payload that could not be read back. Every outcome
//! is read from the database (effect rows, `idem_jobs`, `pg_stat_activity`,
//! `octet_length(payload::text)`), not from the worker's report.

use std::io::{Read, Write};

use idem::operate::{dead_jobs, DeadJobRow, Page};

use super::*;

/// Effects of `key` written by `worker` (the tag the handler gave).
pub(super) async fn effects_by(env: &Env, key: &str, worker: &str) -> i64 {
    env.client
        .query_one(
            "SELECT count(*) FROM effects WHERE key = $1 AND worker = $2",
            &[&key, &worker],
        )
        .await
        .expect("count effects")
        .get(0)
}

/// No session of the test database is left in a transaction (the lent
/// connection a handler took away, with the job's hold, is closed).
pub(super) async fn no_open_transaction_left(env: &Env) {
    env.until(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
         AND state LIKE 'idle in transaction%'",
        0,
    )
    .await;
}

/// The one job of `key`: dead after its first run, "swapped" said.
pub(super) async fn dead_for_swapping(env: &Env, key: &str) {
    let jobs = env.jobs(key).await;
    let [(state, 1, Some(error))] = &jobs[..] else {
        panic!("{key}: {jobs:?}")
    };
    assert_eq!(state, "dead", "{key}: {error}");
    assert!(error.contains("swapped"), "{key}: {error}");
}

/// Swapping in a connection and swapping the same one back before returning
/// is no swap: the job runs as any other, its effect committed with its
/// end, in a round beside a plain job. A write through a connection of
/// the handler's own meanwhile commits on its own (the handler's business).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack4_a_swap_undone_before_returning_runs_normally() {
    let env = env().await;
    for key in ["noop", "mixed", "plain"] {
        enqueue_new(&env, key).await;
    }
    let url = env.db.url().to_owned();
    let worker = Worker::new(env.pool.clone())
        .ladder(Ladder::new([Duration::ZERO; 3]))
        .handle(move |conn, job: &Compensate| {
            let url = url.clone();
            async move {
                if job.key != "plain" {
                    let mut own = AsyncPgConnection::establish(&url).await.expect("connect");
                    std::mem::swap(conn, &mut own);
                    if job.key == "mixed" {
                        // `own` is the lent one now; `conn` the handler's.
                        record_effect(&mut own, &job.key, "lent").await?;
                        record_effect(conn, &job.key, "own").await?;
                    }
                    std::mem::swap(conn, &mut own);
                }
                record_effect(conn, &job.key, "after").await?;
                Ok::<_, AppError>(())
            }
            .scope_boxed()
        });
    let round = worker.run_once().await.expect("round");
    assert_eq!((round.claimed, round.done), (3, 3), "{round:?}");
    for key in ["noop", "mixed", "plain"] {
        assert!(env.jobs(key).await.is_empty(), "{key}");
        assert_eq!(effects_by(&env, key, "after").await, 1, "{key}");
    }
    assert_eq!(effects_by(&env, "mixed", "lent").await, 1);
    assert_eq!(effects_by(&env, "mixed", "own").await, 1);
    assert_eq!(env.effects("noop").await, 1);
    no_open_transaction_left(&env).await;
}

/// A handler that writes through the lent connection, swaps in one of its
/// own, swaps again (`mem::replace`), writing through each, and returns
/// `Ok`: dead at once; what it wrote through the lent connection rolled
/// back with the job's hold, what it wrote through its own committed once;
/// the other jobs of the round finish normally, once each; nothing claims
/// the dead job again; the lent connection's transaction is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack4_swapping_twice_and_returning_ok_is_dead_and_the_round_runs() {
    let env = env().await;
    for key in ["a", "twice", "b"] {
        enqueue_new(&env, key).await;
    }
    let url = env.db.url().to_owned();
    let worker = Worker::new(env.pool.clone())
        .ladder(Ladder::new([Duration::ZERO; 3]))
        .handle(move |conn, job: &Compensate| {
            let url = url.clone();
            async move {
                record_effect(conn, &job.key, "lent").await?;
                if job.key == "twice" {
                    let first = AsyncPgConnection::establish(&url).await.expect("connect");
                    let lent = std::mem::replace(conn, first);
                    record_effect(conn, &job.key, "own1").await?;
                    let second = AsyncPgConnection::establish(&url).await.expect("connect");
                    let first = std::mem::replace(conn, second);
                    record_effect(conn, &job.key, "own2").await?;
                    drop((lent, first));
                }
                Ok::<_, AppError>(())
            }
            .scope_boxed()
        });
    let round = worker.run_once().await.expect("round");
    assert_eq!(
        (round.claimed, round.done, round.dead),
        (3, 2, 1),
        "{round:?}"
    );
    dead_for_swapping(&env, "twice").await;
    assert_eq!(effects_by(&env, "twice", "lent").await, 0);
    assert_eq!(effects_by(&env, "twice", "own1").await, 1);
    assert_eq!(effects_by(&env, "twice", "own2").await, 1);
    for key in ["a", "b"] {
        assert!(env.jobs(key).await.is_empty(), "{key}");
        assert_eq!(env.effects(key).await, 1, "{key}");
    }
    env.make_due_now().await;
    let again = worker.run_once().await.expect("round");
    assert_eq!(again.claimed, 0, "{again:?}");
    assert_eq!(env.effects("twice").await, 2, "its own writes, once each");
    no_open_transaction_left(&env).await;
}

/// A handler that swaps, writes through its own connection, then panics:
/// dead at once for the swap (not retried down the ladder as a plain
/// panic is), its own write once, the lent one's none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack4_a_panic_after_a_swap_is_dead_at_once() {
    let env = env().await;
    enqueue_new(&env, "boom").await;
    enqueue_new(&env, "fine").await;
    let url = env.db.url().to_owned();
    let worker = Worker::new(env.pool.clone())
        .ladder(Ladder::new([Duration::ZERO; 3]))
        .handle(move |conn, job: &Compensate| {
            let url = url.clone();
            async move {
                record_effect(conn, &job.key, "lent").await?;
                if job.key == "boom" {
                    let mut own = AsyncPgConnection::establish(&url).await.expect("connect");
                    std::mem::swap(conn, &mut own);
                    record_effect(conn, &job.key, "own").await?;
                    panic!("after the swap");
                }
                Ok::<_, AppError>(())
            }
            .scope_boxed()
        });
    let round = worker.run_once().await.expect("round");
    assert_eq!(
        (round.claimed, round.done, round.dead),
        (2, 1, 1),
        "{round:?}"
    );
    dead_for_swapping(&env, "boom").await;
    assert_eq!(effects_by(&env, "boom", "lent").await, 0);
    assert_eq!(effects_by(&env, "boom", "own").await, 1);
    assert_eq!(env.effects("fine").await, 1);
    env.make_due_now().await;
    assert_eq!(worker.run_once().await.expect("round").claimed, 0);
    no_open_transaction_left(&env).await;
}

/// A handler that swaps the lent connection with one checked out of the
/// worker's own pool and returns `Ok`: dead; its write through the lent
/// connection (now in the pool's checkout, with the job's hold) never
/// commits; the pool still runs later jobs, once each, and is left with
/// no session in a transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack4_swapping_with_a_pooled_connection_is_dead_and_the_pool_recovers() {
    let env = env().await;
    enqueue_new(&env, "pooled").await;
    let pool = env.pool.clone();
    let swapper = Worker::new(env.pool.clone())
        .ladder(Ladder::new([Duration::ZERO; 3]))
        .handle(move |conn, job: &Compensate| {
            let pool = pool.clone();
            async move {
                record_effect(conn, &job.key, "lent").await?;
                let mut pooled = pool.get().await.map_err(idem::Error::Pool)?;
                std::mem::swap(conn, &mut *pooled);
                record_effect(conn, &job.key, "pooled").await?;
                Ok::<_, AppError>(())
            }
            .scope_boxed()
        });
    let round = swapper.run_once().await.expect("round");
    assert_eq!((round.claimed, round.dead), (1, 1), "{round:?}");
    dead_for_swapping(&env, "pooled").await;
    assert_eq!(effects_by(&env, "pooled", "lent").await, 0);
    // Written through the pooled connection, in no transaction: committed
    // on its own, once.
    assert_eq!(effects_by(&env, "pooled", "pooled").await, 1);
    let keys: Vec<String> = (0..12).map(|i| format!("later-{i}")).collect();
    for key in &keys {
        enqueue_new(&env, key).await;
    }
    let plain = worker(&env.pool, |_| None);
    let mut done = 0;
    while done < keys.len() {
        let round = plain.run_once().await.expect("round");
        assert_eq!(round.claimed, round.done, "{round:?}");
        assert!(round.claimed > 0, "{round:?}");
        done += round.done;
    }
    for key in &keys {
        assert_eq!(env.effects(key).await, 1, "{key}");
        assert!(env.jobs(key).await.is_empty(), "{key}");
    }
    assert_eq!(env.jobs("pooled").await.len(), 1, "still dead, not run");
    no_open_transaction_left(&env).await;
}

/// An enqueue that collapses into the job while a handler that swaps runs
/// (committed from a task of its own before the handler returns `Ok`) is
/// owed a run: the job is due again, not dead, and the next run (which
/// does not swap) completes it, its effect once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack4_an_enqueue_collapsed_into_a_swapping_run_is_owed_a_run() {
    let env = env().await;
    enqueue_new(&env, "owed").await;
    let url = env.db.url().to_owned();
    let pool = env.pool.clone();
    let calls = Calls::default();
    let seen = calls.clone();
    let worker = Worker::new(env.pool.clone())
        .ladder(Ladder::new([Duration::ZERO; 3]))
        .handle(move |conn, job: &Compensate| {
            seen.tick();
            let first = seen.get() == 1;
            let (url, pool) = (url.clone(), pool.clone());
            async move {
                if first {
                    // Outside this task's attempt: a decision of its own.
                    let again = Compensate::new(&job.key);
                    let enqueued = tokio::spawn(async move { decide(&pool, &again).await })
                        .await
                        .expect("no panic")?;
                    assert!(!enqueued.is_new(), "{enqueued:?}");
                    let mut own = AsyncPgConnection::establish(&url).await.expect("connect");
                    std::mem::swap(conn, &mut own);
                    return Ok(());
                }
                record_effect(conn, &job.key, "second").await?;
                Ok::<_, AppError>(())
            }
            .scope_boxed()
        });
    let round = worker.run_once().await.expect("round");
    assert_eq!((round.claimed, round.dead), (1, 0), "{round:?}");
    let jobs = env.jobs("owed").await;
    let [(state, 1, Some(error))] = &jobs[..] else {
        panic!("{jobs:?}")
    };
    assert_eq!(state, "due", "{error}");
    assert!(error.contains("swapped"), "{error}");
    let round = worker.run_once().await.expect("round");
    assert_eq!((round.claimed, round.done), (1, 1), "{round:?}");
    assert_eq!(calls.get(), 2);
    assert_eq!(env.effects("owed").await, 1);
    assert!(env.jobs("owed").await.is_empty());
}

/// The long-running worker (`Worker::run`), not `run_once`: of six jobs
/// one swaps and returns `Ok`; it is dead, the five others done once each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack4_the_long_running_worker_parks_a_swapping_job() {
    let env = env().await;
    let keys: Vec<String> = (0..6).map(|i| format!("k{i}")).collect();
    for key in &keys {
        enqueue_new(&env, key).await;
    }
    let url = env.db.url().to_owned();
    let worker = Worker::new(env.pool.clone())
        .poll_interval(Duration::from_millis(20))
        .ladder(Ladder::new([Duration::ZERO; 3]))
        .handle(move |conn, job: &Compensate| {
            let url = url.clone();
            async move {
                record_effect(conn, &job.key, "lent").await?;
                if job.key == "k3" {
                    let mut own = AsyncPgConnection::establish(&url).await.expect("connect");
                    std::mem::swap(conn, &mut own);
                }
                Ok::<_, AppError>(())
            }
            .scope_boxed()
        });
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(worker.run(async {
        let _ = stopped.await;
    }));
    env.until("SELECT count(*) FROM idem_jobs WHERE state <> 'dead'", 0)
        .await;
    let _ = stop.send(());
    running.await.expect("no panic").expect("the worker");
    dead_for_swapping(&env, "k3").await;
    for key in &keys {
        let want = i64::from(key != "k3");
        assert_eq!(env.effects(key).await, want, "{key}");
    }
    no_open_transaction_left(&env).await;
}

/// Dead jobs by hand, all of kind `kind`: `(key, payload as SQL text)`.
async fn dead_by_hand(env: &Env, kind: &str, jobs: &[(&str, &str)]) {
    for (key, payload) in jobs {
        env.client
            .execute(
                "INSERT INTO idem_jobs (kind, key, payload, state, last_error, failed_at)
                 VALUES ($1, $2, $3::text::jsonb, 'dead', 'no', now())",
                &[&kind, key, payload],
            )
            .await
            .unwrap_or_else(|e| panic!("{key}: {e}"));
    }
}

/// `octet_length(payload::text)` of the job of `key`: the stored text's size.
async fn stored_bytes(env: &Env, key: &str) -> usize {
    let n = env
        .scalar(&format!(
            "SELECT octet_length(payload::text)::bigint FROM idem_jobs WHERE key = '{key}'"
        ))
        .await;
    usize::try_from(n).expect("a size")
}

/// The stored text of one unreadable payload (unicode, escapes, markup),
/// and a readable payload that is a JSON string holding exactly that text:
/// the same `payload` value, told apart by the flag only; `payload_bytes`
/// is the stored text's size for the first, its quoted JSON's for the
/// second (what jsonb prints for a string, too); the kind filter and
/// pages keep the flags with their rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack4_an_unreadable_payload_and_a_string_of_its_text_are_told_apart() {
    let env = env().await;
    let unreadable = r#"{"n": 1e400, "s": "é ✓ \"<b>&amp;</b>\" \n\t\u0001 \\", "deep": 1}"#;
    dead_by_hand(&env, "a", &[("u", unreadable)]).await;
    let text: String = env
        .client
        .query_one("SELECT payload::text FROM idem_jobs WHERE key = 'u'", &[])
        .await
        .unwrap()
        .get(0);
    env.client
        .execute(
            "INSERT INTO idem_jobs (kind, key, payload, state, last_error, failed_at)
             VALUES ('a', 's', to_jsonb($1::text), 'dead', 'no', now())",
            &[&text],
        )
        .await
        .unwrap();
    let deep = format!("{}{}", "[".repeat(129), "]".repeat(129));
    let shallow = format!("{}{}", "[".repeat(64), "]".repeat(64));
    dead_by_hand(&env, "b", &[("deep", &deep), ("shallow", &shallow)]).await;
    dead_by_hand(&env, "b", &[("max", "1.8e308"), ("fits", "1.7e308")]).await;

    let mut conn = env.pool.get().await.unwrap();
    let dead = idem::jobs::dead(&mut conn, Some("a"), 10).await.unwrap();
    drop(conn);
    assert_eq!(dead.len(), 2);
    let by_key = |k: &str| dead.iter().find(|d| d.key == k).expect(k);
    assert_eq!(by_key("u").payload, serde_json::Value::String(text.clone()));
    assert_eq!(by_key("s").payload, by_key("u").payload);
    assert!(by_key("u").payload_unreadable);
    assert!(!by_key("s").payload_unreadable);

    let all = dead_jobs(&env.pool, None, Page::default()).await.unwrap();
    assert_eq!(all.len(), 6);
    let row = |k: &str| -> &DeadJobRow { all.iter().find(|r| r.key == k).expect(k) };
    let flags: Vec<(&str, bool)> = ["u", "s", "deep", "shallow", "max", "fits"]
        .into_iter()
        .map(|k| (k, row(k).payload_unreadable))
        .collect();
    assert_eq!(
        flags,
        [
            ("u", true),
            ("s", false),
            ("deep", true),
            ("shallow", false),
            ("max", true),
            ("fits", false)
        ]
    );
    for key in ["u", "s", "deep", "shallow", "max", "fits"] {
        let stored = stored_bytes(&env, key).await;
        let listed = row(key).payload_bytes();
        match key {
            // Readable, not a scalar jsonb prints as serde_json does.
            "shallow" | "fits" => {
                assert_eq!(listed, row(key).payload.to_string().len(), "{key}")
            }
            _ => assert_eq!(listed, stored, "{key}: listed {listed}, stored {stored}"),
        }
    }
    // Of the first kind only, a page at a time: flags stay with their rows.
    let mut seen = Vec::new();
    for offset in 0..3 {
        let page = Page { limit: 1, offset };
        let rows = dead_jobs(&env.pool, Some("a"), page).await.unwrap();
        seen.extend(rows.iter().map(|r| (r.key.clone(), r.payload_unreadable)));
        assert!(rows.iter().all(|r| r.kind == "a"), "{rows:?}");
    }
    seen.sort();
    assert_eq!(seen, [("s".to_owned(), false), ("u".to_owned(), true)]);
}

/// `GET` of `path` on `addr`: the whole reply, as text.
fn get(addr: std::net::SocketAddr, path: &str) -> String {
    let mut stream = std::net::TcpStream::connect(addr).expect("connect");
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .expect("request");
    let mut reply = String::new();
    stream.read_to_string(&mut reply).expect("reply");
    reply
}

async fn admin(env: &Env, show_payloads: bool) -> std::net::SocketAddr {
    let config = idem::admin::AdminConfig::new().show_payloads(show_payloads);
    let app: axum::Router =
        axum::Router::new().nest("/admin", idem::admin::router(env.pool.clone(), config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<std::net::SocketAddr>(),
        )
        .await
    });
    addr
}

/// The admin page, payloads shown and hidden: the unreadable one is
/// marked, once; its stored text (markup in it) escaped; hidden, its size
/// is the stored text's; a string payload of the same text is not marked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack4_the_admin_page_marks_and_escapes_an_unreadable_payload() {
    let env = env().await;
    let unreadable = r#"{"n": 1e400, "s": "<script>alert(1)</script> & é"}"#;
    dead_by_hand(&env, "a", &[("u", unreadable)]).await;
    env.client
        .execute(
            "INSERT INTO idem_jobs (kind, key, payload, state, last_error, failed_at)
             SELECT 'a', 's', to_jsonb(payload::text), 'dead', 'no', now()
             FROM idem_jobs WHERE key = 'u'",
            &[],
        )
        .await
        .unwrap();
    let stored = stored_bytes(&env, "u").await;
    let string = stored_bytes(&env, "s").await;
    let shown = admin(&env, true).await;
    let page = tokio::task::spawn_blocking(move || get(shown, "/admin/jobs"))
        .await
        .unwrap();
    assert!(page.starts_with("HTTP/1.1 200"), "{page:.300}");
    assert_eq!(page.matches("unreadable as JSON").count(), 1, "{page}");
    assert!(!page.contains("<script>"), "{page}");
    assert!(page.contains("&lt;script&gt;"), "{page}");
    let hidden = admin(&env, false).await;
    let page = tokio::task::spawn_blocking(move || get(hidden, "/admin/jobs?kind=a"))
        .await
        .unwrap();
    assert_eq!(page.matches("unreadable as JSON").count(), 1, "{page}");
    assert!(!page.contains("script"), "{page}");
    assert!(page.contains(&format!("hidden ({stored} bytes)")), "{page}");
    assert!(page.contains(&format!("hidden ({string} bytes)")), "{page}");
    let page = tokio::task::spawn_blocking(move || get(hidden, "/admin/jobs?kind=b"))
        .await
        .unwrap();
    assert_eq!(page.matches("unreadable as JSON").count(), 0, "{page}");
}

/// Swapped in with a transaction of the handler's own left open on it
/// (`BEGIN`, a write), and `Ok`: idem neither commits that transaction
/// (the job's end is not written there either) nor leaves it open: its
/// write never commits. One that commits the lent connection by hand
/// (`COMMIT` through the connection it took away) before returning `Ok`
/// has its lent write committed once, and its job dead: not run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack4_a_swapped_in_open_transaction_is_not_committed() {
    let env = env().await;
    enqueue_new(&env, "open").await;
    enqueue_new(&env, "by-hand").await;
    let url = env.db.url().to_owned();
    let worker = Worker::new(env.pool.clone())
        .ladder(Ladder::new([Duration::ZERO; 3]))
        .handle(move |conn, job: &Compensate| {
            let url = url.clone();
            async move {
                record_effect(conn, &job.key, "lent").await?;
                let mut own = AsyncPgConnection::establish(&url).await.expect("connect");
                if job.key == "open" {
                    own.batch_execute("BEGIN").await?;
                    record_effect(&mut own, &job.key, "own").await?;
                    std::mem::swap(conn, &mut own);
                } else {
                    std::mem::swap(conn, &mut own);
                    own.batch_execute("COMMIT").await?;
                }
                Ok::<_, AppError>(())
            }
            .scope_boxed()
        });
    let round = worker.run_once().await.expect("round");
    assert_eq!((round.claimed, round.dead), (2, 2), "{round:?}");
    dead_for_swapping(&env, "open").await;
    let jobs = env.jobs("by-hand").await;
    assert_eq!(
        jobs.iter().map(|j| (j.0.as_str(), j.1)).collect::<Vec<_>>(),
        [("dead", 1)],
        "{jobs:?}"
    );
    no_open_transaction_left(&env).await;
    assert_eq!(env.effects("open").await, 0);
    assert_eq!(effects_by(&env, "by-hand", "lent").await, 1);
    env.make_due_now().await;
    assert_eq!(worker.run_once().await.expect("round").claimed, 0);
    assert_eq!(env.effects("by-hand").await, 1);
}
