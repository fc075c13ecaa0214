//! `create_once`: seed 003's first layer, the idempotency key on the business
//! row. Concurrent creators at each isolation level, repeats with other
//! fields, tenants, the unique index it needs, a NULL key, and a create
//! inside an `#[idempotent]` call. Rows are counted in the table.

use std::sync::Arc;
use std::time::Duration;

use diesel::prelude::*;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idem::http::HttpStatus;
use idem::retry::retry;
use idem::{
    idempotent, retryable, CreateOnceError, Creation, Isolation, Pool, RetryPolicy, Versioned,
};
use scoped_futures::ScopedFutureExt;
use tokio::sync::Barrier;

mod attack_s46;
mod attack_s47;
mod attack_s48;
mod guard;
mod limits;

diesel::table! {
    shop_orders (tenant_id, id) {
        tenant_id -> Int8,
        id -> Int8,
        request_id -> Text,
        amount -> Int8,
        note -> Nullable<Text>,
        status -> Text,
        version -> Int8,
    }
}

diesel::table! {
    loose_orders (id) {
        id -> Int8,
        request_id -> Text,
        amount -> Int8,
        version -> Int8,
    }
}

diesel::table! {
    keyed_notes (id) {
        id -> Int8,
        request_id -> Nullable<Text>,
        body -> Text,
        version -> Int8,
    }
}

const SCHEMA: &str = "
CREATE TABLE shop_orders (
    tenant_id bigint NOT NULL,
    id bigint NOT NULL,
    request_id text NOT NULL,
    amount bigint NOT NULL,
    note text,
    status text NOT NULL DEFAULT 'pending',
    version bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant_id, id),
    CONSTRAINT uk_idempotent_key UNIQUE (tenant_id, request_id));
CREATE TABLE loose_orders (
    id bigint PRIMARY KEY,
    request_id text NOT NULL,
    amount bigint NOT NULL,
    version bigint NOT NULL DEFAULT 0);
CREATE TABLE keyed_notes (
    id bigint PRIMARY KEY,
    request_id text UNIQUE,
    body text NOT NULL,
    version bigint NOT NULL DEFAULT 0);
";

/// The seed's `t_order`: `UNIQUE (tenant_id, request_id)` is `uk_idempotent_key`.
#[derive(Debug, Clone, PartialEq, Queryable, Selectable, Versioned)]
#[diesel(table_name = shop_orders)]
#[versioned(tenant = tenant_id, key = id, state = status,
            create_once(key = request_id, fingerprint(id, amount, note)))]
struct ShopOrder {
    tenant_id: i64,
    id: i64,
    request_id: String,
    amount: i64,
    note: Option<String>,
    status: String,
    version: i64,
}

/// Its table has no unique index on `request_id` at first.
#[derive(Debug, Clone, PartialEq, Queryable, Selectable, Versioned)]
#[diesel(table_name = loose_orders)]
#[versioned(tenant = none, key = id, create_once(key = request_id, fingerprint(amount)))]
struct LooseOrder {
    id: i64,
    request_id: String,
    amount: i64,
    version: i64,
}

