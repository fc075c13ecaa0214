//! helper-50: a creator waiting on a concurrent uncommitted duplicate, and
//! what happens to it when the winner rolls back, holds past a deadline, or
//! the creator's own future or backend dies; and the `#[retryable]` shape.

use std::time::Instant;

use super::*;

fn policy(isolation: Isolation, deadline: Duration) -> RetryPolicy {
    RetryPolicy::new()
        .isolation(isolation)
        .max_attempts(8)
        .deadline(deadline)
}

async fn key_rows(env: &Env, key: &str) -> i64 {
    count_sql(
        env,
        &format!("SELECT 1 FROM shop_orders WHERE request_id = '{key}'"),
    )
    .await
}

/// A winner that rolls back at every level: the loser, waiting on the
/// unique index, then creates (`Created`, its own row). A winner that
/// commits: the loser gets its row (`Existing`), replayed at RR/SERIALIZABLE.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn attack46_loser_after_a_winner_rolls_back_or_commits() {
    let env = env46(4).await;
    for (n, isolation) in LEVELS.into_iter().enumerate() {
        for commit in [false, true] {
            let key = format!("wait-{n}-{commit}");
            let id = 10 * n as i64 + i64::from(commit);
            let mut winner = holder(&env, id, &key, 50).await;
            let pool = env.pool.clone();
            let asked = order(1, id, &key, 50);
            let loser = tokio::spawn(async move { create(&pool, isolation, &asked).await });
            blocked_pid(&env).await;
            winner
                .batch_execute(if commit { "COMMIT" } else { "ROLLBACK" })
                .await
                .unwrap();
            let answer = loser.await.unwrap();
            match (&answer, commit) {
                (Ok(Creation::Created(row)), false) | (Ok(Creation::Existing(row)), true) => {
                    assert_eq!((row.id, row.amount, row.version), (id, 50, 0))
                }
                _ => panic!("{isolation:?}, winner committed: {commit}: {answer:?}"),
            }
            assert_eq!(key_rows(&env, &key).await, 1, "{isolation:?} {commit}");
        }
    }
}

async fn bounded(
    c: &mut AsyncPgConnection,
    setting: &str,
    key: String,
) -> Result<Creation<ShopOrder>, AppError> {
    c.batch_execute(&format!("SET LOCAL {setting} = '300ms'"))
        .await?;
    Ok(order(1, 1, &key, 5).create_once(c).await?)
}

/// A loser whose own `statement_timeout` runs out while the winner holds its
/// transaction open: a typed `Database` error, on time, nothing written; the
/// winner then rolls back and the same connection creates the row.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn attack46_statement_timeout_while_waiting_is_a_database_error() {
    let env = env46(2).await;
    for setting in ["statement_timeout", "lock_timeout"] {
        let key = format!("slow-{setting}");
        let mut winner = holder(&env, 1, &key, 5).await;
        let mut pooled = env.pool.get().await.unwrap();
        let conn: &mut AsyncPgConnection = &mut pooled;
        let started = Instant::now();
        let answer = conn
            .transaction::<_, AppError, _>(async |c| bounded(c, setting, key.clone()).await)
            .await;
        assert!(started.elapsed() < Duration::from_secs(3));
        assert!(
            matches!(answer, Err(AppError::Once(CreateOnceError::Database(_)))),
            "{setting}: {answer:?}"
        );
        winner.batch_execute("ROLLBACK").await.unwrap();
        assert_eq!(key_rows(&env, &key).await, 0);
        assert!(order(1, 1, &key, 5)
            .create_once(conn)
            .await
            .unwrap()
            .is_created());
        conn.batch_execute(&format!(
            "DELETE FROM shop_orders WHERE request_id = '{key}'"
        ))
        .await
        .unwrap();
    }
}

/// Under the retry loop the wait is bounded by the call's deadline: a winner
/// that holds for 4 s makes a 1 s call fail by about 1 s, typed, nothing
/// written; and the pool goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn attack46_retry_deadline_bounds_the_wait_on_a_held_duplicate() {
    let env = env46(2).await;
    for (n, isolation) in LEVELS.into_iter().enumerate() {
        let key = format!("held-{isolation:?}");
        let mut winner = holder(&env, n as i64, &key, 5).await;
        let started = Instant::now();
        let row = order(1, n as i64, &key, 5);
        let answer = retry(
            &env.pool,
            policy(isolation, Duration::from_secs(1)),
            "held",
            |c| {
                let row = row.clone();
                async move { Ok::<_, AppError>(row.create_once(&mut *c).await?) }.scope_boxed()
            },
        )
        .await;
        let took = started.elapsed();
        assert!(answer.is_err(), "{isolation:?}: {answer:?}");
        assert!(
            took < Duration::from_millis(2500),
            "{isolation:?}: took {took:?}"
        );
        winner.batch_execute("ROLLBACK").await.unwrap();
        assert_eq!(key_rows(&env, &key).await, 0);
        assert!(create(&env.pool, isolation, &row)
            .await
            .unwrap()
            .is_created());
    }
}

