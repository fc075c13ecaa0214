//! Session 55's attack on the new rows of `idem::http`'s status table: a
//! database error of `Error`, `VersionedError` or `CreateOnceError` that a
//! retry loop would have replayed, reaching a handler unreplayed (40001,
//! 40P01 → 409 `retries-exhausted`, `attempts: 1`; 55P03 → 503 with
//! `Retry-After: 1`; anything else → 500). Every error is the real server's,
//! every effect is counted in the database, and every problem is rendered
//! as the response a client gets and checked by `Reply::problem`.

use std::sync::Arc;

use axum::body::to_bytes;
use idem::Creation;
use tokio::sync::{Barrier, Notify};

use super::*;

diesel::table! { orders (tenant_id, id) { tenant_id -> Int8, id -> Int8, request_id -> Text, amount -> Int8, version -> Int8 } }

const ORDERS: &str = "
CREATE TABLE orders (tenant_id bigint NOT NULL, id bigint NOT NULL, request_id text NOT NULL,
    amount bigint NOT NULL, version bigint NOT NULL DEFAULT 0, PRIMARY KEY (tenant_id, id),
    CONSTRAINT orders_secret_uk UNIQUE (tenant_id, request_id));
CREATE SEQUENCE attempts_seq;";

#[derive(Debug, Clone, Queryable, Selectable, Versioned)]
#[diesel(table_name = orders)]
#[versioned(tenant = tenant_id, key = id, create_once(key = request_id, fingerprint(amount)))]
struct Order {
    tenant_id: i64,
    id: i64,
    request_id: String,
    amount: i64,
    version: i64,
}

/// The response a handler returning `problem` sends, as `send` reads one.
async fn answer(problem: Problem) -> Reply {
    let response = problem.into_response();
    let status = response.status().as_u16();
    let mut head = format!("HTTP/1.1 {status} X\r\n");
    for (name, value) in response.headers() {
        head += &format!("{name}: {}\r\n", value.to_str().unwrap());
    }
    let body = to_bytes(response.into_body(), 1 << 20).await.unwrap();
    let reply = Reply {
        status,
        head,
        body: body.to_vec(),
    };
    let lower = reply.text().to_lowercase();
    for word in [
        "relation", "docs", "orders", "deadlock", "serializ", "timeout",
    ] {
        assert!(!lower.contains(word), "{word} in {}", reply.text());
    }
    reply
}

/// The problem of `kind` a handler answers `problem` with; its body.
async fn expect(problem: Problem, kind: &str) -> Value {
    let reply = answer(problem).await;
    if kind == RETRIES_EXHAUSTED {
        assert_eq!(reply.header("retry-after"), None, "{reply:?}");
    }
    reply.problem(kind)
}

async fn started() -> App {
    let mut app = start().await;
    app.1.batch_execute(ORDERS).await.expect("orders");
    app
}

fn set(body: &str) -> SetBody {
    SetBody {
        body: body.to_owned(),
    }
}

