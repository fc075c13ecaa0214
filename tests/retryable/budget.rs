//! The budget: the deadline and the backoff cap.

use super::*;

// ---------------------------------------------------------------------------
// The budget: deadline and backoff cap
// ---------------------------------------------------------------------------

const DEADLINE: Duration = Duration::from_millis(600);
const ATTEMPT_TIME: Duration = Duration::from_millis(100);
/// Room for checkouts, BEGIN and ROLLBACK on a loaded machine.
const SLACK: Duration = Duration::from_millis(1500);

#[retryable(max = 1000, deadline_ms = 600)]
async fn always_busy(conn: &mut AsyncPgConnection, calls: &AtomicU32) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    diesel::sql_query("SELECT pg_sleep(0.1)")
        .execute(conn)
        .await?;
    fail_with(conn, RetryCause::SerializationFailure).await
}

#[tokio::test]
async fn the_deadline_is_never_exceeded_by_more_than_one_attempt() {
    let env = env(2).await;
    let calls = AtomicU32::new(0);
    let started = Instant::now();
    let result = always_busy(&env.pool, &calls).await;
    let elapsed = started.elapsed();
    // The last attempt may be cut short by the server at the deadline
    // (its statement_timeout is the time left when it began).
    let Err(AppError::Idem(idem::Error::Exhausted {
        attempts,
        elapsed: reported,
        last_cause: RetryCause::SerializationFailure | RetryCause::DeadlineExceeded,
    })) = result
    else {
        panic!("expected exhaustion, got {result:?}")
    };
    assert_eq!(attempts, count(&calls));
    // Each attempt but the last takes at least 100 ms and none starts at or
    // after 600 ms.
    assert!((2..=6).contains(&attempts), "{attempts} attempts");
    // It gave up because the next backoff (at most 150 ms) would cross the deadline.
    assert!(
        reported + Duration::from_millis(150) >= DEADLINE,
        "{reported:?}"
    );
    assert!(reported <= elapsed);
    assert!(
        elapsed <= DEADLINE + ATTEMPT_TIME + SLACK,
        "{elapsed:?} for a {DEADLINE:?} deadline"
    );
    env.assert_pool_clean().await;
}

/// Fails at once, with a backoff of up to 10 s: no sleep may cross the 500 ms deadline.
#[retryable(
    max = 1000,
    deadline_ms = 500,
    backoff_base_ms = 10000,
    backoff_cap_ms = 10000
)]
async fn busy_with_long_backoff(conn: &mut AsyncPgConnection) -> Result<(), AppError> {
    backend_pid(conn).await?;
    fail_with(conn, RetryCause::Deadlock).await
}

#[tokio::test]
async fn no_backoff_sleeps_across_the_deadline() {
    let env = env(2).await;
    for _ in 0..5 {
        let started = Instant::now();
        let result = busy_with_long_backoff(&env.pool).await;
        let elapsed = started.elapsed();
        assert!(is_exhausted(&result, RetryCause::Deadlock), "{result:?}");
        assert!(
            elapsed <= Duration::from_millis(500) + SLACK,
            "slept across the deadline: {elapsed:?}"
        );
    }
}

/// Fails at once 100 times; backoff starts at 1 ms and is capped at 2 ms.
#[retryable(
    max = 100,
    deadline_ms = 120000,
    backoff_base_ms = 1,
    backoff_cap_ms = 2
)]
async fn busy_with_small_cap(
    conn: &mut AsyncPgConnection,
    calls: &AtomicU32,
) -> Result<(), AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    backend_pid(conn).await?;
    fail_with(conn, RetryCause::SerializationFailure).await
}

#[tokio::test]
async fn backoff_never_exceeds_the_cap() {
    let env = env(2).await;
    let calls = AtomicU32::new(0);
    let started = Instant::now();
    let result = busy_with_small_cap(&env.pool, &calls).await;
    let elapsed = started.elapsed();
    assert!(
        matches!(
            result,
            Err(AppError::Idem(idem::Error::Exhausted { attempts: 100, .. }))
        ),
        "{result:?}"
    );
    assert_eq!(count(&calls), 100);
    // 99 sleeps of at most 2 ms. Uncapped, the ceiling doubles from 1 ms and
    // passes 17 minutes by the 21st attempt.
    assert!(
        elapsed < Duration::from_secs(15),
        "99 capped sleeps took {elapsed:?}"
    );
    env.assert_pool_clean().await;
}