/// A key that may be NULL in the table.
#[derive(Debug, Clone, PartialEq, Queryable, Selectable, Versioned)]
#[diesel(table_name = keyed_notes)]
#[versioned(tenant = none, key = id, create_once(key = request_id, fingerprint()))]
struct KeyedNote {
    id: i64,
    request_id: Option<String>,
    body: String,
    version: i64,
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Once(#[from] CreateOnceError),
    #[error(transparent)]
    Db(#[from] diesel::result::Error),
    #[error(transparent)]
    Idem(#[from] idem::Error),
}
idem::final_errors!(AppError);

struct Env {
    db: idem_testing::TestDatabase,
    pool: Pool,
}

async fn env(size: usize) -> Env {
    let db = idem_testing::TestDatabase::create().await.unwrap();
    let mut conn = AsyncPgConnection::establish(db.url()).await.unwrap();
    conn.batch_execute(SCHEMA).await.unwrap();
    idem::migrate(&mut conn).await.unwrap();
    let pool = crate::test_pool::test_pool(&db, size, Duration::from_secs(10));
    Env { db, pool }
}

impl Env {
    async fn conn(&self) -> AsyncPgConnection {
        AsyncPgConnection::establish(self.db.url()).await.unwrap()
    }

    /// The rows of `shop_orders`, straight from the table.
    async fn orders(&self) -> Vec<ShopOrder> {
        shop_orders::table
            .select(ShopOrder::as_select())
            .order((shop_orders::tenant_id, shop_orders::id))
            .load(&mut self.conn().await)
            .await
            .unwrap()
    }
}

fn order(tenant_id: i64, id: i64, request_id: &str, amount: i64) -> ShopOrder {
    ShopOrder {
        tenant_id,
        id,
        request_id: request_id.into(),
        amount,
        note: None,
        status: "pending".into(),
        // Ignored: a created row starts at version 0.
        version: 41,
    }
}

/// `create_once` under the retry loop at `isolation`.
async fn create(
    pool: &Pool,
    isolation: Isolation,
    row: &ShopOrder,
) -> Result<Creation<ShopOrder>, AppError> {
    let policy = RetryPolicy::new()
        .isolation(isolation)
        .max_attempts(8)
        .deadline(Duration::from_secs(20));
    retry(pool, policy, "create_once", |conn| {
        async move { Ok(row.create_once(conn).await?) }.scope_boxed()
    })
    .await
}

/// `rows.len()` creators released together, each under the retry loop.
async fn race(
    env: &Env,
    isolation: Isolation,
    rows: Vec<ShopOrder>,
) -> Vec<Result<Creation<ShopOrder>, AppError>> {
    let barrier = Arc::new(Barrier::new(rows.len()));
    let tasks: Vec<_> = rows
        .into_iter()
        .map(|row| {
            let (pool, barrier) = (env.pool.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                create(&pool, isolation, &row).await
            })
        })
        .collect();
    let mut results = Vec::new();
    for task in tasks {
        results.push(task.await.unwrap());
    }
    results
}

const LEVELS: [Isolation; 3] = [
    Isolation::ReadCommitted,
    Isolation::RepeatableRead,
    Isolation::Serializable,
];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_identical_creates_make_one_row_at_every_level() {
    let env = env(8).await;
    for (n, isolation) in LEVELS.into_iter().enumerate() {
        let id = n as i64 + 1;
        let key = format!("req-{id}");
        let results = race(&env, isolation, vec![order(1, id, &key, 3000); 8]).await;
        let mut created = 0;
        for result in &results {
            match result {
                Ok(Creation::Created(row)) | Ok(Creation::Existing(row)) => {
                    assert_eq!(
                        (row.id, row.amount, row.version),
                        (id, 3000, 0),
                        "{isolation:?}"
                    );
                    assert_eq!(row.request_id, key);
                }
                Err(e) => panic!("{isolation:?}: a repeat of the same request failed: {e:?}"),
            }
            created += usize::from(matches!(result, Ok(Creation::Created(_))));
        }
        assert_eq!(created, 1, "{isolation:?}: exactly one creator inserts");
    }
    let rows = env.orders().await;
    assert_eq!(rows.len(), 3, "one row per request: {rows:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_creates_with_other_fields_are_refused_at_every_level() {
    let env = env(8).await;
    for (n, isolation) in LEVELS.into_iter().enumerate() {
        let key = format!("reused-{n}");
        let base = 100 * (n as i64 + 1);
        // Four ask for the same order; four reuse the key for other ones
        // (another amount, or another id: a conflict on the key alone).
        let mut rows = vec![order(1, base, &key, 500); 4];
        rows.extend((1..=2).map(|i| order(1, base, &key, 500 + i)));
        rows.extend((1..=2).map(|i| order(1, base + i, &key, 500)));
        let results = race(&env, isolation, rows.clone()).await;
        let winner = results
            .iter()
            .find_map(|r| match r {
                Ok(Creation::Created(row)) => Some(row.clone()),
                _ => None,
            })
            .unwrap_or_else(|| panic!("{isolation:?}: nobody created: {results:?}"));
        for (asked, result) in rows.iter().zip(&results) {
            let same = (asked.id, asked.amount) == (winner.id, winner.amount);
            match result {
                Ok(Creation::Created(row)) => assert_eq!(row, &winner),
                Ok(Creation::Existing(row)) => {
                    assert!(
                        same,
                        "{isolation:?}: {asked:?} answered as a repeat of {row:?}"
                    );
                    assert_eq!(row, &winner);
                }
                Err(AppError::Once(CreateOnceError::Mismatch { fields })) => {
                    assert!(!same, "{isolation:?}: the same request refused");
                    let expected: Vec<&str> = [
                        ("id", asked.id != winner.id),
                        ("amount", asked.amount != winner.amount),
                    ]
                    .into_iter()
                    .filter_map(|(f, differs)| differs.then_some(f))
                    .collect();
                    assert_eq!(fields, &expected);
                }
                Err(e) => panic!("{isolation:?}: {e:?}"),
            }
        }
        let rows: Vec<ShopOrder> = env
            .orders()
            .await
            .into_iter()
            .filter(|r| r.request_id == key)
            .collect();
        assert_eq!(rows, vec![winner], "{isolation:?}: one row under the key");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn another_unique_value_taken_is_a_conflict_and_writes_nothing() {
    let env = env(8).await;
    for (n, isolation) in LEVELS.into_iter().enumerate() {
        // One id, eight keys: the primary key is what collides.
        let id = 50 + n as i64;
        let rows: Vec<ShopOrder> = (0..8)
            .map(|i| order(1, id, &format!("pk-{n}-{i}"), 10))
            .collect();
        let results = race(&env, isolation, rows).await;
        let created = results
            .iter()
            .filter(|r| matches!(r, Ok(Creation::Created(_))))
            .count();
        let conflicts = results
            .iter()
            .filter(|r| matches!(r, Err(AppError::Once(CreateOnceError::Conflict))))
            .count();
        assert_eq!((created, conflicts), (1, 7), "{isolation:?}: {results:?}");
    }
    assert_eq!(env.orders().await.len(), 3);
    let err = CreateOnceError::Conflict;
    assert_eq!(err.http_status(), 409);
}

#[tokio::test]
async fn a_key_in_another_tenant_is_another_key() {
    let env = env(2).await;
    let first = create(
        &env.pool,
        Isolation::ReadCommitted,
        &order(1, 1, "shared", 100),
    )
    .await
    .unwrap();
    assert!(first.is_created());
    // The same key and id in tenant 2, with another amount: a new row, not a
    // mismatch that would tell tenant 2 anything about tenant 1's order.
    let other = create(
        &env.pool,
        Isolation::ReadCommitted,
        &order(2, 1, "shared", 999),
    )
    .await
    .unwrap();
    assert!(other.is_created(), "{other:?}");
    assert_eq!(other.row().amount, 999);
    let rows = env.orders().await;
    assert_eq!(
        rows.iter()
            .map(|r| (r.tenant_id, r.amount))
            .collect::<Vec<_>>(),
        [(1, 100), (2, 999)]
    );
    // And a repeat in tenant 1 still finds tenant 1's row.
    let again = create(
        &env.pool,
        Isolation::ReadCommitted,
        &order(1, 1, "shared", 100),
    )
    .await
    .unwrap();
    assert_eq!(again, Creation::Existing(rows[0].clone()));
}

#[tokio::test]
async fn a_repeat_after_an_update_gets_the_row_as_it_is_now() {
    let env = env(2).await;
    let mut conn = env.conn().await;
    let mut first = order(1, 7, "paid-later", 300);
    first.note = Some("gift".into());
    assert!(first.create_once(&mut conn).await.unwrap().is_created());
    diesel::sql_query("UPDATE shop_orders SET status = 'paid', version = version + 1 WHERE id = 7")
        .execute(&mut conn)
        .await
        .unwrap();
    match first.create_once(&mut conn).await.unwrap() {
        Creation::Existing(row) => assert_eq!((row.status.as_str(), row.version), ("paid", 1)),
        created => panic!("{created:?}"),
    }
    // A NULL note where the row has one is another request.
    let mut no_note = first.clone();
    no_note.note = None;
    match no_note.create_once(&mut conn).await {
        Err(e @ CreateOnceError::Mismatch { .. }) => {
            assert_eq!(e.http_status(), 422);
            assert!(e.to_string().contains("note"), "{e}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(env.orders().await.len(), 1);
}

#[tokio::test]
async fn a_null_key_is_refused() {
    let env = env(2).await;
    let mut conn = env.conn().await;
    let note = KeyedNote {
        id: 1,
        request_id: None,
        body: "b".into(),
        version: 0,
    };
    for _ in 0..2 {
        match note.create_once(&mut conn).await {
            Err(e @ CreateOnceError::MissingKey) => assert_eq!(e.http_status(), 400),
            other => panic!("{other:?}"),
        }
    }
    let keyed = KeyedNote {
        request_id: Some("k".into()),
        ..note
    };
    assert!(keyed.create_once(&mut conn).await.unwrap().is_created());
    // `fingerprint()`: the key alone names the request.
    let other_body = KeyedNote {
        id: 2,
        body: "other".into(),
        ..keyed.clone()
    };
    assert_eq!(
        other_body.create_once(&mut conn).await.unwrap(),
        Creation::Existing(keyed)
    );
    let rows: i64 = keyed_notes::table
        .count()
        .get_result(&mut conn)
        .await
        .unwrap();
    assert_eq!(rows, 1);
}

/// The order and the payment callback's record in one transaction: the
/// `#[idempotent]` record answers a repeat of the call, the business key a
/// new call for the same order.
#[idempotent(key = call_key, scope = "create_once_test", fingerprint(row.request_id, row.amount))]
#[retryable(max = 6, deadline_ms = 10000, isolation = serializable)]
async fn create_recorded(
    conn: &mut AsyncPgConnection,
    call_key: &str,
    row: &ShopOrder,
) -> Result<(i64, bool), AppError> {
    let creation = row.create_once(conn).await?;
    Ok((creation.row().id, creation.is_created()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn it_composes_with_an_idempotent_call_in_the_same_transaction() {
    let env = env(8).await;
    let row = order(3, 9, "composed", 70);
    // Four calls under two call keys, racing.
    let barrier = Arc::new(Barrier::new(4));
    let tasks: Vec<_> = ["a", "a", "b", "b"]
        .into_iter()
        .map(|key| {
            let (pool, barrier, row) = (env.pool.clone(), barrier.clone(), row.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                create_recorded(&pool, key, &row).await
            })
        })
        .collect();
    let mut answers = Vec::new();
    for task in tasks {
        let done = task.await.unwrap().unwrap();
        answers.push((done.value, done.replayed));
    }
    // One call key created the order; each key's second call is a replay of
    // its first answer; the other key's first call found the order.
    let created: Vec<_> = answers
        .iter()
        .filter(|((_, c), replayed)| *c && !*replayed)
        .collect();
    assert_eq!(created.len(), 1, "{answers:?}");
    assert_eq!(
        answers.iter().filter(|(_, replayed)| *replayed).count(),
        2,
        "{answers:?}"
    );
    assert!(answers.iter().all(|((id, _), _)| *id == 9));
    assert_eq!(env.orders().await.len(), 1);
    let records: i64 = diesel::sql_query("SELECT count(*) AS n FROM idem_requests")
        .get_result::<Count>(&mut env.conn().await)
        .await
        .unwrap()
        .n;
    assert_eq!(records, 2, "one record per call key");
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    n: i64,
}
