//! Racers under the retry loop while the key's index is rebuilt or swapped.

use super::*;

/// `create_once` of `row` under the retry loop at `isolation`.
async fn create48(
    pool: &Pool,
    isolation: Isolation,
    row: &P48Order,
) -> Result<Creation<P48Order>, AppError> {
    let policy = RetryPolicy::new()
        .isolation(isolation)
        .max_attempts(12)
        .deadline(Duration::from_secs(30));
    retry(pool, policy, "create_once", |conn| {
        async move { Ok(row.create_once(conn).await?) }.scope_boxed()
    })
    .await
}

const KEYS: i64 = 40;
const RACERS: i64 = 8;

/// 8 racers create keys k0..k39 in tenants 1 and 2 (each racer its own
/// ids) at `isolation` while a side session runs `ddl` in a loop; returns
/// the answers that were not Created/Existing, and (Created, rows, duplicate
/// keys) counted in the table.
async fn race_against(
    env: &Env,
    isolation: Isolation,
    ddl: &'static [&'static str],
) -> (Vec<String>, i64, i64, i64) {
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let side = {
        let (stop, mut conn) = (stop.clone(), env.conn().await);
        tokio::spawn(async move {
            let mut rounds = 0;
            while !std::sync::atomic::AtomicBool::load(&stop, std::sync::atomic::Ordering::Relaxed)
                || rounds < 2
            {
                for statement in ddl {
                    conn.batch_execute(statement).await.unwrap();
                }
                rounds += 1;
            }
            rounds
        })
    };
    let barrier = Arc::new(Barrier::new(RACERS as usize));
    let racers: Vec<_> = (0..RACERS)
        .map(|racer| {
            let (pool, barrier) = (env.pool.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let mut out = Vec::new();
                for key in 0..KEYS {
                    for tenant in [1, 2] {
                        let row = p48(tenant, racer * 1000 + key, &format!("k{key}"));
                        out.push(create48(&pool, isolation, &row).await);
                    }
                }
                out
            })
        })
        .collect();
    let (mut odd, mut created) = (Vec::new(), 0);
    for racer in racers {
        for answer in racer.await.unwrap() {
            match answer {
                Ok(Creation::Created(_)) => created += 1,
                Ok(Creation::Existing(_)) => {}
                other => odd.push(format!("{other:?}")),
            }
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    side.await.unwrap();
    let rows = count_sql(env, "SELECT 1 FROM p48_orders").await;
    let dups = count_sql(
        env,
        "SELECT 1 FROM p48_orders GROUP BY tenant_id, request_id HAVING count(*) > 1",
    )
    .await;
    (odd, created, rows, dups)
}

const SWAP: &[&str] = &[
    "CREATE UNIQUE INDEX CONCURRENTLY p48_new ON p48_orders (tenant_id, request_id)",
    "DROP INDEX CONCURRENTLY p48_old",
    "ALTER INDEX p48_new RENAME TO p48_old",
];

/// At each isolation level, 8 racers under `idem::retry::retry` while the
/// key's unique index is swapped in a loop (CREATE UNIQUE INDEX
/// CONCURRENTLY a twin, DROP INDEX CONCURRENTLY the old one, rename): one
/// row per tenant and key, each created by exactly one racer, every other
/// answer `Existing`; and the same while `REINDEX INDEX CONCURRENTLY` runs
/// in a loop. Direct and through PgBouncer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack48_index_swaps_and_reindex_under_racers_write_no_duplicate() {
    for (n, level) in LEVELS.into_iter().enumerate() {
        for ddl in [SWAP, &["REINDEX INDEX CONCURRENTLY p48_old"]] {
            let env = env48(
                RACERS as usize + 1,
                "CREATE TABLE p48_orders (tenant_id bigint NOT NULL, id bigint NOT NULL,
                     request_id text NOT NULL, amount bigint NOT NULL,
                     version bigint NOT NULL DEFAULT 0, PRIMARY KEY (tenant_id, id));
                 CREATE UNIQUE INDEX p48_old ON p48_orders (tenant_id, request_id)",
            )
            .await;
            let (odd, created, rows, dups) = race_against(&env, level, ddl).await;
            assert!(
                odd.is_empty() && dups == 0 && rows == 2 * KEYS && created == rows,
                "{n} {level:?} {ddl:?}: odd {odd:#?}; created {created}; rows {rows}; duplicate keys {dups}"
            );
        }
    }
}

/// The key column and an unindexed twin swap names in a loop, one
/// autocommitted RENAME at a time (so between them `request_id` is the
/// unindexed column, or missing), while 8 racers create at each isolation
/// level. Whatever a racer is answered (Created, Existing, `NoUniqueIndex`
/// or the database's "column does not exist"), no row is ever written
/// while `request_id` names the twin (the twin holds '' in every row) and
/// no key has two rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack48_a_column_rename_loop_under_racers_writes_nothing_unguarded() {
    const ROTATE: &[&str] = &[
        "ALTER TABLE p48_orders RENAME COLUMN request_id TO tmp48",
        "ALTER TABLE p48_orders RENAME COLUMN twin TO request_id",
        "ALTER TABLE p48_orders RENAME COLUMN tmp48 TO twin",
    ];
    for level in LEVELS {
        let env = env48(
            RACERS as usize + 1,
            "CREATE TABLE p48_orders (tenant_id bigint NOT NULL, id bigint NOT NULL,
                 request_id text NOT NULL DEFAULT '', amount bigint NOT NULL,
                 version bigint NOT NULL DEFAULT 0, twin text NOT NULL DEFAULT '',
                 PRIMARY KEY (tenant_id, id), UNIQUE (tenant_id, request_id))",
        )
        .await;
        // An even number of rotations leaves the names as they were.
        let (odd, _created, rows, _) =
            race_against(&env, level, [ROTATE, ROTATE].concat().leak()).await;
        eprintln!(
            "{level:?}: {} refused of {}, {rows} rows",
            odd.len(),
            RACERS * KEYS * 2
        );
        let unexpected: Vec<&String> = odd
            .iter()
            .filter(|a| !a.contains("NoUniqueIndex") && !a.contains("does not exist"))
            .collect();
        // Which column is indexed now: the one named in the index.
        let indexed = count_sql(
            &env,
            "SELECT 1 FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid
             AND a.attnum = i.indkey[1] WHERE i.indrelid = 'p48_orders'::regclass
             AND i.indnatts = 2 AND a.attname = 'request_id'",
        )
        .await;
        let unguarded = count_sql(
            &env,
            &format!(
                "SELECT 1 FROM p48_orders WHERE {} <> ''",
                if indexed == 1 { "twin" } else { "request_id" }
            ),
        )
        .await;
        let dups = count_sql(
            &env,
            "SELECT 1 FROM p48_orders GROUP BY tenant_id, request_id, twin HAVING count(*) > 1",
        )
        .await;
        assert!(
            unexpected.is_empty() && unguarded == 0 && dups == 0 && rows > 0,
            "{level:?}: unexpected {unexpected:#?}; rows {rows}; unguarded {unguarded}; dups {dups}; odd {}",
            odd.len()
        );
    }
}