/// A retry call dropped while its INSERT waits on the winner; the winner
/// then rolls back, so the server-side INSERT goes through inside the
/// dropped call's transaction. That transaction must never commit, and the
/// pool (one connection) must answer the next caller with its own row.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn attack46_a_dropped_call_commits_nothing_and_the_pool_goes_on() {
    let env = env46(1).await;
    for isolation in LEVELS {
        let key = format!("dropped-{isolation:?}");
        let mut winner = holder(&env, 1, &key, 5).await;
        let pool = env.pool.clone();
        let row = order(1, 1, &key, 5);
        let call = tokio::spawn(async move { create(&pool, isolation, &row).await });
        blocked_pid(&env).await;
        call.abort();
        assert!(call.await.unwrap_err().is_cancelled());
        winner.batch_execute("ROLLBACK").await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let next = format!("next-{isolation:?}");
        match create(&env.pool, isolation, &order(1, 2, &next, 6)).await {
            Ok(Creation::Created(r)) => {
                assert_eq!((r.id, r.request_id.as_str()), (2, next.as_str()))
            }
            other => panic!("{isolation:?}: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(
            key_rows(&env, &key).await,
            0,
            "{isolation:?}: the dropped call committed"
        );
        assert_eq!(key_rows(&env, &next).await, 1);
        env.conn()
            .await
            .batch_execute("DELETE FROM shop_orders")
            .await
            .unwrap();
    }
}

/// The same drop on a pooled connection outside any transaction, the winner
/// committing: the next user of that connection (pool of one) gets answers
/// to its own statements: a new key `Created` with its own row, the winner's
/// key `Existing` with the winner's row.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn attack46_a_dropped_autocommit_create_leaves_no_stale_answer() {
    let env = env46(1).await;
    let mut winner = holder(&env, 1, "w", 5).await;
    let pool = env.pool.clone();
    let call = tokio::spawn(async move {
        let mut conn = pool.get().await.unwrap();
        order(1, 1, "w", 5).create_once(&mut conn).await
    });
    blocked_pid(&env).await;
    call.abort();
    let _ = call.await;
    winner.batch_execute("COMMIT").await.unwrap();
    let mut conn = env.pool.get().await.unwrap();
    match order(1, 2, "mine", 6).create_once(&mut conn).await {
        Ok(Creation::Created(r)) => assert_eq!((r.id, r.request_id.as_str()), (2, "mine")),
        other => panic!("{other:?}"),
    }
    match order(1, 1, "w", 5).create_once(&mut conn).await {
        Ok(Creation::Existing(r)) => assert_eq!((r.id, r.request_id.as_str()), (1, "w")),
        other => panic!("{other:?}"),
    }
    assert_eq!(count_sql(&env, "SELECT 1 FROM shop_orders").await, 2);
}

/// The waiting creator's backend terminated (`pg_terminate_backend`) under
/// the retry loop: the retryable docs replay a lost connection on a fresh
/// one, so after the winner rolls back the call ends `Created`, one row.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn attack46_a_terminated_backend_is_replayed_to_created() {
    let env = env46(2).await;
    for (n, isolation) in LEVELS.into_iter().enumerate() {
        let key = format!("killed-{isolation:?}");
        let mut winner = holder(&env, n as i64, &key, 5).await;
        let pool = env.pool.clone();
        let row = order(1, n as i64, &key, 5);
        let call = tokio::spawn(async move { create(&pool, isolation, &row).await });
        let pid = blocked_pid(&env).await;
        env.conn()
            .await
            .batch_execute(&format!("SELECT pg_terminate_backend({pid})"))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        winner.batch_execute("ROLLBACK").await.unwrap();
        let answer = tokio::time::timeout(Duration::from_secs(30), call)
            .await
            .expect("the call hung")
            .unwrap();
        assert!(
            matches!(answer, Ok(Creation::Created(_))),
            "{isolation:?}: {answer:?}"
        );
        assert_eq!(key_rows(&env, &key).await, 1);
    }
}

#[retryable(max = 8, deadline_ms = 20000, isolation = repeatable_read)]
async fn create_rr(
    conn: &mut AsyncPgConnection,
    row: &ShopOrder,
) -> Result<Creation<ShopOrder>, AppError> {
    Ok(row.create_once(conn).await?)
}

