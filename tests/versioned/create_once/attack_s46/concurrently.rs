//! `DROP INDEX CONCURRENTLY` of the key's index while a transaction whose
//! snapshot is older creates: the index stays in the catalog, first no
//! longer valid, then no longer maintained (not "ready"), until the drop
//! ends. In that second phase `ON CONFLICT DO NOTHING` no longer consults
//! it, so the guard must refuse the create, though the index still exists.

use super::*;

/// Polls (on side connections) until `sql` finds a row, for up to 10 s.
async fn until(env: &Env, sql: &str) {
    for _ in 0..200 {
        if count_sql(env, sql).await > 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("never: {sql}");
}

/// A transaction at REPEATABLE READ or SERIALIZABLE takes its snapshot (a
/// read of another table), then `DROP INDEX CONCURRENTLY` runs: it marks
/// the index invalid, waits for a first locker of the table, marks it not
/// ready, and waits for a second locker, which holds it in that phase. The
/// transaction then creates a key a row holds: refused (`NoUniqueIndex`:
/// the planner sees the index invalid), one row, and so again in a fresh
/// transaction. With migration 17's first form, which asked only whether the
/// catalog still held the index, the create passed the guard (its snapshot
/// sees the index valid and ready), and the INSERT, which checks only
/// indexes still maintained, wrote a second row under the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_in_an_older_snapshot_during_drop_index_concurrently_is_refused() {
    for level in ["REPEATABLE READ", "SERIALIZABLE"] {
        let env = indexed(2).await;
        let mut creator = env.pool.get().await.unwrap();
        let begin = format!("BEGIN ISOLATION LEVEL {level}; SELECT count(*) FROM shop_orders");
        creator.batch_execute(&begin).await.unwrap();
        let lock = "BEGIN; LOCK loose_orders IN ACCESS SHARE MODE";
        let (mut first, mut second) = (env.conn().await, env.conn().await);
        first.batch_execute(lock).await.unwrap();
        let mut dropper = env.conn().await;
        let drop =
            tokio::spawn(async move { dropper.batch_execute("DROP INDEX CONCURRENTLY k").await });
        until(
            &env,
            "SELECT FROM pg_index WHERE indexrelid = 'k'::regclass AND NOT indisvalid",
        )
        .await;
        second.batch_execute(lock).await.unwrap();
        first.batch_execute("COMMIT").await.unwrap();
        until(
            &env,
            "SELECT FROM pg_index WHERE indexrelid = 'k'::regclass AND NOT indisready",
        )
        .await;

        let answer = format!("{:?}", loose(2, "k").create_once(&mut creator).await);
        let _ = creator.batch_execute("COMMIT").await;
        // Replayed (a fresh transaction, the drop still in its second phase).
        creator.batch_execute(&begin).await.unwrap();
        let replayed = format!("{:?}", loose(3, "k").create_once(&mut creator).await);
        let _ = creator.batch_execute("COMMIT").await;
        second.batch_execute("COMMIT").await.unwrap();
        drop.await.unwrap().unwrap();
        let rows = count_sql(&env, "SELECT 1 FROM loose_orders WHERE request_id = 'k'").await;
        assert!(
            answer.contains("NoUniqueIndex") && replayed.contains("NoUniqueIndex") && rows == 1,
            "{level}: answered {answer}, replayed {replayed}; rows under 'k': {rows}"
        );
    }
}

/// A row lock on the index's row of `pg_index` (`SELECT .. FOR SHARE`, by
/// a monitoring query say) leaves its transaction's id in the row's xmax
/// after it commits. That is not a change of the index: creates go on, at
/// once and under the retry loop at REPEATABLE READ when the lock commits
/// after the body's snapshot. A form of migration 17 that read the row's
/// xmax read any committed one as a change, and refused (40001) every
/// create of the table from then on; the guard now asks the planner and
/// reads no xmax.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_lock_on_the_index_catalog_row_changes_nothing() {
    let env = unique_k(2).await;
    let lock_row = "BEGIN; SELECT FROM pg_index WHERE indexrelid = 'k'::regclass FOR SHARE; COMMIT";
    env.conn().await.batch_execute(lock_row).await.unwrap();
    let mut conn = env.pool.get().await.unwrap();
    let first = format!("{:?}", loose(1, "a").create_once(&mut conn).await);
    let check = idem::versioned::check_create_once::<LooseOrder>(&mut conn).await;
    assert!(
        first.starts_with("Ok(Created") && check.is_ok(),
        "{first}; check {check:?}"
    );

    let policy = RetryPolicy::new()
        .isolation(Isolation::RepeatableRead)
        .max_attempts(4)
        .deadline(Duration::from_secs(10));
    let pool = env.pool.clone();
    let call = tokio::spawn(async move {
        retry(&pool, policy, "lock", |c| {
            async move {
                diesel::sql_query("SELECT count(*) AS n FROM shop_orders")
                    .get_result::<Count>(c)
                    .await?;
                tokio::time::sleep(Duration::from_millis(400)).await;
                Ok::<_, AppError>(loose(2, "b").create_once(c).await?)
            }
            .scope_boxed()
        })
        .await
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    env.conn().await.batch_execute(lock_row).await.unwrap();
    let answer = format!("{:?}", call.await.unwrap());
    let rows = count_sql(&env, "SELECT 1 FROM loose_orders").await;
    assert!(
        answer.starts_with("Ok(Created") && rows == 2,
        "{answer}; rows {rows}"
    );
}
