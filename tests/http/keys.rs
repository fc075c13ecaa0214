//! `Idempotency-Key`: malformed and well-formed keys, one key in every
//! spelling, other bodies and operations under a key, racers, declines,
//! failures, external mode's held keys, an exhausted pool.

use super::*;

/// Every missing, malformed or invalid `Idempotency-Key` is a 400 problem of
/// the documented type, and nothing is written, not even a record: empty,
/// blank, quoted spaces, a space, tab, backslash, semicolon or comma in a bare token, a tab
/// in an sf-string, obs-text, UTF-8, a zero-width space, unterminated,
/// parameters, a list, an escape sf-strings do not have, over 255 bytes
/// (also through escapes), 10 kB, 100 kB, the header twice; also when the
/// body is not JSON (the key is refused first).
#[tokio::test]
async fn bad_keys_are_400_and_write_nothing() {
    let mut app = start().await;
    app.pay(1, &[], BODY).await.problem(IDEMPOTENCY_KEY_MISSING);
    app.pay(1, &[], "{not json")
        .await
        .problem(IDEMPOTENCY_KEY_MISSING);
    let long = |n: usize| key(&"k".repeat(n));
    let mut bad: Vec<Vec<u8>> = [256, 10_000, 100_000].map(long).to_vec();
    bad.push(key(&format!("\"{}\"", "\\\\".repeat(256))));
    let text = r#"|""|   |"   "|" "|a b|a	b|"a	b"|a\b|"abc|"abc"; x=1|"a", "b"|"a\nb"|abc;x|a,b|"é"|ab"c|"abc"x|"abc" "d""#;
    bad.extend(text.split('|').map(key));
    bad.push(b"idempotency-key: caf\xe9".to_vec());
    bad.push(b"idempotency-key: \"a\xe2\x80\x8bb\"".to_vec());
    for header in &bad {
        let reply = app.pay(1, &[header], BODY).await;
        let shown = String::from_utf8_lossy(&header[..header.len().min(60)]);
        assert_eq!(reply.status, 400, "{shown}: {reply:?}");
        reply.problem(IDEMPOTENCY_KEY_INVALID);
        let reply = app.pay(1, &[header], "{not json").await;
        reply.problem(IDEMPOTENCY_KEY_INVALID);
    }
    let twice: [[&[u8]; 2]; 2] = [
        [b"idempotency-key: \"k1\"", b"idempotency-key: \"k1\""],
        [b"Idempotency-Key: k1", b"IDEMPOTENCY-KEY: k2"],
    ];
    for two in twice {
        app.pay(1, &two, BODY)
            .await
            .problem(IDEMPOTENCY_KEY_INVALID);
    }
    let records = app.count("SELECT count(*) AS n FROM idem_requests");
    assert_eq!(records.await, 0);
    assert_eq!(app.pays().await, 0);
    // The limit itself: 255 bytes is a key, also when written with escapes.
    app.pay(1, &[&long(255)], BODY).await.is(201, false);
    let escaped = key(&format!("\"{}\"", "\\\\".repeat(255)));
    app.pay(1, &[&escaped], BODY).await.is(201, false);
    let sql = "SELECT count(*) AS n FROM pays WHERE length(idem_key) = 255";
    assert_eq!(app.count(sql).await, 2);
}

/// `"k"` and `k` are one key, whatever the header name's case: the second is
/// the first's response, marked, with one row. Escapes, case and spaces in
/// an sf-string are part of the key.
#[tokio::test]
async fn quoted_bare_and_any_case_name_are_one_key() {
    let mut app = start().await;
    let quoted: &[u8] = b"Idempotency-Key: \"order-1\"";
    let first = app.pay(1, &[quoted], BODY).await;
    assert_eq!(first.header("idempotent-replayed"), None);
    let first = first.is(201, false);
    let same = ["IDEMPOTENCY-KEY: order-1", "idempotency-key:order-1  "];
    for header in same.iter().chain(&["idEMpotency-kEY: \"order-1\""]) {
        let again = app.pay(1, &[header.as_bytes()], BODY).await;
        assert_eq!(again.is(201, true), first);
        let ct = again.header("content-type");
        assert_eq!(ct.as_deref(), Some("application/json"));
    }
    for other in [r#""order-1\"""#, "ORDER-1", r#""order-1 ""#] {
        app.pay(1, &[&key(other)], BODY).await.is(201, false);
    }
    let sql = r#"SELECT count(*) AS n FROM pays WHERE idem_key IN
                 ('order-1', 'order-1"', 'ORDER-1', 'order-1 ')"#;
    assert_eq!((app.pays().await, app.count(sql).await), (4, 4));
}

