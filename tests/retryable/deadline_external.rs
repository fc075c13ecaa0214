//! The deadline in external idempotent mode: the outside call holds nothing
//! of the database, so its time is not charged to the transaction that
//! records its outcome; and a duplicate's wait for the first request is
//! bounded by `wait_ms`, not cut short by the deadline.

use idem::{idempotent, Deferred};

use super::*;

// No error of these tests is final.
idem::final_errors!(AppError);

/// The outside call takes `outside` with nothing open; then the outcome and
/// a local write commit together. `#[idempotent]` alone: one attempt, the
/// default 800 ms deadline.
#[idempotent(key = key, operation = "deadline.send", fingerprint(key), mode = external, wait_ms = 10000, scope = none)]
async fn send(db: &mut Deferred<'_>, key: &str, outside: Duration) -> Result<i64, AppError> {
    assert!(!db.is_open());
    tokio::time::sleep(outside).await;
    let conn = db.conn().await?;
    insert_item(conn, 700).await?;
    Ok(700)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_outside_call_longer_than_the_deadline_is_still_recorded() {
    let env = Arc::new(env(4).await);
    let mut conn = AsyncPgConnection::establish(env.db.url()).await.unwrap();
    idem::migrate(&mut conn).await.expect("migrate");

    // Longer than the whole 800 ms deadline.
    let outside = Duration::from_millis(1200);
    let first = {
        let env = env.clone();
        tokio::spawn(async move { send(&env.pool, "k-1", outside).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    // A duplicate waits for the first request, longer than its deadline.
    let duplicate = send(&env.pool, "k-1", Duration::ZERO).await;
    let first = first.await.unwrap();

    let first = first.expect("the outcome of the outside call was recorded");
    assert_eq!((first.value, first.replayed), (700, false));
    let duplicate = duplicate.expect("the duplicate waited for the first request");
    assert_eq!((duplicate.value, duplicate.replayed), (700, true));
    assert_eq!(
        env.scalar_i64("SELECT count(*) FROM items WHERE id = 700")
            .await,
        1
    );
    assert_eq!(
        env.scalar_i64("SELECT count(*) FROM idem_requests WHERE state = 'completed'")
            .await,
        1
    );
    env.assert_pool_clean().await;
}
