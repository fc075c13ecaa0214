//! `If-Match` and `ETag`: the round trip, stale and refused tags, lists,
//! another tenant's row, the optional extractors, the status table, and a
//! client that hangs up mid-request.

use super::*;

/// The ETag of a read, sent back, writes once; sent again it is stale (412,
/// with the current tag); `*` writes whatever the version; eight writers
/// racing with one tag: one wins, seven get 412.
#[tokio::test]
async fn etag_round_trip_stale_star_and_race() {
    let mut app = start().await;
    let read = send(app.0, "GET", "/t/1/docs/1", &[], "").await;
    assert_eq!(read.header("etag").as_deref(), Some("\"v0\""));
    let if_match = format!("if-match: {}", read.header("etag").unwrap());
    let written = app.patch(1, &[if_match.as_bytes()]).await;
    assert_eq!(written.header("etag").as_deref(), Some("\"v1\""));
    let stale = app.patch(1, &[if_match.as_bytes()]).await;
    assert_eq!(stale.problem(PRECONDITION_FAILED)["current_etag"], "\"v1\"");
    assert_eq!(app.doc(1, 1).await, ("written".to_owned(), 1));
    let any = app.patch(1, &[b"If-Match: *"]).await;
    assert_eq!(any.header("etag").as_deref(), Some("\"v2\""));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (addr, h): (_, &[u8]) = (app.0, b"if-match: \"v2\"");
        let body = r#"{"body": "raced"}"#;
        let call = async move { send(addr, "PATCH", "/t/1/docs/1", &[h], body).await };
        tasks.push(tokio::spawn(call));
    }
    let mut won = 0;
    for task in tasks {
        let reply = task.await.expect("a reply");
        match reply.status {
            200 => won += 1,
            _ => _ = reply.problem(PRECONDITION_FAILED),
        }
    }
    assert_eq!((won, app.doc(1, 1).await.1), (1, 3));
}

/// Each `If-Match` that must be refused gets its documented status and type,
/// also before a body that is not JSON, and the row stays at version 0; a
/// row at `i64::MAX` cannot be bumped: 500 internal, unchanged.
#[tokio::test]
async fn refused_if_match_writes_nothing() {
    let mut app = start().await;
    app.patch(1, &[]).await.problem(PRECONDITION_REQUIRED);
    let path = "/t/1/docs/1";
    let not_json = send(app.0, "PATCH", path, &[], "{not json").await;
    not_json.problem(PRECONDITION_REQUIRED);
    let never = r#"W/"v0"|"v00"|"v+0"|"V0"|"v-1"|"v9223372036854775808"|"0"|""|W/"v0", "x""#;
    let never = never.split('|').chain(["\"v99999999999999999999999999\""]);
    let malformed = r#"v0|"v0|"v0" junk|'v0'|w/"v0"|"v0", "v1"|*, "v0"|**|| , ,|"v0"x"#;
    // (value, type, refused by the extractor, before the body is read)
    let mut cases: Vec<(Vec<u8>, &str, bool)> = Vec::new();
    cases.extend(never.map(|v| (v.into(), PRECONDITION_FAILED, true)));
    let malformed = malformed
        .split('|')
        .map(|v| (v.into(), IF_MATCH_INVALID, true));
    cases.extend(malformed);
    cases.push((b"\xff\"v0\"".to_vec(), IF_MATCH_INVALID, true));
    cases.push((b"\"v\xff\"".to_vec(), IF_MATCH_INVALID, true));
    // Ours but stale: refused by the write.
    for v in ["\"v1\"", "\"v9223372036854775807\""] {
        cases.push((v.into(), PRECONDITION_FAILED, false));
    }
    for (value, kind, early) in cases {
        let header = [&b"if-match: "[..], &value].concat();
        let reply = app.patch(1, &[&header]).await;
        let shown = String::from_utf8_lossy(&value);
        let status = documented_status(kind);
        assert_eq!(reply.status, status, "{shown}: {reply:?}");
        reply.problem(kind);
        let reply = send(app.0, "PATCH", path, &[&header], "{not json").await;
        if early {
            reply.problem(kind);
        } else {
            assert_eq!(reply.status, 400, "{shown}: axum's JSON rejection first");
        }
    }
    // Header lines are one list: two versions are ambiguous, `*` alone.
    for two in [
        [&b"if-match: \"v0\""[..], b"if-match: \"v1\""],
        [b"if-match: *", b"if-match: \"v0\""],
    ] {
        app.patch(1, &two).await.problem(IF_MATCH_INVALID);
    }
    assert_eq!(app.doc(1, 1).await, ("tenant one".to_owned(), 0));
    // A row at the last version: its own tag is an overflow, a 500 that
    // says nothing, and the row is unchanged.
    let max = "INSERT INTO docs VALUES (1, 9, 'max', 9223372036854775807)";
    app.count(&format!(
        "WITH x AS ({max} RETURNING 1::bigint AS n) SELECT n FROM x"
    ))
    .await;
    for tag in ["\"v9223372036854775807\"", "*"] {
        let h = format!("if-match: {tag}");
        app.patch(9, &[h.as_bytes()]).await.problem(INTERNAL);
    }
    assert_eq!(app.doc(1, 9).await, ("max".to_owned(), i64::MAX));
}