/// Write skew at SERIALIZABLE: each transaction reads the document the
/// other writes; neither statement fails, the second COMMIT does (40001),
/// once on raw `COMMIT`, once through diesel-async's transaction manager.
/// Both through `Error::from` and `VersionedError::from`: 409 with
/// `attempts: 1`, no Retry-After, and nothing of the loser is in the table.
#[tokio::test]
async fn write_skew_refused_at_commit_is_409_and_the_loser_wrote_nothing() {
    let mut app = started().await;
    let url = app.3.url().to_owned();
    // Raw COMMIT.
    let (mut a, mut b) = (connect(&url).await, connect(&url).await);
    for c in [&mut a, &mut b] {
        c.batch_execute("BEGIN ISOLATION LEVEL SERIALIZABLE")
            .await
            .unwrap();
    }
    load_doc(&mut a, 1, 1).await.unwrap();
    load_doc(&mut b, 2, 7).await.unwrap();
    let wa = Doc::update(7).tenant(2).expect_version(3);
    wa.set(&set("a")).execute(&mut a).await.expect("a writes");
    let wb = Doc::update(1).tenant(1).expect_version(0);
    wb.set(&set("b")).execute(&mut b).await.expect("b writes");
    a.batch_execute("COMMIT").await.expect("a commits");
    let lost = b
        .batch_execute("COMMIT")
        .await
        .expect_err("b's COMMIT fails");
    let p = expect(Problem::from(IdemError::from(lost)), RETRIES_EXHAUSTED).await;
    assert_eq!(p["attempts"], 1);
    assert_eq!(app.doc(1, 1).await, ("tenant one".to_owned(), 0));
    assert_eq!(app.doc(2, 7).await, ("a".to_owned(), 4));

    // diesel-async's transaction manager commits b.
    let (mut a, mut b) = (connect(&url).await, connect(&url).await);
    let (b_wrote, a_done) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let (bw, ad) = (b_wrote.clone(), a_done.clone());
    let loser = tokio::spawn(async move {
        let mut builder = b.build_transaction().serializable();
        builder
            .run::<_, VersionedError, _>(async move |c: &mut AsyncPgConnection| {
                load_doc(&mut *c, 2, 7).await?;
                let w = Doc::update(1).tenant(1).expect_version(0);
                w.set(&set("b2")).execute(&mut *c).await?;
                bw.notify_one();
                ad.notified().await;
                Ok(())
            })
            .await
    });
    a.batch_execute("BEGIN ISOLATION LEVEL SERIALIZABLE")
        .await
        .unwrap();
    load_doc(&mut a, 1, 1).await.unwrap();
    b_wrote.notified().await;
    let wa = Doc::update(7).tenant(2).expect_version(4);
    wa.set(&set("a2")).execute(&mut a).await.expect("a writes");
    a.batch_execute("COMMIT").await.expect("a commits");
    a_done.notify_one();
    let lost = loser.await.unwrap().expect_err("b's commit fails");
    assert!(
        matches!(
            &lost,
            VersionedError::Database(DieselError::DatabaseError(
                DatabaseErrorKind::SerializationFailure,
                _
            ))
        ),
        "{lost:?}"
    );
    let p = expect(Problem::from(lost), RETRIES_EXHAUSTED).await;
    assert_eq!(p["attempts"], 1);
    assert_eq!(app.doc(1, 1).await, ("tenant one".to_owned(), 0));
    assert_eq!(app.doc(2, 7).await, ("a2".to_owned(), 5));
}

/// Racers creating the same key with `create_once` at REPEATABLE READ and
/// SERIALIZABLE, outside any retry loop, each snapshot taken before any
/// commit: one row per key; each racer is `Created`, `Existing`, or a 409
/// `retries-exhausted` (`attempts: 1`) — never a 500 or a second row.
#[tokio::test]
async fn create_once_racers_outside_a_loop_are_created_existing_or_409() {
    let mut app = started().await;
    let url = app.3.url().to_owned();
    for (round, level) in ["REPEATABLE READ", "SERIALIZABLE"].into_iter().enumerate() {
        let racers = 5;
        let barrier = Arc::new(Barrier::new(racers));
        let mut tasks = Vec::new();
        for i in 0..racers {
            let (url, barrier) = (url.clone(), barrier.clone());
            tasks.push(tokio::spawn(async move {
                let mut c = connect(&url).await;
                let begin = format!("BEGIN ISOLATION LEVEL {level}; SELECT 1");
                c.batch_execute(&begin).await.unwrap();
                barrier.wait().await;
                let new = Order {
                    tenant_id: 1,
                    id: 100 * round as i64 + i as i64,
                    request_id: format!("key-{round}"),
                    amount: 5,
                    version: 0,
                };
                let got = new.create_once(&mut c).await;
                let end = ["ROLLBACK", "COMMIT"][usize::from(got.is_ok())];
                c.batch_execute(end).await.unwrap();
                got
            }));
        }
        let (mut created, mut existing, mut lost) = (0, 0, 0);
        for t in tasks {
            match t.await.unwrap() {
                Ok(Creation::Created(_)) => created += 1,
                Ok(Creation::Existing(_)) => existing += 1,
                Err(e) => {
                    let p = expect(Problem::from(&e), RETRIES_EXHAUSTED).await;
                    assert_eq!(p["attempts"], 1, "{e}");
                    lost += 1;
                }
            }
        }
        assert_eq!(created, 1, "{level}: {existing} existing, {lost} lost");
        let sql = format!("SELECT count(*) AS n FROM orders WHERE request_id = 'key-{round}'");
        assert_eq!(app.count(&sql).await, 1, "{level}");
    }
}

