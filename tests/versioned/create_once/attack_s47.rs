//! helper-51's hostile pass on migration 17 (`idem_create_once_guard` reading
//! the indexes as they are now). Every answer is checked against the rows in
//! the table. `attack47_*` are promises that held; `found_*` failed on the
//! code they were written against (ab37afb) and pass since migration 17
//! asks the planner instead of reading pg_index.

use super::attack_s46::{blocked_pid, count_sql, env46, indexed, loose};

use super::*;

/// `row.create_once` under the retry loop at `isolation`, 4 attempts.
async fn create_loose(
    pool: &Pool,
    isolation: Isolation,
    row: &LooseOrder,
) -> Result<Creation<LooseOrder>, AppError> {
    let policy = RetryPolicy::new()
        .isolation(isolation)
        .max_attempts(4)
        .deadline(Duration::from_secs(20));
    retry(pool, policy, "create_once", |conn| {
        async move { Ok(row.create_once(conn).await?) }.scope_boxed()
    })
    .await
}

async fn key_rows(env: &Env, key: &str) -> i64 {
    count_sql(
        env,
        &format!("SELECT 1 FROM loose_orders WHERE request_id = '{key}'"),
    )
    .await
}

const LOCK_INDEX_ROW: &str =
    "SELECT 1 FROM pg_index WHERE indexrelid = 'k'::regclass FOR KEY SHARE";

/// A session row-locks the key index's pg_index row (`SELECT .. FOR KEY
/// SHARE`: a lock, not a change; the index is untouched) and commits; a
/// plain `VACUUM pg_index` follows. The lock leaves the locker's xid in the
/// row's xmax (lock-only), committed, and the guard reads that as "the
/// catalog changed the index since the snapshot": every create, in every
/// fresh transaction, is a serialization failure (40001), the retry loop
/// spends its budget on it, and `check_create_once` refuses too. Only a
/// `VACUUM FREEZE` of pg_index (or 50 million transactions later) clears it.
/// Expected: `Created`, then `Existing`, one row under the new key. Failed 3
/// of 3 runs (direct and 1 of 1 through PgBouncer) on ab37afb; fixed since
/// (the guard asks the planner and reads no xmax).
#[tokio::test]
async fn found_a_committed_row_lock_on_pg_index_refuses_creates_until_freeze() {
    let env = indexed(2).await;
    let mut side = env.conn().await;
    side.batch_execute(&format!("BEGIN; {LOCK_INDEX_ROW}; COMMIT"))
        .await
        .unwrap();
    side.batch_execute("VACUUM pg_index").await.unwrap();
    let mut answers = Vec::new();
    for level in LEVELS {
        let answer = create_loose(&env.pool, level, &loose(2, "new")).await;
        answers.push(format!("{level:?}: {answer:?}"));
    }
    let mut conn = env.pool.get().await.unwrap();
    let check = idem::versioned::check_create_once::<LooseOrder>(&mut conn).await;
    let plain = format!("{:?}", loose(3, "new").create_once(&mut conn).await);
    let rows = key_rows(&env, "new").await;
    // What it takes to clear it: the guard passes after a VACUUM FREEZE.
    side.batch_execute("VACUUM FREEZE pg_index").await.unwrap();
    let after_freeze = format!("{:?}", loose(4, "frozen").create_once(&mut conn).await);
    assert!(
        after_freeze.starts_with("Ok(Created"),
        "after VACUUM FREEZE: {after_freeze}"
    );
    assert!(
        answers[0].contains(": Ok(Created")
            && answers[1..].iter().all(|a| a.contains(": Ok(Existing"))
            && check.is_ok()
            && plain.starts_with("Ok(Existing")
            && rows == 1,
        "under retry: {answers:#?}; check_create_once: {check:?}; plain: {plain}; rows: {rows}"
    );
}