/// Lists that name the current version (beside tags that can never match,
/// empty elements, several lines, 5000 foreign tags) each write once.
#[tokio::test]
async fn if_match_lists_that_match() {
    let mut app = start().await;
    let long = format!("if-match: {}\"v4\"", "\"x\", ".repeat(5000));
    let lists: &[&[&[u8]]] = &[
        &[b"if-match: W/\"v0\", \"v0\""],
        &[b"if-match: \"other\" , \"v1\",, \"v1\","],
        &[b"if-match: \"x\"", b"If-Match: \"v2\""],
        &[b"IF-MATCH: \"v3\""],
        &[long.as_bytes()],
        &[b"if-match:\t\"v5\"\t,\t\"x\"\t"],
        &[b"if-match: ", b"if-match: \"v6\""],
    ];
    for (n, headers) in lists.iter().enumerate() {
        let reply = app.patch(1, headers).await;
        assert_eq!(reply.status, 200, "{n}: {reply:?}");
        assert_eq!(app.doc(1, 1).await.1, n as i64 + 1);
    }
}

/// Another tenant's row is not there: 404 whatever the tag (its version,
/// `*`, another), with nothing of it in the answer, and it is unchanged.
#[tokio::test]
async fn another_tenants_row_leaks_nothing() {
    let mut app = start().await;
    for tag in ["\"v3\"", "*", "\"v0\""] {
        let h = format!("if-match: {tag}");
        let reply = app.patch(7, &[h.as_bytes()]).await;
        let body = reply.problem(NOT_FOUND);
        assert!(!reply.text().contains("v3") && body.get("current_etag").is_none());
        assert_eq!(reply.header("etag"), None);
    }
    let read = send(app.0, "GET", "/t/1/docs/7", &[], "").await;
    read.problem(NOT_FOUND);
    assert_eq!(read.header("etag"), None);
    let secret = ("SECRET-OF-TENANT-TWO".to_owned(), 3);
    assert_eq!(app.doc(2, 7).await, secret);
    // Tenant 2's tag on tenant 1's row: stale, naming tenant 1's own version.
    let reply = app.patch(1, &[b"if-match: \"v3\""]).await;
    assert_eq!(reply.problem(PRECONDITION_FAILED)["current_etag"], "\"v0\"");
}

/// `Option<IfMatch>` and `Option<IdempotencyKey>`: missing is `None`; a
/// malformed, never-matching or doubled one is still refused.
#[tokio::test]
async fn optional_extractors() {
    let app = start().await;
    let cases: [(H, &str); 4] = [
        (&[], "None None"),
        (&[b"if-match: *"], "Some(None) None"),
        (&[b"if-match: \"v4\""], "Some(Some(4)) None"),
        (&[b"idempotency-key: \"k\""], "None Some(\"k\")"),
    ];
    for (headers, text) in cases {
        let reply = app.go("/optional", headers, "").await;
        assert_eq!((reply.status, reply.text().as_str()), (200, text));
    }
    let refused: [(H, &str); 5] = [
        (&[b"if-match: v4"], IF_MATCH_INVALID),
        (&[b"if-match: W/\"v4\""], PRECONDITION_FAILED),
        (&[b"idempotency-key: a b"], IDEMPOTENCY_KEY_INVALID),
        (&[b"idempotency-key: \"\""], IDEMPOTENCY_KEY_INVALID),
        (
            &[b"idempotency-key: a", b"idempotency-key: a"],
            IDEMPOTENCY_KEY_INVALID,
        ),
    ];
    for (headers, kind) in refused {
        app.go("/optional", headers, "").await.problem(kind);
    }
}

