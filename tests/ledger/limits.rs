//! Amounts, currencies and metadata are bounded and validated before
//! anything is written, money never overflows a balance, and no input is
//! echoed at length. The limits are the ones `examples/ledger/app/limits.rs`
//! documents, written out here so that a change of them is a change here.

use axum::http::Method;
use diesel_async::SimpleAsyncConnection;
use serde_json::{json, Value};

use crate::testkit::Ledger;
use crate::EUR;

/// The largest amount one movement may carry, in minor units.
const MAX_AMOUNT: i64 = 1_000_000_000_000;
/// The largest metadata, as compact JSON.
const MAX_METADATA_BYTES: usize = 4096;
/// The deepest metadata: the object itself is level 1.
const MAX_METADATA_DEPTH: usize = 32;

/// A movement written straight into the tables, as a migration of old books
/// would, past the API's bounds: both caches (version bumped, as the guard
/// requires), the movement and its two entries, in one transaction.
async fn legacy_movement(ledger: &mut Ledger, from: i64, to: i64, amount: i64) {
    ledger
        .conn
        .batch_execute(&format!(
            "BEGIN;
             UPDATE ledger_accounts SET balance = balance - {amount}, version = version + 1 WHERE id = {from};
             UPDATE ledger_accounts SET balance = balance + {amount}, version = version + 1 WHERE id = {to};
             WITH t AS (
                 INSERT INTO ledger_transfers (tenant_id, kind, from_account, to_account, amount, currency, idempotency_key)
                 SELECT tenant_id, 'top_up', {from}, {to}, {amount}, currency, 'legacy'
                   FROM ledger_accounts WHERE id = {from}
                 RETURNING id, tenant_id, currency)
             INSERT INTO ledger_entries (tenant_id, transfer_id, account_id, direction, amount, currency)
             SELECT tenant_id, id, {from}, 'DEBIT', {amount}, currency FROM t
             UNION ALL SELECT tenant_id, id, {to}, 'CREDIT', {amount}, currency FROM t;
             COMMIT"
        ))
        .await
        .expect("a legacy movement");
}