/// `#[retryable]` at REPEATABLE READ, 8 racers, 4 of them with another
/// amount: one `Created`, the same requests `Existing`, the others
/// `Mismatch { ["amount"] }` (not replayed into something else), one row.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn attack46_retryable_fn_race_at_repeatable_read() {
    let env = env46(8).await;
    let barrier = Arc::new(Barrier::new(8));
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let (pool, barrier) = (env.pool.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let row = order(1, 1, "rr", 10 + i % 2);
                (row.amount, create_rr(&pool, &row).await)
            })
        })
        .collect();
    let mut results = Vec::new();
    for task in tasks {
        results.push(task.await.unwrap());
    }
    let winner = results
        .iter()
        .find_map(|(_, r)| match r {
            Ok(Creation::Created(row)) => Some(row.amount),
            _ => None,
        })
        .expect("nobody created");
    let mut created = 0;
    for (amount, result) in &results {
        match result {
            Ok(Creation::Created(_)) => created += 1,
            Ok(Creation::Existing(row)) => assert_eq!((row.amount, *amount), (winner, winner)),
            Err(AppError::Once(CreateOnceError::Mismatch { fields })) => {
                assert_ne!(*amount, winner);
                assert_eq!(fields, &["amount"]);
            }
            Err(e) => panic!("{e:?}"),
        }
    }
    assert_eq!(created, 1, "{results:?}");
    assert_eq!(count_sql(&env, "SELECT 1 FROM shop_orders").await, 1);
}

/// 8 tasks, each on its own pooled connection outside any transaction, 15
/// new keys and a repeat of each: every answer `Created` then `Existing`,
/// 120 rows. Run it behind PgBouncer (`IDEM_TEST_VIA=pgbouncer`) too, where
/// the docs say idem prepares nothing.
async fn autocommit_creates_on_pooled_connections() -> Vec<String> {
    let env = env46(8).await;
    let barrier = Arc::new(Barrier::new(8));
    let tasks: Vec<_> = (0..8i64)
        .map(|t| {
            let (pool, barrier) = (env.pool.clone(), barrier.clone());
            tokio::spawn(async move {
                let mut conn = pool.get().await.unwrap();
                barrier.wait().await;
                let mut wrong = Vec::new();
                for k in 0..15i64 {
                    let row = order(1, t * 100 + k, &format!("a{t}-{k}"), k);
                    match row.create_once(&mut conn).await {
                        Ok(Creation::Created(r)) if r.id == row.id => {}
                        other => wrong.push(format!("{t}/{k} first: {other:?}")),
                    }
                    match row.create_once(&mut conn).await {
                        Ok(Creation::Existing(r)) if r.id == row.id => {}
                        other => wrong.push(format!("{t}/{k} repeat: {other:?}")),
                    }
                }
                wrong
            })
        })
        .collect();
    let mut wrong = Vec::new();
    for task in tasks {
        wrong.extend(task.await.unwrap());
    }
    let rows = count_sql(&env, "SELECT 1 FROM shop_orders").await;
    if rows != 120 {
        wrong.push(format!("{rows} rows, not 120"));
    }
    wrong
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn attack46_autocommit_creates_on_pooled_connections() {
    if idem_testing::Via::from_env()
        .unwrap()
        .is_transaction_pooling()
    {
        return; // documented: keep to transactions behind a transaction pooler
    }
    let wrong = autocommit_creates_on_pooled_connections().await;
    assert!(wrong.is_empty(), "{wrong:#?}");
}

/// 8 creators, under the retry loop, all waiting on one uncommitted winner
/// that then rolls back, at every level: exactly one of them creates, the
/// other seven get its row, one row under the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn attack46_eight_waiters_on_a_winner_that_rolls_back() {
    let env = env46(8).await;
    for (n, isolation) in LEVELS.into_iter().enumerate() {
        let key = format!("herd-{n}");
        let id = 40 + n as i64;
        let mut winner = holder(&env, id, &key, 9).await;
        let tasks: Vec<_> = (0..8)
            .map(|_| {
                let pool = env.pool.clone();
                let row = order(1, id, &key, 9);
                tokio::spawn(async move { create(&pool, isolation, &row).await })
            })
            .collect();
        for _ in 0..500 {
            let waiting = count_sql(
                &env,
                "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
            )
            .await;
            if waiting == 8 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        winner.batch_execute("ROLLBACK").await.unwrap();
        let (mut created, mut existing) = (0, 0);
        for task in tasks {
            match task.await.unwrap() {
                Ok(Creation::Created(r)) => {
                    assert_eq!((r.id, r.amount), (id, 9));
                    created += 1
                }
                Ok(Creation::Existing(r)) => {
                    assert_eq!((r.id, r.amount), (id, 9));
                    existing += 1
                }
                Err(e) => panic!("{isolation:?}: {e:?}"),
            }
        }
        assert_eq!((created, existing), (1, 7), "{isolation:?}");
        assert_eq!(key_rows(&env, &key).await, 1);
    }
}

/// An `#[idempotent]` local-mode call (mod.rs's `create_recorded`,
/// SERIALIZABLE) dropped while its create waits on an uncommitted winner
/// that then rolls back: its record and its row never commit, and the same
/// call key, sent again, runs and creates (not held, not replayed), within
/// its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn attack46_a_dropped_idempotent_call_holds_nothing() {
    let env = env46(2).await;
    let mut winner = holder(&env, 9, "idem-drop", 70).await;
    // holder writes tenant 1; the call's row is tenant 1 too.
    let pool = env.pool.clone();
    let call =
        tokio::spawn(
            async move { create_recorded(&pool, "cx", &order(1, 9, "idem-drop", 70)).await },
        );
    blocked_pid(&env).await;
    call.abort();
    let _ = call.await;
    winner.batch_execute("ROLLBACK").await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(count_sql(&env, "SELECT 1 FROM idem_requests").await, 0);
    assert_eq!(key_rows(&env, "idem-drop").await, 0);
    let again = tokio::time::timeout(
        Duration::from_secs(15),
        create_recorded(&env.pool, "cx", &order(1, 9, "idem-drop", 70)),
    )
    .await
    .expect("the repeat hung")
    .unwrap();
    assert_eq!((again.value, again.replayed), ((9, true), false));
    assert_eq!(key_rows(&env, "idem-drop").await, 1);
    assert_eq!(count_sql(&env, "SELECT 1 FROM idem_requests").await, 1);
}