/// A body whose statement raises `code` (the real server's error, read off
/// the wire by the loop) after counting the attempt in a sequence (which no
/// rollback undoes) and inserting a payment.
#[retryable(max = 2, deadline_ms = 5000)]
async fn raises(conn: &mut AsyncPgConnection, code: String) -> Result<(), AppError> {
    diesel::sql_query("SELECT nextval('attempts_seq') AS n")
        .get_result::<N>(conn)
        .await?;
    let pay = "INSERT INTO pays (tenant_id, idem_key, amount) VALUES (9, 'r', 1)";
    diesel::sql_query(pay).execute(conn).await?;
    let raise = format!("DO $$ BEGIN RAISE EXCEPTION 'raised' USING ERRCODE = '{code}'; END $$");
    diesel::sql_query(raise).execute(conn).await?;
    Ok(())
}

/// The same with `NOWAIT` on a row the test holds, replayed on opt-in.
#[retryable(max = 2, deadline_ms = 5000, retry_lock_not_available = true)]
async fn nowait(conn: &mut AsyncPgConnection) -> Result<(), AppError> {
    diesel::sql_query("SELECT nextval('attempts_seq') AS n")
        .get_result::<N>(conn)
        .await?;
    let pay = "INSERT INTO pays (tenant_id, idem_key, amount) VALUES (9, 'n', 1)";
    diesel::sql_query(pay).execute(conn).await?;
    let lock = "SELECT 1 FROM docs WHERE tenant_id = 1 AND id = 1 FOR UPDATE NOWAIT";
    diesel::sql_query(lock).execute(conn).await?;
    Ok(())
}

async fn attempts(app: &mut App) -> i64 {
    let sql = "SELECT last_value - 1 + (CASE WHEN is_called THEN 1 ELSE 0 END) AS n \
               FROM attempts_seq";
    app.count(sql).await
}

/// Under `#[retryable(max = 2)]` a 40001 or 40P01 on every attempt is still
/// the loop's `Exhausted` (409, `attempts: 2`), both attempts ran, and no
/// payment of either committed.
#[tokio::test]
async fn under_a_loop_a_race_lost_twice_is_exhausted_with_attempts_2() {
    let mut app = started().await;
    let mut before = 0;
    for code in ["40001", "40P01"] {
        let err = raises(&app.2, code.to_owned()).await.expect_err(code);
        let AppError::Idem(e @ IdemError::Exhausted { attempts: 2, .. }) = err else {
            panic!("{code}: {err:?}");
        };
        let p = expect(Problem::from(e), RETRIES_EXHAUSTED).await;
        assert_eq!(p["attempts"], 2, "{code}");
        assert_eq!(attempts(&mut app).await, before + 2, "{code}");
        before += 2;
    }
    assert_eq!(app.pays().await, 0);
}