/// The funding account the first top-up of `account` created.
fn funding_of(reply: &crate::testkit::Reply) -> i64 {
    assert_eq!(reply.status, 201, "{reply:?}");
    reply.body["from_account"].as_i64().expect("from_account")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_top_up_of_i64_max_is_declined_and_replayed() {
    let mut ledger = Ledger::start().await;
    let (a, b) = (
        ledger.client.open_account(EUR).await,
        ledger.client.open_account(EUR).await,
    );
    // Was 201, and the second one panicked the server on `balance - amount`.
    for (key, account) in [("max-a", a), ("max-b", b)] {
        let first = ledger.client.top_up(key, account, i64::MAX, EUR).await;
        assert_eq!(first.status, 422, "{first:?}");
        assert_eq!(first.body["type"], "urn:ledger:problem:amount-too-large");
        assert_eq!(first.body["max_amount"], MAX_AMOUNT);
        let again = ledger.client.top_up(key, account, i64::MAX, EUR).await;
        assert_eq!((again.status, &again.body), (422, &first.body));
        assert!(again.replayed(), "a final decline is stored: {again:?}");
    }
    let above = ledger.client.top_up("above", a, MAX_AMOUNT + 1, EUR).await;
    assert_eq!(above.status, 422, "{above:?}");
    for (key, amount) in [("min", i64::MIN), ("minus-max", -i64::MAX), ("zero", 0)] {
        let reply = ledger.client.top_up(key, a, amount, EUR).await;
        assert_eq!(reply.status, 400, "{key}: {reply:?}");
        assert_eq!(reply.body["type"], "urn:ledger:problem:non-positive-amount");
    }
    let transfer = ledger
        .client
        .transfer(Some("t-max"), a, b, i64::MAX, EUR)
        .await;
    assert_eq!(transfer.status, 422, "{transfer:?}");
    assert_eq!(transfer.body["type"], "urn:ledger:problem:amount-too-large");
    assert_eq!(ledger.counts().await.2, 0, "no entry was written");

    let max = ledger.client.top_up("max-ok", a, MAX_AMOUNT, EUR).await;
    assert_eq!(max.status, 201, "{max:?}");
    assert_eq!(ledger.balance(a).await, MAX_AMOUNT);
    ledger.assert_consistent().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_movement_that_would_overflow_a_balance_is_declined_and_replayed() {
    let mut ledger = Ledger::start().await;
    let (rich, other) = (
        ledger.client.open_account(EUR).await,
        ledger.client.open_account(EUR).await,
    );
    let funding = funding_of(&ledger.client.top_up("first", rich, 1, EUR).await);
    // rich: i64::MAX - 9; funding: -i64::MAX + 9.
    legacy_movement(&mut ledger, funding, rich, i64::MAX - 10).await;
    ledger.assert_consistent().await;
    let counts = ledger.counts().await;

    // The destination would pass i64::MAX.
    let top_up = ledger.client.top_up("over-to", rich, 10, EUR).await;
    assert_eq!(top_up.status, 422, "{top_up:?}");
    assert_eq!(top_up.body["type"], "urn:ledger:problem:balance-overflow");
    assert_eq!(top_up.body["account"], rich);
    let again = ledger.client.top_up("over-to", rich, 10, EUR).await;
    assert_eq!((again.status, &again.body), (422, &top_up.body));
    assert!(again.replayed(), "{again:?}");

    // The funding account would pass i64::MIN (this one panicked the server).
    let fund = ledger.client.top_up("fund-other", other, 10, EUR).await;
    assert_eq!(fund.body["from_balance"], i64::MIN, "exactly at the limit");
    assert_eq!(fund.status, 201, "{fund:?}");
    let under = ledger.client.top_up("over-from", other, 2, EUR).await;
    assert_eq!(under.status, 422, "{under:?}");
    assert_eq!(under.body["type"], "urn:ledger:problem:balance-overflow");
    assert_eq!(under.body["account"], funding);

    let transfer = ledger
        .client
        .transfer(Some("over-transfer"), other, rich, 10, EUR)
        .await;
    assert_eq!(transfer.status, 422, "{transfer:?}");
    assert_eq!(transfer.body["type"], "urn:ledger:problem:balance-overflow");

    let (accounts, movements, entries, _) = ledger.counts().await;
    assert_eq!(
        (accounts, movements, entries),
        (counts.0, counts.1 + 1, counts.2 + 2),
        "only the one top-up that fits was written"
    );
    assert_eq!(ledger.balance(rich).await, i64::MAX - 9);
    assert_eq!(ledger.balance(funding).await, i64::MIN);

    // Σ DEBIT over the whole ledger now passes i64::MAX: reconcile still
    // answers (it failed with "bigint out of range").
    let dollars = ledger.client.open_account("USD").await;
    let usd_funding = funding_of(&ledger.client.top_up("usd", dollars, 1, "USD").await);
    legacy_movement(&mut ledger, usd_funding, dollars, i64::MAX - 1).await;
    let report = ledger.assert_consistent().await;
    assert!(report.debits > i128::from(i64::MAX), "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_top_up_validates_every_input_before_it_writes() {
    let mut ledger = Ledger::start().await;
    let account = ledger.client.open_account(EUR).await;
    let counts = ledger.counts().await;

    // Was a 500: the funding account's insert broke its CHECK first.
    let lower = ledger.client.top_up("lower", account, 100, "eur").await;
    assert_eq!(lower.status, 400, "{lower:?}");
    assert_eq!(lower.body["type"], "urn:ledger:problem:invalid-currency");
    let other = ledger.client.top_up("xyz", account, 100, "XYZ").await;
    assert_eq!(other.status, 422, "{other:?}");
    assert_eq!(other.body["type"], "urn:ledger:problem:currency-mismatch");
    let ghost = ledger.client.top_up("ghost", 424_242, 100, EUR).await;
    assert_eq!(ghost.status, 404, "{ghost:?}");
    // A transfer checks the currency's form too, before reading accounts.
    let transfer = ledger
        .client
        .transfer(Some("t-lower"), account, 424_242, 5, "eur")
        .await;
    assert_eq!(transfer.status, 400, "{transfer:?}");
    assert_eq!(transfer.body["type"], "urn:ledger:problem:invalid-currency");

    let (accounts, movements, entries, records) = ledger.counts().await;
    assert_eq!(
        (accounts, movements, entries),
        (counts.0, counts.1, counts.2),
        "no funding account, movement or entry"
    );
    assert_eq!(
        records,
        counts.3 + 4,
        "each decline is stored under its key"
    );
}

/// `{"a": {"a": ... 1}}`, `depth` objects deep.
fn nested(depth: usize) -> Value {
    (1..depth).fold(json!({ "a": 1 }), |inner, _| json!({ "a": inner }))
}

/// An object whose compact JSON is exactly `bytes` long.
fn sized(bytes: usize) -> Value {
    json!({ "s": "x".repeat(bytes - r#"{"s":""}"#.len()) })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_is_a_small_shallow_object_without_nul() {
    let mut ledger = Ledger::start().await;
    let refused = [
        json!([1, 2]),
        json!("text"),
        json!(5),
        json!(true),
        json!(null),
        json!({ "name": "x\u{0}y" }),
        json!({ "x\u{0}": 1 }),
        json!({ "deep": [{ "list": ["fine", "n\u{0}l"] }] }),
        nested(MAX_METADATA_DEPTH + 1),
        nested(100),
        sized(MAX_METADATA_BYTES + 1),
    ];
    let counts = ledger.counts().await;
    for (i, metadata) in refused.iter().enumerate() {
        let body = json!({ "currency": EUR, "metadata": metadata });
        let reply = ledger
            .client
            .request(Method::POST, "/accounts", &[], Some(&body))
            .await;
        assert_eq!(reply.status, 422, "{i}: {reply:?}");
        assert_eq!(reply.body["type"], "urn:ledger:problem:invalid-metadata");
        // Under a key, the decline is stored and replayed like any other.
        let key = format!("\"meta-{i}\"");
        let headers = [("idempotency-key", key.as_str())];
        let first = ledger
            .client
            .request(Method::POST, "/accounts", &headers, Some(&body))
            .await;
        assert_eq!((first.status, &first.body), (422, &reply.body), "{i}");
        let again = ledger
            .client
            .request(Method::POST, "/accounts", &headers, Some(&body))
            .await;
        assert_eq!((again.status, &again.body), (422, &reply.body), "{i}");
        assert!(again.replayed(), "{i}: {again:?}");
    }
    assert_eq!(ledger.counts().await.0, counts.0, "no account was opened");

    // At the limits, accepted; and the same limits guard PATCH.
    for metadata in [
        nested(MAX_METADATA_DEPTH),
        sized(MAX_METADATA_BYTES),
        json!({ "sql": "$$; DROP TABLE ledger_entries; $$", "$tag$": "$tag$ x $tag$" }),
    ] {
        let body = json!({ "currency": EUR, "metadata": metadata });
        let reply = ledger
            .client
            .request(Method::POST, "/accounts", &[], Some(&body))
            .await;
        assert_eq!(reply.status, 201, "{reply:?}");
        assert_eq!(reply.body["metadata"], metadata);
    }
    let account = ledger.client.open_account(EUR).await;
    let path = format!("/accounts/{account}");
    for metadata in [
        json!({ "name": "x\u{0}y" }),
        nested(MAX_METADATA_DEPTH + 1),
        sized(MAX_METADATA_BYTES + 1),
    ] {
        let reply = ledger
            .client
            .request(
                Method::PATCH,
                &path,
                &[("if-match", "*")],
                Some(&json!({ "metadata": metadata })),
            )
            .await;
        assert_eq!(reply.status, 422, "{reply:?}");
        assert_eq!(reply.body["type"], "urn:ledger:problem:invalid-metadata");
    }
    let read = ledger.client.request(Method::GET, &path, &[], None).await;
    assert_eq!(read.header("etag"), Some("\"v0\""), "nothing was written");
    ledger.assert_consistent().await;
}

/// A transfer whose account row another session holds longer than the
/// transfer's deadline waits, replays its attempts within the deadline, and
/// is answered 503 problem+json: busy, try again. The versioned update meets
/// idem's lock_timeout through a statement that returns rows; it was once the
/// body's own error, a 500.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_on_a_row_held_past_its_deadline_is_503() {
    let mut ledger = Ledger::start().await;
    let (a, b) = (
        ledger.client.open_account(EUR).await,
        ledger.client.open_account(EUR).await,
    );
    let topped = ledger.client.top_up("held-top-up", a, 500, EUR).await;
    assert_eq!(topped.status, 201, "{topped:?}");
    // Hold a's row (the transfer's deadline is 10 s).
    ledger
        .conn
        .batch_execute(&format!(
            "BEGIN; SELECT 1 FROM ledger_accounts WHERE id = {a} FOR UPDATE"
        ))
        .await
        .expect("hold the row");
    let started = std::time::Instant::now();
    let reply = ledger
        .client
        .transfer(Some("held-transfer"), a, b, 100, EUR)
        .await;
    let waited = started.elapsed();
    ledger
        .conn
        .batch_execute("ROLLBACK")
        .await
        .expect("release");
    assert_eq!(reply.status, 503, "{reply:?}");
    assert_eq!(
        reply.header("content-type"),
        Some("application/problem+json"),
        "{reply:?}"
    );
    assert!(reply.header("retry-after").is_some(), "{reply:?}");
    // Replayed within the deadline, not given up after one lock wait.
    assert!(waited >= std::time::Duration::from_secs(8), "{waited:?}");
    assert_eq!(ledger.balance(a).await, 500, "nothing moved");
    assert_eq!(ledger.balance(b).await, 0, "nothing moved");
    // Once the row is free, the same key runs, once.
    let again = ledger
        .client
        .transfer(Some("held-transfer"), a, b, 100, EUR)
        .await;
    assert_eq!(again.status, 201, "{again:?}");
    assert_eq!(ledger.balance(b).await, 100);
}
