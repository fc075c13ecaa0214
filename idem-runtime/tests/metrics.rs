//! What the retry loop reports through the `metrics` facade (feature
//! `metrics`): a histogram of attempts per call, a counter of calls that
//! succeeded after a retry, a counter of exhausted budgets by last cause, and
//! a counter of failed attempts by cause.
//!
//! The recorder is local to this test's thread (`metrics::with_local_recorder`)
//! and the calls run on a current-thread runtime driven from that thread, so
//! every metric the loop emits reaches it and nothing else does.
//!
//! The replayed failures are real server errors a statement of the body meets
//! (a 40001 and a 40P01 raised by a `DO` block): the loop classifies what
//! failed on the attempt, so a made-up error value would not be replayed.
//! What is tested is how it counts them; tests/retryable/ shows the races
//! themselves. Every attempt runs on a real transaction of a real database.
#![cfg(feature = "metrics")]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use diesel::result::Error as DieselError;
use diesel_async::{RunQueryDsl, SimpleAsyncConnection};
use idem_runtime::pool::{build_pool_with, Pool, PoolConfig};
use idem_runtime::retry::{retry, RetryCause, RetryPolicy};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use metrics_util::MetricKind;
use scoped_futures::ScopedFutureExt;

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Db(#[from] DieselError),
    #[error(transparent)]
    Idem(#[from] idem_runtime::Error),
}

/// A real 40001 from the server.
#[allow(non_upper_case_globals)] // read as the cause it is
const serialization_failure: &str = "DO $$ BEGIN RAISE EXCEPTION 'could not serialize access' \
     USING ERRCODE = 'serialization_failure'; END $$";

/// A real 40P01 from the server, with its (untranslated) message.
#[allow(non_upper_case_globals)]
const deadlock: &str = "DO $$ BEGIN RAISE EXCEPTION 'deadlock detected' \
     USING ERRCODE = 'deadlock_detected'; END $$";

const ATTEMPTS: &str = "idem_retry_attempts";
const SUCCESS_AFTER_RETRY: &str = "idem_retry_success_after_retry_total";
const FAILED_ATTEMPTS: &str = "idem_retry_failed_attempts_total";
const EXHAUSTED: &str = "idem_retry_exhausted_total";

/// A metric's kind, name and labels (sorted).
type MetricKey = (String, String, Vec<(String, String)>);

/// A snapshot keyed by [`MetricKey`].
type Metrics = BTreeMap<MetricKey, DebugValue>;

/// What was recorded since the previous snapshot (the debugging recorder
/// resets counters and drains histograms on each one).
fn take(snapshotter: &Snapshotter) -> Metrics {
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(_, _, _, value)| match value {
            DebugValue::Counter(n) => *n > 0,
            DebugValue::Histogram(samples) => !samples.is_empty(),
            DebugValue::Gauge(_) => true,
        })
        .map(|(key, _, _, value)| {
            let kind = match key.kind() {
                MetricKind::Counter => "counter",
                MetricKind::Gauge => "gauge",
                MetricKind::Histogram => "histogram",
            };
            let mut labels: Vec<(String, String)> = key
                .key()
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            labels.sort();
            (
                (kind.to_owned(), key.key().name().to_owned(), labels),
                value,
            )
        })
        .collect()
}

fn labels(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut labels: Vec<_> = pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    labels.sort();
    labels
}

fn counter(name: &str, pairs: &[(&str, &str)], n: u64) -> (MetricKey, DebugValue) {
    (
        ("counter".to_owned(), name.to_owned(), labels(pairs)),
        DebugValue::Counter(n),
    )
}

fn attempts_histogram(function: &str, outcome: &str, samples: &[f64]) -> (MetricKey, DebugValue) {
    (
        (
            "histogram".to_owned(),
            ATTEMPTS.to_owned(),
            labels(&[("function", function), ("outcome", outcome)]),
        ),
        DebugValue::Histogram(samples.iter().map(|&s| s.into()).collect()),
    )
}