/// A row held past every attempt's `NOWAIT`, replayed on opt-in: the loop
/// gives up after 2 attempts, and rows that stayed locked are 503
/// `unavailable` with `Retry-After: 1`, as the same `NOWAIT` refused without
/// a loop is. (Found here: it was 409 "lost the race for the same data 2
/// time(s)", no Retry-After.)
#[tokio::test]
async fn a_nowait_refused_on_every_attempt_is_503_as_without_a_loop() {
    let mut app = started().await;
    let url = app.3.url().to_owned();
    let mut holder = connect(&url).await;
    holder.batch_execute(HOLD_DOC).await.unwrap();
    let err = nowait(&app.2).await.expect_err("refused");
    holder.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(attempts(&mut app).await, 2, "{err:?}");
    assert_eq!(app.pays().await, 0);
    let AppError::Idem(e) = err else {
        panic!("{err:?}")
    };
    let reply = answer(Problem::from(e)).await;
    reply.problem(UNAVAILABLE);
}

/// A versioned UPDATE in autocommit, waiting on a row the test holds, whose
/// backend is terminated: 500 `internal`, never a 409/503 claiming nothing
/// was committed; here nothing did. Then an UPDATE that committed before
/// its backend was terminated mid-statement (autocommit, then a long
/// sleep): 500 too, and the write is there.
#[tokio::test]
async fn a_backend_terminated_mid_statement_is_500() {
    let mut app = started().await;
    let url = app.3.url().to_owned();
    let mut holder = connect(&url).await;
    holder.batch_execute(HOLD_DOC).await.unwrap();
    let mut conn = app.2.get().await.unwrap();
    let pid = backend_pid(&mut conn).await;
    let call = tokio::spawn(async move {
        let u = Doc::update(1).tenant(1).expect_version(0);
        u.set(&set("killed")).execute(&mut conn).await
    });
    until_positive(&mut app.1, WAITING).await;
    let kill = format!("SELECT pg_terminate_backend({pid})::int::int8 AS n");
    app.count(&kill).await;
    let err = call.await.unwrap().expect_err("terminated");
    holder.batch_execute("ROLLBACK").await.unwrap();
    expect(Problem::from(&err), INTERNAL).await;
    assert_eq!(app.doc(1, 1).await, ("tenant one".to_owned(), 0));

    let mut conn = app.2.get().await.unwrap();
    let pid = backend_pid(&mut conn).await;
    let call = tokio::spawn(async move {
        let u = Doc::update(1).tenant(1).expect_version(0);
        u.set(&set("committed")).execute(&mut conn).await?;
        diesel::sql_query("SELECT pg_sleep(10)")
            .execute(&mut conn)
            .await
            .map_err(IdemError::from)?;
        Ok::<_, AppError>(())
    });
    let sleeping = format!(
        "SELECT count(*) AS n FROM pg_stat_activity WHERE pid = {pid} AND query = 'SELECT pg_sleep(10)'"
    );
    until_positive(&mut app.1, &sleeping).await;
    app.count(&format!(
        "SELECT pg_terminate_backend({pid})::int::int8 AS n"
    ))
    .await;
    let err = call.await.unwrap().expect_err("terminated");
    expect(err.into_response_problem(), INTERNAL).await;
    assert_eq!(app.doc(1, 1).await, ("committed".to_owned(), 1));
}

impl AppError {
    /// The problem `AppError`'s `IntoResponse` answers with, for the
    /// variants of idem's errors.
    fn into_response_problem(self) -> Problem {
        match self {
            AppError::Idem(e) => Problem::from(e),
            AppError::Versioned(e) => Problem::from(e),
            AppError::Db(e) => Problem::from(IdemError::from(e)),
            AppError::Declined(..) => panic!("declined"),
        }
    }
}