/// 12 racers on a pool of 8, one key, each its own id (the fingerprint is
/// the amount alone), under the retry loop at every level: one `Created`,
/// eleven `Existing` with the creator's row, one row.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn attack46_racers_with_their_own_ids_meet_on_the_key() {
    let env = unique_k(8).await;
    for (n, isolation) in LEVELS.into_iter().enumerate() {
        let key = format!("own-ids-{n}");
        let barrier = Arc::new(Barrier::new(12));
        let tasks: Vec<_> = (0..12i64)
            .map(|i| {
                let (pool, barrier, key) = (env.pool.clone(), barrier.clone(), key.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    let row = loose(100 * n as i64 + i, &key);
                    retry(
                        &pool,
                        policy(isolation, Duration::from_secs(20)),
                        "own",
                        |c| {
                            let row = row.clone();
                            async move { Ok::<_, AppError>(row.create_once(c).await?) }
                                .scope_boxed()
                        },
                    )
                    .await
                })
            })
            .collect();
        let mut answers = Vec::new();
        for task in tasks {
            answers.push(
                task.await
                    .unwrap()
                    .unwrap_or_else(|e| panic!("{isolation:?}: {e:?}")),
            );
        }
        let created: Vec<_> = answers.iter().filter(|a| a.is_created()).collect();
        assert_eq!(created.len(), 1, "{isolation:?}: {answers:?}");
        assert!(
            answers.iter().all(|a| a.row() == created[0].row()),
            "{isolation:?}"
        );
        let rows = count_sql(
            &env,
            &format!("SELECT 1 FROM loose_orders WHERE request_id = '{key}'"),
        )
        .await;
        assert_eq!(rows, 1);
    }
}

#[idempotent(key = call_key, scope = "create_once_s46", fingerprint(row.request_id))]
#[retryable(max = 4, deadline_ms = 10000, isolation = serializable)]
async fn create_loose_recorded(
    conn: &mut AsyncPgConnection,
    call_key: &str,
    row: &LooseOrder,
) -> Result<i64, AppError> {
    Ok(row.create_once(conn).await?.row().id)
}

/// `NoUniqueIndex` inside an `#[idempotent]` local-mode call (its
/// transaction aborted by the guard): the caller gets that error, typed,
/// not one about the aborted transaction or its COMMIT; no record and no
/// row; once the index exists, the same call key runs and creates.
#[tokio::test]
async fn attack46_no_unique_index_inside_an_idempotent_call_is_typed() {
    let env = env46(2).await;
    for _ in 0..2 {
        match create_loose_recorded(&env.pool, "g1", &loose(1, "unguarded")).await {
            Err(AppError::Once(CreateOnceError::NoUniqueIndex { .. })) => {}
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(count_sql(&env, "SELECT 1 FROM idem_requests").await, 0);
    assert_eq!(count_sql(&env, "SELECT 1 FROM loose_orders").await, 0);
    env.conn()
        .await
        .batch_execute("CREATE UNIQUE INDEX k ON loose_orders (request_id)")
        .await
        .unwrap();
    let done = create_loose_recorded(&env.pool, "g1", &loose(1, "unguarded"))
        .await
        .unwrap();
    assert_eq!((done.value, done.replayed), (1, false));
    assert_eq!(count_sql(&env, "SELECT 1 FROM loose_orders").await, 1);
}