/// A body that fails its first attempts with `failures` (one per attempt, in
/// order), then succeeds; each attempt runs a statement in its transaction.
async fn call(
    pool: &Pool,
    policy: RetryPolicy,
    name: &'static str,
    failures: &[&'static str],
) -> (Result<i32, AppError>, u32) {
    let calls = AtomicU32::new(0);
    let calls_ref = &calls;
    let result = retry(pool, policy, name, |conn| {
        async move {
            let attempt = calls_ref.fetch_add(1, Ordering::SeqCst) as usize;
            let one: i32 = diesel::select(diesel::dsl::sql::<diesel::sql_types::Integer>("1"))
                .get_result(conn)
                .await?;
            if let Some(failure) = failures.get(attempt) {
                conn.batch_execute(failure).await?;
                unreachable!("the statement fails");
            }
            Ok(one)
        }
        .scope_boxed()
    })
    .await;
    (result, calls.into_inner())
}

async fn scenario(snapshotter: &Snapshotter) {
    let db = idem_testing::TestDatabase::create()
        .await
        .expect("create the test database");
    let pool = build_pool_with(
        db.url(),
        &PoolConfig {
            max_size: 2,
            wait_timeout: Duration::from_secs(10),
            ..Default::default()
        },
    )
    .expect("build the pool");
    let policy = RetryPolicy::new()
        .max_attempts(3)
        .deadline(Duration::from_secs(30))
        .backoff(Duration::from_millis(1), Duration::from_millis(2));
    // Whatever the pool's set-up might emit is not the loop's.
    drop(pool.get().await.expect("a connection"));
    take(snapshotter);

    // 1. Succeeds at once: one sample of 1 attempt, and nothing else.
    let (result, calls) = call(&pool, policy, "at_once", &[]).await;
    assert_eq!(result.expect("succeeds"), 1);
    assert_eq!(calls, 1);
    assert_eq!(
        take(snapshotter),
        Metrics::from([attempts_histogram("at_once", "committed", &[1.0])]),
    );

    // 2. One replayed 40001, then success.
    let (result, calls) = call(&pool, policy, "after_one", &[serialization_failure]).await;
    assert_eq!(result.expect("succeeds on the second attempt"), 1);
    assert_eq!(calls, 2);
    assert_eq!(
        take(snapshotter),
        Metrics::from([
            attempts_histogram("after_one", "committed", &[2.0]),
            counter(SUCCESS_AFTER_RETRY, &[("function", "after_one")], 1),
            counter(
                FAILED_ATTEMPTS,
                &[
                    ("function", "after_one"),
                    ("cause", "serialization_failure")
                ],
                1,
            ),
        ]),
    );

    // 3. Two causes in one call, then success: failed attempts by cause.
    let (result, calls) = call(&pool, policy, "mixed", &[serialization_failure, deadlock]).await;
    assert_eq!(result.expect("succeeds on the third attempt"), 1);
    assert_eq!(calls, 3);
    assert_eq!(
        take(snapshotter),
        Metrics::from([
            attempts_histogram("mixed", "committed", &[3.0]),
            counter(SUCCESS_AFTER_RETRY, &[("function", "mixed")], 1),
            counter(
                FAILED_ATTEMPTS,
                &[("function", "mixed"), ("cause", "serialization_failure")],
                1,
            ),
            counter(
                FAILED_ATTEMPTS,
                &[("function", "mixed"), ("cause", "deadlock_detected")],
                1,
            ),
        ]),
    );

    // 4. Exhausts its budget of 3 attempts: 40001, 40001, then 40P01. The
    // exhausted counter carries the last cause; every failed attempt, the
    // last included, is counted by its own cause; no success after retry.
    let (result, calls) = call(
        &pool,
        policy,
        "exhausts",
        &[serialization_failure, serialization_failure, deadlock],
    )
    .await;
    match result {
        Err(AppError::Idem(idem_runtime::Error::Exhausted {
            attempts,
            last_cause,
            ..
        })) => {
            assert_eq!(attempts, 3);
            assert_eq!(last_cause, RetryCause::Deadlock);
        }
        other => panic!("expected an exhausted budget, got {other:?}"),
    }
    assert_eq!(calls, 3);
    assert_eq!(
        take(snapshotter),
        Metrics::from([
            attempts_histogram("exhausts", "exhausted", &[3.0]),
            counter(
                EXHAUSTED,
                &[("function", "exhausts"), ("cause", "deadlock_detected")],
                1,
            ),
            counter(
                FAILED_ATTEMPTS,
                &[("function", "exhausts"), ("cause", "serialization_failure")],
                2,
            ),
            counter(
                FAILED_ATTEMPTS,
                &[("function", "exhausts"), ("cause", "deadlock_detected")],
                1,
            ),
        ]),
    );

    // 5. A final (non-transient) error: one attempt sampled, nothing counted
    // as failed, retried or exhausted.
    let result: Result<(), AppError> = retry(&pool, policy, "final_error", |_conn| {
        async move { Err(AppError::Db(DieselError::NotFound)) }.scope_boxed()
    })
    .await;
    assert!(matches!(result, Err(AppError::Db(DieselError::NotFound))));
    assert_eq!(
        take(snapshotter),
        Metrics::from([attempts_histogram("final_error", "failed", &[1.0])]),
    );

    // The same function again accumulates under the same keys.
    for _ in 0..2 {
        let (result, _) = call(&pool, policy, "after_one", &[serialization_failure]).await;
        result.expect("succeeds on the second attempt");
    }
    let (result, _) = call(&pool, policy, "after_one", &[]).await;
    result.expect("succeeds at once");
    assert_eq!(
        take(snapshotter),
        Metrics::from([
            attempts_histogram("after_one", "committed", &[2.0, 2.0, 1.0]),
            counter(SUCCESS_AFTER_RETRY, &[("function", "after_one")], 2),
            counter(
                FAILED_ATTEMPTS,
                &[
                    ("function", "after_one"),
                    ("cause", "serialization_failure")
                ],
                2,
            ),
        ]),
    );

    // 7. No connection to be had: every attempt the budget allows tries to
    // set one up (nothing ran, so trying again is safe), and the call still
    // ends in the histogram with the pool's error (regression: a failed
    // checkout recorded nothing).
    let unreachable = build_pool_with(
        "postgres://postgres@127.0.0.1:1/none",
        &PoolConfig {
            max_size: 1,
            wait_timeout: Duration::from_millis(500),
            ..Default::default()
        },
    )
    .expect("build the pool");
    let (result, calls) = call(&unreachable, policy, "no_server", &[]).await;
    assert!(
        matches!(result, Err(AppError::Idem(idem_runtime::Error::Pool(_)))),
        "{result:?}"
    );
    assert_eq!(calls, 0);
    assert_eq!(
        take(snapshotter),
        Metrics::from([
            attempts_histogram("no_server", "pool_error", &[3.0]),
            counter(
                FAILED_ATTEMPTS,
                &[("function", "no_server"), ("cause", "connection_lost")],
                3,
            ),
            counter(
                EXHAUSTED,
                &[("function", "no_server"), ("cause", "connection_lost")],
                1,
            ),
        ]),
    );
    drop(pool);
    drop(db);
}

#[test]
fn the_retry_loop_reports_attempts_retries_and_exhaustion_by_cause() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    // One thread: the local recorder is the current thread's.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    metrics::with_local_recorder(&recorder, || runtime.block_on(scenario(&snapshotter)));
}