/// Rows held by another transaction: a versioned UPDATE past a session
/// `lock_timeout` of the handler's own (autocommit), `FOR UPDATE NOWAIT`
/// and `LOCK TABLE .. NOWAIT`, each through `VersionedError` and `Error`:
/// 503 `unavailable`, `Retry-After: 1`, the row unchanged.
#[tokio::test]
async fn a_lock_refused_by_timeout_or_nowait_is_503() {
    let mut app = started().await;
    let url = app.3.url().to_owned();
    let mut holder = connect(&url).await;
    holder.batch_execute(HOLD_DOC).await.unwrap();
    let mut c = connect(&url).await;
    c.batch_execute("SET lock_timeout = '100ms'").await.unwrap();
    let u = Doc::update(1).tenant(1).expect_version(0);
    let err = u.set(&set("x")).execute(&mut c).await.expect_err("locked");
    expect(Problem::from(&err), UNAVAILABLE).await;
    c.batch_execute("SET lock_timeout = 0").await.unwrap();
    let nowaits = [
        "SELECT 1 FROM docs WHERE tenant_id = 1 AND id = 1 FOR UPDATE NOWAIT",
        "BEGIN; LOCK TABLE docs IN ACCESS EXCLUSIVE MODE NOWAIT",
    ];
    for sql in nowaits {
        let e = c.batch_execute(sql).await.expect_err(sql);
        c.batch_execute("ROLLBACK").await.unwrap();
        let again = c.batch_execute(sql).await.expect_err(sql);
        c.batch_execute("ROLLBACK").await.unwrap();
        expect(Problem::from(IdemError::from(e)), UNAVAILABLE).await;
        expect(Problem::from(VersionedError::from(again)), UNAVAILABLE).await;
    }
    holder.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(app.doc(1, 1).await, ("tenant one".to_owned(), 0));
}

/// A `statement_timeout` of the handler's own (57014), and a cancel from
/// another session: "anything else", 500, never 409 or 503.
#[tokio::test]
async fn a_statement_timeout_or_cancel_of_the_handlers_own_is_500() {
    let mut app = started().await;
    let url = app.3.url().to_owned();
    let mut holder = connect(&url).await;
    holder.batch_execute(HOLD_DOC).await.unwrap();
    let mut c = connect(&url).await;
    c.batch_execute("SET statement_timeout = '100ms'")
        .await
        .unwrap();
    let u = Doc::update(1).tenant(1).expect_version(0);
    let err = u
        .set(&set("x"))
        .execute(&mut c)
        .await
        .expect_err("timed out");
    expect(Problem::from(&err), INTERNAL).await;
    let slept = diesel::sql_query("SELECT pg_sleep(1)")
        .execute(&mut c)
        .await;
    expect(Problem::from(IdemError::from(slept.unwrap_err())), INTERNAL).await;
    c.batch_execute("SET statement_timeout = 0").await.unwrap();
    let pid = backend_pid(&mut c).await;
    let call = tokio::spawn(async move {
        let u = Doc::update(1).tenant(1).expect_version(0);
        u.set(&set("y")).execute(&mut c).await
    });
    until_positive(&mut app.1, WAITING).await;
    app.count(&format!("SELECT pg_cancel_backend({pid})::int::int8 AS n"))
        .await;
    let err = call.await.unwrap().expect_err("cancelled");
    expect(Problem::from(&err), INTERNAL).await;
    holder.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(app.doc(1, 1).await, ("tenant one".to_owned(), 0));
}

/// A handler with no transaction (autocommit, the usual shape without
/// `#[retryable]`): a payment INSERT commits, then its next statement is a
/// deadlock victim (40P01). The answer must not say that nothing of the
/// request committed, nor that it is safe to send again: the payment is
/// committed. (Found here: the 409 said both.)
#[tokio::test]
async fn a_deadlock_after_an_autocommitted_write_claims_nothing_of_it() {
    let mut app = started().await;
    let url = app.3.url().to_owned();
    let mut other = connect(&url).await;
    other
        .batch_execute("SET deadlock_timeout = '5s'; BEGIN; SELECT pg_advisory_xact_lock(32)")
        .await
        .unwrap();
    let p = app.2.clone();
    let call = tokio::spawn(async move {
        let mut conn = p.get().await.map_err(IdemError::from)?;
        let pay = "INSERT INTO pays (tenant_id, idem_key, amount) VALUES (1, 'once', 10)";
        diesel::sql_query(pay).execute(&mut conn).await?;
        let locks = "SELECT pg_advisory_xact_lock(31), pg_advisory_xact_lock(32)";
        diesel::sql_query(locks).execute(&mut conn).await?;
        Ok::<_, AppError>(())
    });
    until_positive(&mut app.1, WAITING).await;
    let crossing = other
        .batch_execute("SELECT pg_advisory_xact_lock(31)")
        .await;
    other.batch_execute("ROLLBACK").await.unwrap();
    crossing.expect("the handler is the victim");
    let err = call.await.unwrap().expect_err("deadlock victim");
    let reply = answer(err.into_response_problem()).await;
    let committed = app.pays().await;
    assert_eq!(committed, 1, "the payment before the deadlock committed");
    reply.problem(RETRIES_EXHAUSTED);
    let text = reply.text();
    let claims_nothing = text.contains("nothing") || text.contains("safe to send");
    assert!(
        !claims_nothing,
        "{committed} payment committed, answered {} {}",
        reply.status,
        reply.text()
    );
}

