//! Stacking with `#[retryable]`, in both orders.

use super::*;

// ---------------------------------------------------------------------------
// Stacking with #[retryable], in both orders
// ---------------------------------------------------------------------------

#[idempotent(key = key, fingerprint(n), scope = none)]
#[retryable(max = 5, deadline_ms = 30000, backoff_base_ms = 1, backoff_cap_ms = 10)]
async fn idempotent_over_retryable(
    conn: &mut AsyncPgConnection,
    key: &str,
    n: i64,
    script: &Script,
) -> Result<i64, AppError> {
    let id = insert_effect(conn, "stacked", n).await?;
    script.run(conn).await?;
    Ok(id)
}

#[retryable(max = 5, deadline_ms = 30000, backoff_base_ms = 1, backoff_cap_ms = 10)]
#[idempotent(key = key, fingerprint(n), scope = none)]
async fn retryable_over_idempotent(
    conn: &mut AsyncPgConnection,
    key: &str,
    n: i64,
    script: &Script,
) -> Result<i64, AppError> {
    let id = insert_effect(conn, "stacked", n).await?;
    script.run(conn).await?;
    Ok(id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn both_stacking_orders_retry_conflicts_and_record_once() {
    let env = env(2).await;
    for (order, key) in [(0, "stack-idem-first"), (1, "stack-retry-first")] {
        let script = Script::new(&[Step::SerializationFailure, Step::Stale]);
        let call = || async {
            match order {
                0 => idempotent_over_retryable(&env.pool, key, 5, &script).await,
                _ => retryable_over_idempotent(&env.pool, key, 5, &script).await,
            }
        };
        let first = call().await.unwrap();
        assert!(!first.replayed, "{key}");
        assert_eq!(script.calls(), 3, "{key}: a 40001, a Stale, then success");
        // Only the last attempt's write, and its record, committed.
        let (id, n): (i64, i64) = {
            let row = env
                .client
                .query_one(
                    "SELECT max(id), count(*) FROM effects WHERE tag = 'stacked'",
                    &[],
                )
                .await
                .unwrap();
            (row.get(0), row.get(1))
        };
        assert_eq!((n, id), ((order + 1) as i64, first.value), "{key}");
        let (state, outcome, response) = env.record(key).await.unwrap();
        assert_eq!(
            (state.as_str(), outcome.as_deref(), response),
            ("completed", Some("ok"), Some(first.value.to_string())),
            "{key}"
        );
        let replay = call().await.unwrap();
        assert!(replay.replayed, "{key}");
        assert_eq!(replay.value, first.value);
        assert_eq!(script.calls(), 3, "{key}");
    }
    assert_eq!(env.records().await, 2);
}

// ---------------------------------------------------------------------------
// With #[tracing::instrument] below both: it spans the whole call, its retry
// loop inside, a replay too (and, pinned by `.ci/run`'s clippy `-D warnings`
// over every target, no `type_complexity` warning lands on the return type)
// ---------------------------------------------------------------------------

#[idempotent(key = key, fingerprint(n), scope = none)]
#[retryable(max = 5, deadline_ms = 30000, backoff_base_ms = 1, backoff_cap_ms = 10)]
#[tracing::instrument(name = "instrumented_call", skip(conn), err)]
async fn instrumented(conn: &mut AsyncPgConnection, key: &str, n: i64) -> Result<i64, AppError> {
    insert_effect(conn, "instrumented", n).await
}

impl Log {
    /// The spans opened, each as its line's context (`outer:inner`).
    fn opened(&self) -> Vec<String> {
        let text = String::from_utf8(self.0.lock().unwrap().clone()).unwrap();
        text.lines()
            .filter_map(|line| {
                // `<time>  INFO <context>: <target>: new`
                let (_, rest) = line.split_once(" INFO ")?;
                let mut parts = rest.rsplitn(3, ": ");
                (parts.next()? == "new").then_some(())?;
                parts.next()?;
                Some(parts.next()?.to_owned())
            })
            .collect()
    }
}

// One thread: the subscriber set here is this thread's default.
#[tokio::test(flavor = "current_thread")]
async fn instrument_below_both_spans_each_call_with_its_retry_loop_inside() {
    let env = env(1).await;
    let captured = Log::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::NEW)
        .finish();
    let _default = tracing::subscriber::set_default(subscriber);

    let first = instrumented(&env.pool, "instrumented-1", 7).await.unwrap();
    assert!(!first.replayed);
    let opened = captured.opened();
    assert!(
        opened[0].starts_with(r#"instrumented_call{key="instrumented-1" n=7}"#),
        "{opened:?}"
    );
    assert!(
        opened
            .iter()
            .any(|span| span.starts_with("instrumented_call{") && span.contains(":idem.retry{")),
        "the retry loop runs inside the call's span: {opened:?}"
    );
    let replay = instrumented(&env.pool, "instrumented-1", 7).await.unwrap();
    assert!(replay.replayed);
    assert_eq!(replay.value, first.value);
    let calls = captured
        .opened()
        .iter()
        .filter(|span| span.starts_with("instrumented_call{") && !span.contains("}:"))
        .count();
    assert_eq!(
        calls,
        2,
        "one span per call, the replay's too: {:?}",
        captured.opened()
    );
    let effects = env
        .client
        .query_one(
            "SELECT count(*) FROM effects WHERE tag = 'instrumented'",
            &[],
        )
        .await
        .unwrap()
        .get::<_, i64>(0);
    assert_eq!(effects, 1);
}