/// The rows of the status table (src/http.rs:25-46) this app cannot reach
/// over HTTP, through `Problem` as a handler answers them: the status of the
/// `type`, `HttpStatus` agreeing, `Retry-After` only where the table has it,
/// and no database message in a 500.
#[tokio::test]
async fn the_status_table_as_documented() {
    let info = Box::new("SECRET relation pays".to_owned());
    let db = || DieselError::DatabaseError(DatabaseErrorKind::Unknown, info.clone());
    let s = |s: &str| s.to_owned();
    let mismatch = VersionedError::StateMismatch {
        expected: s("a"),
        actual: s("b"),
    };
    let illegal = VersionedError::IllegalTransition {
        from: s("a"),
        to: s("b"),
    };
    let fields = CreateOnceError::Mismatch {
        fields: vec!["amount"],
    };
    let rows: [(Problem, u16, &str); 9] = [
        (IdemError::InProgress.into(), 409, IN_PROGRESS),
        (IdemError::ClaimLost.into(), 409, IN_PROGRESS),
        (IdemError::Database(db()).into(), 500, INTERNAL),
        (VersionedError::Database(db()).into(), 500, INTERNAL),
        (
            Problem::from(&mismatch),
            mismatch.http_status(),
            STATE_CONFLICT,
        ),
        (
            Problem::from(&illegal),
            illegal.http_status(),
            STATE_CONFLICT,
        ),
        (
            Problem::from(&fields),
            fields.http_status(),
            FINGERPRINT_MISMATCH,
        ),
        (CreateOnceError::Conflict.into(), 409, UNIQUE_CONFLICT),
        (
            CreateOnceError::MissingKey.into(),
            400,
            IDEMPOTENCY_KEY_MISSING,
        ),
    ];
    for (n, (problem, table, kind)) in rows.into_iter().enumerate() {
        assert_eq!((problem.type_uri(), table), (kind, documented_status(kind)));
        let response = problem.into_response();
        let status = response.status().as_u16();
        let head = response
            .headers()
            .iter()
            .map(|(k, v)| format!("{k}: {v:?}\r\n"));
        let head = format!("HTTP/1.1 {status}\r\n{}", head.collect::<String>());
        let body = axum::body::to_bytes(response.into_body(), 4096).await;
        let reply = Reply {
            status,
            head: head.replace('"', ""),
            body: body.unwrap().to_vec(),
        };
        reply.problem(kind);
        let retry = reply.header("retry-after");
        assert_eq!(retry.as_deref(), [None, Some("1")][usize::from(n == 0)]);
    }
}

/// A client that hangs up while its request runs: the effect stays single.
/// Local mode: a retry runs it once (or replays it). External mode: the
/// key is held in progress (409, `Retry-After`) with no row, or the first
/// finished and is replayed; never a second row.
#[tokio::test]
async fn a_client_that_hangs_up_gets_no_double_effect() {
    let mut app = start().await;
    let body = r#"{"amount": 3, "merchant": "m", "sleep_ms": 1000}"#;
    for (t, path) in [(1, "/pay/1"), (2, "/ext/2")] {
        let head = format!("POST {path} HTTP/1.1\r\nhost: x\r\nidempotency-key: gone\r\n");
        let n = body.len();
        let req =
            format!("{head}content-type: application/json\r\ncontent-length: {n}\r\n\r\n{body}");
        let mut stream = tokio::net::TcpStream::connect(app.0).await.unwrap();
        stream.write_all(req.as_bytes()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        drop(stream);
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let retry = app.go(path, &[b"idempotency-key: gone"], body).await;
        let sql = format!("SELECT count(*) AS n FROM pays WHERE tenant_id = {t}");
        if t == 2 && retry.status == 409 {
            retry.problem(IN_PROGRESS);
            assert_eq!(app.count(&sql).await, 0);
        } else {
            let first = retry.is(201, retry.replayed());
            let again = app.go(path, &[b"idempotency-key: gone"], body).await;
            assert_eq!((again.is(201, true), app.count(&sql).await), (first, 1));
        }
    }
}