/// A limit, documented (`status.rs`'s `unreplayed`, as `Transient` reads
/// errors): diesel gives 40P01 and 55P03 no kind, so they are told by the
/// server's message. A PL/pgSQL error (P0001, which the retry loop never
/// replays: it reads SQLSTATE) whose message is "deadlock detected", what a
/// function that re-raises `SQLERRM` sends, is answered as a lost race
/// (409); a 40P01 raised with a message of its own, which the loop replays,
/// is 500.
#[tokio::test]
async fn limit_unreplayed_errors_are_told_by_their_message() {
    let mut app = started().await;
    let reraised = raises(&app.2, "P0001".to_owned()).await;
    assert_eq!(
        attempts(&mut app).await,
        1,
        "the loop does not replay P0001"
    );
    drop(reraised);
    let mut c = app.2.get().await.unwrap();
    let sql = "DO $$ BEGIN RAISE EXCEPTION 'deadlock detected'; END $$";
    let p0001 = c.batch_execute(sql).await.expect_err("raised");
    let sql = "DO $$ BEGIN RAISE EXCEPTION 'transfer deadlocked' USING ERRCODE = '40P01'; END $$";
    let real = c.batch_execute(sql).await.expect_err("raised");
    let spoof = Problem::from(IdemError::from(p0001));
    let genuine = Problem::from(IdemError::from(real));
    let got = (spoof.status().as_u16(), genuine.status().as_u16());
    assert_eq!(
        got,
        (409, 500),
        "P0001 'deadlock detected', 40P01 worded otherwise"
    );
}

/// The same as a lock refused: a handler in autocommit inserts a payment
/// (committed), then its own `lock_timeout` expires on a row held
/// elsewhere: 503, and the text does not say that nothing committed.
/// (Found here: it said "nothing of it was committed, retry later".)
#[tokio::test]
async fn a_lock_timeout_after_an_autocommitted_write_claims_nothing_of_it() {
    let mut app = started().await;
    let url = app.3.url().to_owned();
    let mut holder = connect(&url).await;
    holder.batch_execute(HOLD_DOC).await.unwrap();
    let mut conn = connect(&url).await;
    conn.batch_execute("SET lock_timeout = '100ms'")
        .await
        .unwrap();
    let pay = "INSERT INTO pays (tenant_id, idem_key, amount) VALUES (1, 'once', 10)";
    diesel::sql_query(pay).execute(&mut conn).await.unwrap();
    let u = Doc::update(1).tenant(1).expect_version(0);
    let err = u
        .set(&set("x"))
        .execute(&mut conn)
        .await
        .expect_err("locked");
    holder.batch_execute("ROLLBACK").await.unwrap();
    let reply = answer(Problem::from(&err)).await;
    let committed = app.pays().await;
    assert_eq!(
        committed, 1,
        "the payment before the lock timeout committed"
    );
    reply.problem(UNAVAILABLE);
    let claims_nothing = reply.text().contains("nothing");
    assert!(
        !claims_nothing,
        "{committed} payment committed, answered {} {}",
        reply.status,
        reply.text()
    );
}