/// Two sessions hold `FOR SHARE` on the index's pg_index row at once (a
/// multixact in its xmax, the lockers still running: the row is the
/// catalog's own). The guard takes the MultiXactId for a transaction id:
/// a create is refused while they hold it, and after they commit (until a
/// VACUUM of pg_index). Expected: `Created`. Failed 3 of 3 runs direct, 1 of 1 through PgBouncer (on this
/// cluster the multixact number maps to a committed xid; where it maps past
/// the next xid, pg_xact_status raises "transaction ID .. is in the future",
/// an untyped `Database` error: not reproduced, the counter cannot be moved
/// without pg_resetwal). Fixed since ab37afb: the guard reads no xmax.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_two_share_lockers_of_pg_index_refuse_creates() {
    let env = indexed(2).await;
    let lock = "BEGIN; SELECT 1 FROM pg_index WHERE indexrelid = 'k'::regclass FOR SHARE";
    let (mut a, mut b) = (env.conn().await, env.conn().await);
    a.batch_execute(lock).await.unwrap();
    b.batch_execute(lock).await.unwrap();
    let mut conn = env.pool.get().await.unwrap();
    let held = format!("{:?}", loose(2, "held").create_once(&mut conn).await);
    a.batch_execute("COMMIT").await.unwrap();
    b.batch_execute("COMMIT").await.unwrap();
    let after = format!("{:?}", loose(3, "after").create_once(&mut conn).await);
    let rows = count_sql(
        &env,
        "SELECT 1 FROM loose_orders WHERE request_id IN ('held', 'after')",
    )
    .await;
    assert!(
        held.starts_with("Ok(Created") && after.starts_with("Ok(Created") && rows == 2,
        "while held: {held}; after: {after}; rows: {rows}"
    );
}

/// A single `FOR KEY SHARE` locker still running (its xid in progress): the
/// guard passes, a repeat of the key is `Existing`, a new key `Created`.
#[tokio::test]
async fn attack47_a_running_row_lock_on_pg_index_lets_creates_through() {
    let env = indexed(2).await;
    let mut side = env.conn().await;
    side.batch_execute(&format!("BEGIN; {LOCK_INDEX_ROW}"))
        .await
        .unwrap();
    let mut conn = env.pool.get().await.unwrap();
    let repeat = loose(1, "k").create_once(&mut conn).await;
    assert!(matches!(repeat, Ok(Creation::Existing(_))), "{repeat:?}");
    let new = loose(2, "n").create_once(&mut conn).await;
    assert!(matches!(new, Ok(Creation::Created(_))), "{new:?}");
    side.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(
        (key_rows(&env, "k").await, key_rows(&env, "n").await),
        (1, 1)
    );
}

/// A `DROP INDEX` rolled back leaves the pg_index row with an aborted xmax:
/// the index is there, and the guard lets creates through (not refused
/// forever); the repeat of a taken key is `Existing`, one row.
#[tokio::test]
async fn attack47_an_aborted_drop_index_leaves_the_guard_passing() {
    let env = indexed(2).await;
    let mut side = env.conn().await;
    side.batch_execute("BEGIN; DROP INDEX k; ROLLBACK")
        .await
        .unwrap();
    assert_eq!(
        count_sql(
            &env,
            "SELECT 1 FROM pg_index WHERE indexrelid = 'k'::regclass AND xmax <> '0'"
        )
        .await,
        1,
        "the row keeps the aborted xmax"
    );
    for level in LEVELS {
        let repeat = create_loose(&env.pool, level, &loose(1, "k")).await;
        assert!(
            matches!(repeat, Ok(Creation::Existing(_))),
            "{level:?}: {repeat:?}"
        );
    }
    let mut conn = env.pool.get().await.unwrap();
    assert!(idem::versioned::check_create_once::<LooseOrder>(&mut conn)
        .await
        .is_ok());
    assert_eq!(key_rows(&env, "k").await, 1);
}

