//! The books: concurrent transfers keep them balanced, an Idempotency-Key
//! has its effect once, refusals are final, and If-Match guards metadata
//! writes. No assertion depends on timing.

use axum::http::Method;
use serde_json::json;

use crate::testkit::{Ledger, Reply};
use crate::EUR;

/// Runs `n` transfers of `amount` from `from` to `to` at once, each under
/// `key(i)`.
async fn concurrent_transfers(
    ledger: &Ledger,
    n: usize,
    from: i64,
    to: i64,
    amount: i64,
    key: impl Fn(usize) -> String,
) -> Vec<Reply> {
    let start = std::sync::Arc::new(tokio::sync::Barrier::new(n));
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let client = ledger.client.clone();
            let key = key(i);
            let start = start.clone();
            tokio::spawn(async move {
                start.wait().await;
                client.transfer(Some(&key), from, to, amount, EUR).await
            })
        })
        .collect();
    let mut replies = Vec::with_capacity(n);
    for task in tasks {
        replies.push(task.await.expect("the request task"));
    }
    replies
}

async fn funded_pair(ledger: &Ledger, funds: i64) -> (i64, i64) {
    let source = ledger.client.open_account(EUR).await;
    let destination = ledger.client.open_account(EUR).await;
    let funded = ledger.client.top_up("fund", source, funds, EUR).await;
    assert_eq!(funded.status, 201, "{funded:?}");
    (source, destination)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_transfers_with_fresh_keys_all_succeed() {
    let mut ledger = Ledger::start().await;
    let (source, destination) = funded_pair(&ledger, 5000).await;

    let replies = concurrent_transfers(&ledger, 50, source, destination, 100, |i| {
        format!("fresh-{i}")
    })
    .await;

    for reply in &replies {
        assert_eq!(reply.status, 201, "{reply:?}");
        assert!(!reply.replayed(), "{reply:?}");
    }
    for account in [source, destination] {
        assert_eq!(
            ledger.balance(account).await,
            ledger.entries_balance(account).await,
            "account {account}: cache == Σ signed entries"
        );
    }
    assert_eq!(ledger.balance(source).await, 0);
    assert_eq!(ledger.balance(destination).await, 5000);
    assert_eq!(ledger.entries(destination).await, 50);
    ledger.assert_consistent().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_transfers_never_overdraw() {
    let mut ledger = Ledger::start().await;
    let (source, destination) = funded_pair(&ledger, 1000).await;

    let replies = concurrent_transfers(&ledger, 50, source, destination, 100, |i| {
        format!("overdraw-{i}")
    })
    .await;

    let created: Vec<&Reply> = replies.iter().filter(|r| r.status == 201).collect();
    let refused: Vec<&Reply> = replies.iter().filter(|r| r.status == 422).collect();
    assert_eq!(created.len(), 10, "{replies:?}");
    assert_eq!(refused.len(), 40, "{replies:?}");
    for reply in &refused {
        assert_eq!(
            reply.body["type"], "urn:ledger:problem:insufficient-funds",
            "{reply:?}"
        );
        assert_eq!(
            reply.header("content-type"),
            Some("application/problem+json")
        );
    }
    // Each success saw the one before it: the source's balances after them
    // are exactly 900, 800, ..., 0, never below.
    let mut after: Vec<i64> = created
        .iter()
        .map(|r| r.body["from_balance"].as_i64().expect("from_balance"))
        .collect();
    after.sort_unstable();
    assert_eq!(after, (0..10).map(|i| i * 100).collect::<Vec<_>>());
    assert_eq!(ledger.balance(source).await, 0);
    assert_eq!(ledger.balance(destination).await, 1000);
    for account in [source, destination] {
        assert_eq!(
            ledger.balance(account).await,
            ledger.entries_balance(account).await
        );
    }
    // The refusals wrote nothing: one top-up pair and ten transfer pairs.
    assert_eq!(ledger.entries(source).await, 11);
    ledger.assert_consistent().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_concurrent_requests_with_one_key_transfer_once() {
    let mut ledger = Ledger::start().await;
    let (source, destination) = funded_pair(&ledger, 1000).await;
    let (_, movements_before, entries_before, _) = ledger.counts().await;

    let replies = concurrent_transfers(&ledger, 20, source, destination, 100, |_| {
        "one-key".to_owned()
    })
    .await;

    let first = &replies[0];
    for reply in &replies {
        assert_eq!(reply.status, 201, "{reply:?}");
        assert_eq!(reply.body, first.body, "every response is the same body");
    }
    assert_eq!(
        replies.iter().filter(|r| r.replayed()).count(),
        19,
        "all but the first are marked as replays: {replies:?}"
    );
    let (_, movements, entries, _) = ledger.counts().await;
    assert_eq!(movements - movements_before, 1, "exactly one transfer");
    assert_eq!(entries - entries_before, 2, "exactly one pair of entries");
    assert_eq!(ledger.balance(source).await, 900);
    assert_eq!(ledger.balance(destination).await, 100);
    ledger.assert_consistent().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_key_with_another_body_is_refused_and_changes_nothing() {
    let mut ledger = Ledger::start().await;
    let (source, destination) = funded_pair(&ledger, 1000).await;
    let first = ledger
        .client
        .transfer(Some("reused"), source, destination, 100, EUR)
        .await;
    assert_eq!(first.status, 201, "{first:?}");
    let counts = ledger.counts().await;

    let other = ledger
        .client
        .transfer(Some("reused"), source, destination, 300, EUR)
        .await;
    assert_eq!(other.status, 422, "{other:?}");
    assert_eq!(other.body["type"], "urn:idem:problem:fingerprint-mismatch");
    assert_eq!(other.body["status"], 422);
    assert!(other.body["detail"].as_str().is_some());
    assert!(!other.replayed());
    assert_eq!(ledger.counts().await, counts);
    assert_eq!(ledger.balance(source).await, 900);
    assert_eq!(ledger.balance(destination).await, 100);

    // The first request, sent again, still gets its own response.
    let again = ledger
        .client
        .transfer(Some("reused"), source, destination, 100, EUR)
        .await;
    assert_eq!((again.status, &again.body), (201, &first.body));
    assert!(again.replayed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_or_malformed_key_is_refused_before_anything_is_written() {
    let mut ledger = Ledger::start().await;
    let (source, destination) = funded_pair(&ledger, 1000).await;
    let counts = ledger.counts().await;

    let missing = ledger
        .client
        .transfer(None, source, destination, 100, EUR)
        .await;
    assert_eq!(missing.status, 400, "{missing:?}");
    assert_eq!(
        missing.body["type"],
        "urn:idem:problem:idempotency-key-missing"
    );
    assert_eq!(
        missing.header("content-type"),
        Some("application/problem+json")
    );

    let body = json!({ "from_account": source, "to_account": destination, "amount": 100, "currency": EUR });
    for bad in ["\"unterminated", "\"\"", "two words", "\"k\"; p=1"] {
        let reply = ledger
            .client
            .request(
                Method::POST,
                "/transfers",
                &[("idempotency-key", bad)],
                Some(&body),
            )
            .await;
        assert_eq!(reply.status, 400, "{bad}: {reply:?}");
        assert_eq!(
            reply.body["type"], "urn:idem:problem:idempotency-key-invalid",
            "{bad}"
        );
    }
    assert_eq!(ledger.counts().await, counts, "nothing was written");
    assert_eq!(ledger.balance(source).await, 1000);

    // A bare token is accepted.
    let bare = ledger
        .client
        .request(
            Method::POST,
            "/transfers",
            &[("idempotency-key", "8e03978e-40d5-43e8-bc93-6894a57f9324")],
            Some(&body),
        )
        .await;
    assert_eq!(bare.status, 201, "{bare:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn business_refusals_are_final_replayed_and_write_no_entry() {
    let mut ledger = Ledger::start().await;
    let (source, destination) = funded_pair(&ledger, 500).await;
    let dollars = ledger.client.open_account("USD").await;
    let counts = ledger.counts().await;

    let cases: [(&str, i64, i64, i64, u16, &str); 5] = [
        ("poor", source, destination, 501, 422, "insufficient-funds"),
        ("self", source, source, 10, 422, "self-transfer"),
        ("fx", source, dollars, 10, 422, "currency-mismatch"),
        ("ghost", source, 999_999, 10, 404, "unknown-account"),
        ("zero", source, destination, 0, 400, "non-positive-amount"),
    ];
    for (key, from, to, amount, status, kind) in cases {
        let first = ledger
            .client
            .transfer(Some(key), from, to, amount, EUR)
            .await;
        assert_eq!(first.status, status, "{key}: {first:?}");
        assert_eq!(
            first.body["type"],
            format!("urn:ledger:problem:{kind}"),
            "{key}"
        );
        assert_eq!(first.body["status"], status);
        assert!(!first.replayed(), "{key}");
        let again = ledger
            .client
            .transfer(Some(key), from, to, amount, EUR)
            .await;
        assert_eq!(
            (again.status, &again.body),
            (status, &first.body),
            "{key}: the stored refusal is replayed"
        );
        assert!(again.replayed(), "{key}: {again:?}");
    }
    let (accounts, movements, entries, records) = ledger.counts().await;
    assert_eq!(
        (accounts, movements, entries),
        (counts.0, counts.1, counts.2),
        "no refusal wrote a movement or an entry"
    );
    assert_eq!(
        records,
        counts.3 + 5,
        "each refusal is stored under its key"
    );
    assert_eq!(ledger.balance(source).await, 500);
    ledger.assert_consistent().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn if_match_guards_metadata() {
    let mut ledger = Ledger::start().await;
    let account = ledger.client.open_account(EUR).await;
    let path = format!("/accounts/{account}");

    let read = ledger.client.request(Method::GET, &path, &[], None).await;
    assert_eq!(read.status, 200, "{read:?}");
    let etag = read.header("etag").expect("an ETag").to_owned();
    assert_eq!(etag, "\"v0\"");

    let renamed = ledger
        .client
        .request(
            Method::PATCH,
            &path,
            &[("if-match", &etag)],
            Some(&json!({ "metadata": { "name": "savings" } })),
        )
        .await;
    assert_eq!(renamed.status, 200, "{renamed:?}");
    assert_eq!(renamed.header("etag"), Some("\"v1\""));
    assert_eq!(renamed.body["metadata"]["name"], "savings");

    // The old ETag is stale now.
    let stale = ledger
        .client
        .request(
            Method::PATCH,
            &path,
            &[("if-match", &etag)],
            Some(&json!({ "metadata": { "name": "lost update" } })),
        )
        .await;
    assert_eq!(stale.status, 412, "{stale:?}");
    assert_eq!(stale.body["type"], "urn:idem:problem:precondition-failed");
    assert_eq!(stale.body["current_etag"], "\"v1\"");

    let missing = ledger
        .client
        .request(
            Method::PATCH,
            &path,
            &[],
            Some(&json!({ "metadata": { "name": "no precondition" } })),
        )
        .await;
    assert_eq!(missing.status, 428, "{missing:?}");
    assert_eq!(
        missing.body["type"],
        "urn:idem:problem:precondition-required"
    );

    let malformed = ledger
        .client
        .request(
            Method::PATCH,
            &path,
            &[("if-match", "v1")],
            Some(&json!({ "metadata": {} })),
        )
        .await;
    assert_eq!(malformed.status, 400, "{malformed:?}");

    let after = ledger.client.request(Method::GET, &path, &[], None).await;
    assert_eq!(after.header("etag"), Some("\"v1\""), "nothing changed");
    assert_eq!(after.body["metadata"], json!({ "name": "savings" }));

    // `*` writes whatever the version.
    let any = ledger
        .client
        .request(
            Method::PATCH,
            &path,
            &[("if-match", "*")],
            Some(&json!({ "metadata": { "name": "checking" } })),
        )
        .await;
    assert_eq!(any.status, 200, "{any:?}");
    assert_eq!(any.header("etag"), Some("\"v2\""));

    let unknown = ledger
        .client
        .request(Method::GET, "/accounts/424242", &[], None)
        .await;
    assert_eq!(unknown.status, 404, "{unknown:?}");
    assert_eq!(ledger.balance(account).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_are_append_only() {
    use diesel_async::SimpleAsyncConnection;
    let mut ledger = Ledger::start().await;
    let (source, _) = funded_pair(&ledger, 100).await;
    assert_eq!(ledger.entries(source).await, 1);
    for statement in [
        "UPDATE ledger_entries SET amount = amount + 1",
        "DELETE FROM ledger_entries",
        "TRUNCATE ledger_entries CASCADE",
    ] {
        let err = ledger
            .conn
            .batch_execute(statement)
            .await
            .expect_err(statement);
        assert!(
            err.to_string().contains("append-only"),
            "{statement}: {err}"
        );
    }
    // A movement whose debits and credits differ is refused at commit.
    let err = ledger
        .conn
        .batch_execute(
            "BEGIN; \
             INSERT INTO ledger_entries (tenant_id, transfer_id, account_id, direction, amount, currency) \
             SELECT tenant_id, transfer_id, account_id, 'CREDIT', 5, currency FROM ledger_entries LIMIT 1; \
             COMMIT",
        )
        .await
        .expect_err("an unbalanced movement");
    assert!(err.to_string().contains("does not balance"), "{err}");
    assert_eq!(ledger.entries(source).await, 1);
    ledger.assert_consistent().await;
}
