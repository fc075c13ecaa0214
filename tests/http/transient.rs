//! A race lost, or a lock refused, by a handler under no retry loop: the
//! real server's errors (40001 at REPEATABLE READ, 40P01, 55P03 from a
//! `lock_timeout` of the handler's own) answer 409 or 503 with nothing
//! written, not 500.

use axum::routing::patch;

use super::*;

/// The route the tests of this module call.
pub(super) fn routes(app: Router<Pool>) -> Router<Pool> {
    app.route("/t/{t}/docs/{id}/{how}", patch(unretried))
}

/// One versioned write of a document in a transaction of its own, under no
/// retry loop, as a handler without `#[retryable]` writes:
/// - `rr`: at REPEATABLE READ, its snapshot taken (the read of the version)
///   before advisory lock 21, which the test holds, is granted;
/// - `locked`: with a `lock_timeout` of 100 ms of its own.
async fn unretried((State(p), Path((t, id, how))): Pool2<(i64, i64, String)>) -> Tagged {
    let mut conn = p.get().await.map_err(IdemError::from)?;
    let (begin, wait) = match how.as_str() {
        "rr" => (
            "BEGIN ISOLATION LEVEL REPEATABLE READ",
            "pg_advisory_xact_lock(21)",
        ),
        _ => ("BEGIN; SET LOCAL lock_timeout = '100ms'", "1"),
    };
    conn.batch_execute(begin).await?;
    let written = async {
        let version = load_doc(&mut conn, t, id).await?.version;
        diesel::sql_query(format!("SELECT {wait}"))
            .execute(&mut *conn)
            .await?;
        let body = format!("{how} at {version}");
        let update = Doc::update(id).tenant(t).expect_version(version);
        update.set(&SetBody { body }).execute(&mut conn).await
    }
    .await;
    let end = ["ROLLBACK", "COMMIT"][usize::from(written.is_ok())];
    conn.batch_execute(end).await?;
    let doc = written?;
    Ok(WithETag(doc.version, Json(doc)))
}

/// A writer at REPEATABLE READ whose snapshot predates a committed write of
/// its row gets 40001 from the server: 409 `retries-exhausted` with
/// `attempts: 1`, no `Retry-After`, and the winner's write is all there is.
#[tokio::test]
async fn a_race_lost_outside_a_retry_loop_is_409_and_writes_nothing() {
    let mut app = start().await;
    let mut gate = AsyncPgConnection::establish(app.3.url()).await.unwrap();
    gate.batch_execute("SELECT pg_advisory_lock(21)")
        .await
        .unwrap();
    let addr = app.0;
    let call = tokio::spawn(async move { send(addr, "PATCH", "/t/1/docs/1/rr", &[], "").await });
    until_positive(&mut app.1, WAITING).await;
    let winner = Doc::update(1).tenant(1).expect_version(0);
    let body = "winner".to_owned();
    winner
        .set(&SetBody { body })
        .execute(&mut app.1)
        .await
        .unwrap();
    gate.batch_execute("SELECT pg_advisory_unlock(21)")
        .await
        .unwrap();
    let reply = call.await.expect("a reply");
    let problem = reply.problem(RETRIES_EXHAUSTED);
    assert_eq!(problem["attempts"], 1, "{problem}");
    assert_eq!(reply.header("retry-after"), None);
    assert_eq!(app.doc(1, 1).await, ("winner".to_owned(), 1));
}

/// A row another transaction holds past the handler's own `lock_timeout`
/// (55P03): 503 `unavailable` with `Retry-After: 1`, the row unchanged; once
/// the lock is gone the same request writes.
#[tokio::test]
async fn a_lock_refused_outside_a_retry_loop_is_503_and_writes_nothing() {
    let mut app = start().await;
    app.1.batch_execute(HOLD_DOC).await.unwrap();
    let reply = send(app.0, "PATCH", "/t/1/docs/1/locked", &[], "").await;
    reply.problem(UNAVAILABLE);
    app.1.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(app.doc(1, 1).await, ("tenant one".to_owned(), 0));
    let again = send(app.0, "PATCH", "/t/1/docs/1/locked", &[], "").await;
    assert_eq!(again.is(200, false)["body"], "locked at 0");
    assert_eq!(app.doc(1, 1).await.1, 1);
}

/// Two transactions that update two documents in opposite orders: the
/// server picks one to fail with 40P01, which answers 409 like a lost race;
/// the other commits both its writes, and the victim's write is not there.
#[tokio::test]
async fn a_deadlock_victim_is_409() {
    let app = start().await;
    let url = app.3.url().to_owned();
    let (mut a, mut b) = (connect(&url).await, connect(&url).await);
    let body = |s: &str| SetBody { body: s.to_owned() };
    a.batch_execute("BEGIN").await.unwrap();
    b.batch_execute("BEGIN").await.unwrap();
    let first_a = Doc::update(1).tenant(1).expect_version(0);
    first_a.set(&body("a")).execute(&mut a).await.unwrap();
    let first_b = Doc::update(7).tenant(2).expect_version(3);
    first_b.set(&body("b")).execute(&mut b).await.unwrap();
    let crossing = tokio::spawn(async move {
        let second = Doc::update(7).tenant(2).expect_version(3);
        let got = second.set(&body("a")).execute(&mut a).await;
        (got, a)
    });
    let mut watch = connect(&url).await;
    until_positive(&mut watch, WAITING).await;
    let second_b = Doc::update(1).tenant(1).expect_version(0);
    let got_b = second_b.set(&body("b")).execute(&mut b).await;
    let (got_a, a) = crossing.await.unwrap();
    let (victim, mut winner, won) = match (got_a, got_b) {
        (Err(e), Ok(_)) => (e, b, "b"),
        (Ok(_), Err(e)) => (e, a, "a"),
        other => panic!("one deadlock victim, not {other:?}"),
    };
    let problem = Problem::from(&victim);
    let status = (problem.status().as_u16(), problem.type_uri());
    assert_eq!(status, (409, RETRIES_EXHAUSTED), "{victim}");
    assert!(!problem.detail().contains("deadlock"), "{problem}");
    winner.batch_execute("COMMIT").await.unwrap();
    let docs =
        "SELECT count(*) AS n FROM docs WHERE body = $1 AND version = 1 + 3 * (tenant_id - 1)";
    let query = diesel::sql_query(docs).bind::<Text, _>(won);
    let n = query.get_result::<N>(&mut watch).await.unwrap().n;
    assert_eq!(n, 2, "both documents hold the winner's write, once");
}