/// The "replace a column" migration: a new text column `alt` (unindexed)
/// takes the name `request_id`, the indexed one becomes `alt`, in one
/// transaction that commits after the creator's snapshot. The table then
/// has no unique index on `request_id` (a fresh guard says `NoUniqueIndex`),
/// but the guard reads pg_attribute's names through the older snapshot
/// (the pg_index row itself is untouched, its xmax 0), so it passes, and
/// the INSERT, planned with the current names, writes a second row under
/// 'k' (held by row 1 in the renamed column). `level` is the creator's
/// isolation: REPEATABLE READ / SERIALIZABLE with a snapshot taken before,
/// or READ COMMITTED with the INSERT queued behind the renames' lock.
/// Returns the answer and the rows under 'k'.
async fn create_across_a_column_swap(level: &str, prepared: bool) -> (String, i64) {
    let env = env46(2).await;
    let mut setup = env.conn().await;
    setup
        .batch_execute(
            "ALTER TABLE loose_orders ADD COLUMN alt text; \
             ALTER TABLE loose_orders ALTER COLUMN request_id DROP NOT NULL; \
             CREATE UNIQUE INDEX k ON loose_orders (request_id); \
             INSERT INTO loose_orders VALUES (1, 'x', 5, 0, 'k')",
        )
        .await
        .unwrap();
    let mut creator = env.pool.get().await.unwrap();
    if prepared {
        for n in 0..6 {
            let warm = loose(100 + n, &format!("warm{n}"));
            assert!(warm.create_once(&mut creator).await.unwrap().is_created());
        }
    }
    let swap = "BEGIN; ALTER TABLE loose_orders RENAME request_id TO tmp; \
                ALTER TABLE loose_orders RENAME alt TO request_id; \
                ALTER TABLE loose_orders RENAME tmp TO alt";
    let answer = if level == "READ COMMITTED" {
        setup.batch_execute(swap).await.unwrap();
        let call = tokio::spawn(async move {
            let answer = format!("{:?}", loose(2, "k").create_once(&mut creator).await);
            drop(creator);
            answer
        });
        blocked_pid(&env).await;
        setup.batch_execute("COMMIT").await.unwrap();
        call.await.unwrap()
    } else {
        let begin = format!("BEGIN ISOLATION LEVEL {level}; SELECT count(*) FROM shop_orders");
        creator.batch_execute(&begin).await.unwrap();
        setup.batch_execute(swap).await.unwrap();
        setup.batch_execute("COMMIT").await.unwrap();
        let answer = format!("{:?}", loose(2, "k").create_once(&mut creator).await);
        let _ = creator.batch_execute("COMMIT").await;
        answer
    };
    (answer, key_rows(&env, "k").await)
}

/// See `create_across_a_column_swap` (the old column made nullable first, as
/// a "stop writing it" step does). Expected at each: nothing written under
/// 'k' (a 40001 to replay, or `NoUniqueIndex`), one row. Got `Created` and
/// 2 rows under 'k' at REPEATABLE READ, SERIALIZABLE, and READ COMMITTED on
/// a connection whose INSERT was prepared (RC unprepared: `NoUniqueIndex`,
/// held). Failed 3 of 3 runs direct; through PgBouncer (no prepared
/// statements) 1 of 1, at REPEATABLE READ and SERIALIZABLE only. Fixed
/// since ab37afb: the guard asks the planner, which names the columns as
/// they are now (`NoUniqueIndex`). Without DROP NOT NULL the same creates pass the guard and stop only on
/// the old column's NOT NULL (an untyped `Database` error).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_a_column_swap_after_the_snapshot_writes_a_duplicate() {
    let mut failures = Vec::new();
    for (level, prepared) in [
        ("REPEATABLE READ", false),
        ("SERIALIZABLE", false),
        ("READ COMMITTED", false),
        ("READ COMMITTED", true),
    ] {
        let (answer, rows) = create_across_a_column_swap(level, prepared).await;
        eprintln!("{level} prepared={prepared}: {answer}; rows under 'k': {rows}");
        if rows != 1 || answer.starts_with("Ok(") {
            failures.push(format!(
                "{level} prepared={prepared}: {answer}; rows under 'k': {rows}"
            ));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// The same swap committed before the creator's snapshot: refused
/// (`NoUniqueIndex`), nothing written, at every level.
#[tokio::test]
async fn attack47_a_column_swap_before_the_snapshot_is_refused() {
    let env = env46(2).await;
    let mut setup = env.conn().await;
    setup
        .batch_execute(
            "ALTER TABLE loose_orders ADD COLUMN alt text; \
             ALTER TABLE loose_orders ALTER COLUMN request_id DROP NOT NULL; \
             CREATE UNIQUE INDEX k ON loose_orders (request_id); \
             INSERT INTO loose_orders VALUES (1, 'x', 5, 0, 'k'); \
             BEGIN; ALTER TABLE loose_orders RENAME request_id TO tmp; \
             ALTER TABLE loose_orders RENAME alt TO request_id; \
             ALTER TABLE loose_orders RENAME tmp TO alt; COMMIT",
        )
        .await
        .unwrap();
    for level in LEVELS {
        let answer = create_loose(&env.pool, level, &loose(2, "k")).await;
        assert!(
            matches!(
                answer,
                Err(AppError::Once(CreateOnceError::NoUniqueIndex { .. }))
            ),
            "{level:?}: {answer:?}"
        );
    }
    assert_eq!(key_rows(&env, "k").await, 1);
}