/// The same key with another body is 422 and writes nothing; the refusal
/// does not hand over the first response. Another tenant's same key is
/// another key (with another body too: no 422 to tell it exists).
#[tokio::test]
async fn same_key_other_body_is_422_and_tenants_never_meet() {
    let mut app = start().await;
    let k: &[u8] = b"idempotency-key: \"shared\"";
    let body = r#"{"amount": 424242, "merchant": "m1"}"#;
    let first = app.pay(1, &[k], body).await.is(201, false);
    let others = [
        r#"{"amount": 101, "merchant": "m1"}"#,
        r#"{"amount": 424242, "merchant": "m2"}"#,
    ];
    for other in others {
        let reply = app.pay(1, &[k], other).await;
        reply.problem(FINGERPRINT_MISMATCH);
        assert!(!reply.replayed() && !reply.text().contains("424242"));
    }
    // Field order and whitespace do not change the request.
    let same = r#"{ "merchant":"m1","amount":424242 }"#;
    assert_eq!(app.pay(1, &[k], same).await.is(201, true), first);
    let t2 = app.pay(2, &[k], r#"{"amount": 5, "merchant": "x"}"#).await;
    assert!(!t2.text().contains("424242") && t2.is(201, false)["amount"] == 5);
    let t3 = app.pay(3, &[k], body).await.is(201, false);
    assert_ne!(t3["id"], first["id"]);
    let sql = "SELECT count(*) AS n FROM pays WHERE tenant_id = 1";
    assert_eq!((app.count(sql).await, app.pays().await), (1, 3));
}

/// One key space, three operations with the same fingerprint (a local
/// payment, a local refund, an external payment): a key used by one is
/// refused by the others with 422 (docs/idempotent.md:372-373: "a request
/// whose entry was made for another operation or fingerprint goes to the
/// database, which answers 422 as always"), never answered with the other
/// operation's response, and never run.
#[tokio::test]
async fn another_operation_under_the_same_key_is_422() {
    let mut app = start().await;
    let orders = [("pay", ["refund", "ext"]), ("ext", ["pay", "refund"])];
    for (n, (first, others)) in orders.into_iter().enumerate() {
        let k = key(&format!("op-{n}"));
        let created = app.go(&format!("/{first}/1"), &[&k], BODY).await;
        let created = created.is(201, false);
        for other in others {
            let reply = app.go(&format!("/{other}/1"), &[&k], BODY).await;
            assert!(!reply.replayed(), "{other} got {first}'s {created}");
            reply.problem(FINGERPRINT_MISMATCH);
        }
    }
    assert_eq!(app.pays().await, 2);
}

/// Eight identical requests at once: one effect, one unmarked answer, seven
/// marked replays of it. Then eight at once under one key with two bodies:
/// one effect; its body's requests get it, the other body's 422.
#[tokio::test]
async fn concurrent_duplicates_have_one_effect() {
    let mut app = start().await;
    let bodies = [
        r#"{"amount": 7, "merchant": "m", "sleep_ms": 300}"#,
        r#"{"amount": 8, "merchant": "m", "sleep_ms": 300}"#,
    ];
    for (t, mixed) in [(1, 0), (2, 1)] {
        let mut tasks = Vec::new();
        for i in 0..8 {
            let (addr, body) = (app.0, bodies[mixed * (i % 2)]);
            let path = format!("/pay/{t}");
            let h: &[u8] = b"idempotency-key: r";
            let call = async move { (body, send(addr, "POST", &path, &[h], body).await) };
            tasks.push(tokio::spawn(call));
        }
        let mut replies = Vec::new();
        for task in tasks {
            replies.push(task.await.expect("a reply"));
        }
        let ran = |(_, r): &&(_, Reply)| r.status == 201 && !r.replayed();
        let ran: Vec<_> = replies.iter().filter(ran).collect();
        assert_eq!(ran.len(), 1, "{replies:?}");
        let (winner, first) = (ran[0].0, ran[0].1.is(201, false));
        for (body, reply) in &replies {
            if *body == winner {
                assert_eq!(reply.is(201, reply.replayed()), first);
            } else {
                reply.problem(FINGERPRINT_MISMATCH);
            }
        }
        let marked = replies.iter().filter(|(_, r)| r.replayed()).count();
        assert_eq!(marked, 7 - 4 * mixed);
        let sql = format!("SELECT count(*) AS n FROM pays WHERE tenant_id = {t}");
        assert_eq!(app.count(&sql).await, 1);
    }
}

/// A stored decline is replayed as the same problem, marked (another body
/// under its key is 422); a database failure is a 500 that names no SQL; a response too large or holding U+0000
/// is 422 response-unstorable; a body past the deadline is 503 with
/// `Retry-After: 1`. None of those writes a row, and their keys stay free.
#[tokio::test]
async fn declines_replay_and_failures_leave_the_key_free() {
    let mut app = start().await;
    let body = r#"{"amount": -5, "merchant": "m"}"#;
    let first = app.pay(1, &[b"idempotency-key: d1"], body).await;
    let declined = first.problem(DECLINED);
    assert!(!first.replayed());
    let again = app.pay(1, &[b"idempotency-key: d1"], body).await;
    assert!(again.replayed());
    assert_eq!(again.problem(DECLINED), declined);
    // Another body under a declined key: 422, not the decline.
    let other = r#"{"amount": -6, "merchant": "m"}"#;
    let reply = app.pay(1, &[b"idempotency-key: d1"], other).await;
    reply.problem(FINGERPRINT_MISMATCH);
    let huge = format!(r#"{{"amount": 1, "merchant": "{}"}}"#, "m".repeat(70_000));
    let nul = r#"{"amount": 1, "merchant": "a\u0000b"}"#;
    let slow = r#"{"amount": 1, "merchant": "m", "sleep_ms": 3500}"#;
    let big = r#"{"amount": 5000000, "merchant": "m"}"#;
    let failing = [
        (big, INTERNAL),
        (&huge, RESPONSE_UNSTORABLE),
        (nul, RESPONSE_UNSTORABLE),
        (slow, UNAVAILABLE),
    ];
    for (n, (body, kind)) in failing.iter().enumerate() {
        let k = key(&format!("f{n}"));
        app.pay(1, &[&k], body).await.problem(kind);
        assert_eq!(app.pays().await, 0);
        app.pay(1, &[&k], BODY).await.is(201, false);
        let sql = "DELETE FROM pays RETURNING 1::bigint AS n";
        assert_eq!(app.count(sql).await, 1);
    }
}

/// External mode: a duplicate while the first runs is 409 in-progress with
/// `Retry-After: 1`, then the first's response, marked. A failure after the
/// outside call holds the key: 502 outcome-unknown, the body not run again.
#[tokio::test]
async fn external_in_progress_409_and_outcome_unknown_502() {
    let mut app = start().await;
    let slow = r#"{"amount": 9, "merchant": "m", "sleep_ms": 1500}"#;
    let (addr, h): (_, &[u8]) = (app.0, b"idempotency-key: x1");
    let first = async move { send(addr, "POST", "/ext/1", &[h], slow).await };
    let first = tokio::spawn(first);
    // Wait for the event, not the clock: the first's claim is committed.
    let claimed = "SELECT count(*) AS n FROM idem_requests WHERE key = 'x1'";
    while app.count(claimed).await == 0 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let busy = app.go("/ext/1", &[h], slow).await;
    busy.problem(IN_PROGRESS);
    assert_eq!(busy.header("retry-after").as_deref(), Some("1"));
    let first = first.await.expect("the first").is(201, false);
    assert_eq!(app.go("/ext/1", &[h], slow).await.is(201, true), first);
    let big = r#"{"amount": 5000000, "merchant": "m"}"#;
    let h: &[u8] = b"idempotency-key: x2";
    app.go("/ext/1", &[h], big).await.problem(INTERNAL);
    for _ in 0..2 {
        app.go("/ext/1", &[h], big).await.problem(OUTCOME_UNKNOWN);
    }
    assert_eq!(app.pays().await, 1);
}

/// No free connection within the wait: 503 unavailable with
/// `Retry-After: 1`, nothing written, the key still free.
#[tokio::test]
async fn pool_exhaustion_is_503_with_retry_after() {
    let mut app = start_with(1, Duration::from_millis(200)).await;
    let held = app.2.get().await.expect("the only connection");
    let h: &[u8] = b"idempotency-key: busy";
    app.pay(1, &[h], BODY).await.problem(UNAVAILABLE);
    drop(held);
    assert_eq!(app.pays().await, 0);
    app.pay(1, &[h], BODY).await.is(201, false);
}
