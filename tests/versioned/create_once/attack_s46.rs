//! helper-50's hostile pass on `create_once` (session 46): attacks written
//! from the README, docs/versioned.md and the rustdoc only. Every answer is
//! checked against the rows in the table. `attack46_*` are promises that
//! held; `found_*` (ignored) fail on the code they were written against.

use diesel::data_types::{PgNumeric, PgTimestamp};
use diesel::sql_types::Integer;

use super::*;

mod concurrently;
mod guard;
mod lifecycle;
mod shapes;

diesel::table! {
    fp_rows (id) {
        id -> Int8,
        request_id -> Text,
        f -> Float8,
        n -> Numeric,
        ts -> Timestamptz,
        t -> Text,
        b -> Bytea,
        arr -> Array<Int8>,
        j -> Jsonb,
        maybe -> Nullable<Text>,
        version -> Int8,
    }
}

diesel::table! {
    s46.sq_orders (id) {
        id -> Int8,
        request_id -> Text,
        amount -> Int8,
        version -> Int8,
    }
}

diesel::table! {
    #[sql_name = "MixedOrders"]
    mixed_orders (id) {
        id -> Int8,
        #[sql_name = "RequestId"]
        request_id -> Text,
        amount -> Int8,
        version -> Int8,
    }
}

const MORE: &str = r#"
CREATE TABLE fp_rows (
    id bigint PRIMARY KEY, request_id text NOT NULL UNIQUE, f float8 NOT NULL,
    n numeric NOT NULL, ts timestamptz NOT NULL, t text NOT NULL, b bytea NOT NULL,
    arr bigint[] NOT NULL, j jsonb NOT NULL, maybe text, version bigint NOT NULL DEFAULT 0);
CREATE SCHEMA s46;
CREATE TABLE s46.sq_orders (id bigint PRIMARY KEY, request_id text NOT NULL,
    amount bigint NOT NULL, version bigint NOT NULL DEFAULT 0);
CREATE TABLE public.sq_orders (id bigint PRIMARY KEY, request_id text NOT NULL UNIQUE,
    amount bigint NOT NULL, version bigint NOT NULL DEFAULT 0);
CREATE TABLE "MixedOrders" (id bigint PRIMARY KEY, "RequestId" text NOT NULL UNIQUE,
    amount bigint NOT NULL, version bigint NOT NULL DEFAULT 0);
"#;

#[derive(Debug, Clone, PartialEq, Queryable, Selectable, Versioned)]
#[diesel(table_name = fp_rows)]
#[versioned(tenant = none, key = id,
            create_once(key = request_id, fingerprint(f, n, ts, t, b, arr, j, maybe)))]
struct FpRow {
    id: i64,
    request_id: String,
    f: f64,
    n: PgNumeric,
    ts: PgTimestamp,
    t: String,
    b: Vec<u8>,
    arr: Vec<i64>,
    j: serde_json::Value,
    maybe: Option<String>,
    version: i64,
}

#[derive(Debug, Clone, PartialEq, Queryable, Selectable, Versioned)]
#[diesel(table_name = sq_orders)]
#[versioned(tenant = none, key = id, create_once(key = request_id, fingerprint(amount)))]
struct SqOrder {
    id: i64,
    request_id: String,
    amount: i64,
    version: i64,
}

#[derive(Debug, Clone, PartialEq, Queryable, Selectable, Versioned)]
#[diesel(table_name = mixed_orders)]
#[versioned(tenant = none, key = id, create_once(key = request_id, fingerprint(amount)))]
struct MixedOrder {
    id: i64,
    request_id: String,
    amount: i64,
    version: i64,
}

pub(super) async fn env46(size: usize) -> Env {
    let env = env(size).await;
    env.conn().await.batch_execute(MORE).await.unwrap();
    env
}

/// `loose_orders` with a unique index `k` on `request_id`.
pub(super) async fn unique_k(size: usize) -> Env {
    let env = env46(size).await;
    let index = "CREATE UNIQUE INDEX k ON loose_orders (request_id)";
    env.conn().await.batch_execute(index).await.unwrap();
    env
}

/// [`unique_k`] with a row under 'k'.
pub(super) async fn indexed(size: usize) -> Env {
    let env = unique_k(size).await;
    let row = "INSERT INTO loose_orders VALUES (1, 'k', 5, 0)";
    env.conn().await.batch_execute(row).await.unwrap();
    env
}

/// `SELECT count(*)` of a query's rows, on a side connection.
pub(super) async fn count_sql(env: &Env, sql: &str) -> i64 {
    diesel::sql_query(format!("SELECT count(*) AS n FROM ({sql}) q"))
        .get_result::<Count>(&mut env.conn().await)
        .await
        .unwrap()
        .n
}

fn numeric(scale: u16) -> PgNumeric {
    // 1.5 at the given scale (1.5, 1.50, ..): digits in base 10000.
    PgNumeric::Positive {
        weight: 0,
        scale,
        digits: vec![1, 5000],
    }
}

fn fp(id: i64) -> FpRow {
    FpRow {
        id,
        request_id: "fp".into(),
        f: 0.0,
        n: numeric(1),
        ts: PgTimestamp(1_000_000),
        t: "ab".into(),
        b: vec![0, 1, 2, 255],
        arr: vec![1, 2, 3],
        j: serde_json::json!({"a": 1, "b": [1, 2]}),
        maybe: None,
        version: 9,
    }
}

/// Every fingerprint type the docs allow compares by the column's own
/// equality: -0.0 = 0.0, NaN = NaN (PostgreSQL's float8), 1.5 = 1.50
/// (numeric), jsonb whatever its key order, NULL = NULL; text with a
/// trailing space, other bytes, another array order, a timestamp one
/// microsecond off and NULL vs a value differ, each named alone.
#[tokio::test]
async fn attack46_fingerprint_compares_by_the_columns_equality() {
    let env = env46(2).await;
    let mut conn = env.conn().await;
    let created = fp(1).create_once(&mut conn).await.unwrap();
    let stored = match created {
        Creation::Created(row) => row,
        other => panic!("{other:?}"),
    };
    assert_eq!(stored.version, 0, "a created row starts at version 0");
    let same: Vec<(&str, FpRow)> = vec![
        ("-0.0", FpRow { f: -0.0, ..fp(2) }),
        (
            "1.50",
            FpRow {
                n: numeric(4),
                ..fp(3)
            },
        ),
        (
            "jsonb key order",
            FpRow {
                j: serde_json::from_str(r#"{"b":[1,2],"a":1}"#).unwrap(),
                ..fp(4)
            },
        ),
    ];
    for (what, row) in same {
        match row.create_once(&mut conn).await {
            Ok(Creation::Existing(found)) => assert_eq!(found, stored, "{what}"),
            other => panic!("{what}: expected Existing, got {other:?}"),
        }
    }
    let differ: Vec<(&str, FpRow)> = vec![
        (
            "t",
            FpRow {
                t: "ab ".into(),
                ..fp(1)
            },
        ),
        (
            "b",
            FpRow {
                b: vec![0, 1, 2],
                ..fp(1)
            },
        ),
        (
            "arr",
            FpRow {
                arr: vec![3, 2, 1],
                ..fp(1)
            },
        ),
        (
            "ts",
            FpRow {
                ts: PgTimestamp(1_000_001),
                ..fp(1)
            },
        ),
        (
            "maybe",
            FpRow {
                maybe: Some(String::new()),
                ..fp(1)
            },
        ),
        (
            "f",
            FpRow {
                f: f64::MIN_POSITIVE,
                ..fp(1)
            },
        ),
    ];
    for (field, row) in differ {
        match row.create_once(&mut conn).await {
            Err(CreateOnceError::Mismatch { fields }) => assert_eq!(fields, [field]),
            other => panic!("{field}: expected Mismatch, got {other:?}"),
        }
    }
    // NaN: PostgreSQL's float8 calls NaN equal to NaN.
    let nan = FpRow {
        f: f64::NAN,
        request_id: "nan".into(),
        ..fp(10)
    };
    assert!(nan.create_once(&mut conn).await.unwrap().is_created());
    let again = FpRow {
        id: 11,
        ..nan.clone()
    };
    assert!(matches!(
        again.create_once(&mut conn).await,
        Ok(Creation::Existing(ref r)) if r.id == 10
    ));
    assert_eq!(count_sql(&env, "SELECT 1 FROM fp_rows").await, 2);
}

/// The error names the fields, never their values: neither its Display nor
/// its Debug carries the stored or the sent value.
#[tokio::test]
async fn attack46_mismatch_names_fields_never_values() {
    let env = env46(2).await;
    let mut conn = env.conn().await;
    let mut first = order(1, 1, "secretive", 424242);
    first.note = Some("STORED-SECRET".into());
    assert!(first.create_once(&mut conn).await.unwrap().is_created());
    let mut other = order(1, 1, "secretive", 737373);
    other.note = Some("SENT-SECRET".into());
    let err = other.create_once(&mut conn).await.unwrap_err();
    assert!(matches!(&err, CreateOnceError::Mismatch { fields } if fields == &["amount", "note"]));
    for text in [err.to_string(), format!("{err:?}")] {
        for value in ["424242", "737373", "STORED-SECRET", "SENT-SECRET"] {
            assert!(!text.contains(value), "{value} leaked in {text}");
        }
    }
    assert_eq!(err.http_status(), 422);
    assert_eq!(count_sql(&env, "SELECT 1 FROM shop_orders").await, 1);
}

/// A NUL byte in the key (text refuses it) is a typed database error, no
/// panic, nothing written, and the connection goes on; a huge key that
/// compresses fits the index and repeats as `Existing`; one that does not
/// compress is refused by PostgreSQL with nothing written.
#[tokio::test]
async fn attack46_nul_and_huge_keys() {
    let env = env46(2).await;
    let mut conn = env.conn().await;
    let answer = order(1, 1, "a\0b", 1).create_once(&mut conn).await;
    assert!(
        matches!(answer, Err(CreateOnceError::Database(_))),
        "{answer:?}"
    );
    let big = "x".repeat(200_000);
    assert!(order(1, 2, &big, 1)
        .create_once(&mut conn)
        .await
        .unwrap()
        .is_created());
    assert!(matches!(
        order(1, 2, &big, 1).create_once(&mut conn).await,
        Ok(Creation::Existing(ref r)) if r.request_id.len() == 200_000
    ));
    // 8000 bytes that do not compress.
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let noise: String = (0..8000)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            char::from(b'!' + (state % 90) as u8)
        })
        .collect();
    let answer = order(1, 3, &noise, 1).create_once(&mut conn).await;
    assert!(
        matches!(answer, Err(CreateOnceError::Database(_))),
        "{answer:?}"
    );
    assert!(order(1, 4, "fine", 1)
        .create_once(&mut conn)
        .await
        .unwrap()
        .is_created());
    assert_eq!(count_sql(&env, "SELECT 1 FROM shop_orders").await, 2);
}

/// 8 racers in two tenants with one key, each tenant with its own amount, at
/// SERIALIZABLE under the retry loop: one row per tenant, and no racer is
/// answered with the other tenant's row or a mismatch.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn attack46_tenants_race_on_one_key_without_meeting() {
    let env = env46(8).await;
    for (n, isolation) in LEVELS.into_iter().enumerate() {
        let key = format!("shared-{isolation:?}");
        let rows: Vec<ShopOrder> = (0..8)
            .map(|i| order(1 + i % 2, n as i64, &key, 100 * (1 + i % 2)))
            .collect();
        let results = race(&env, isolation, rows.clone()).await;
        let mut created = [0, 0];
        for (asked, result) in rows.iter().zip(results) {
            let row = match result {
                Ok(Creation::Created(row)) => {
                    created[asked.tenant_id as usize - 1] += 1;
                    row
                }
                Ok(Creation::Existing(row)) => row,
                Err(e) => panic!("{isolation:?}: {e:?}"),
            };
            assert_eq!((row.tenant_id, row.amount), (asked.tenant_id, asked.amount));
        }
        assert_eq!(created, [1, 1], "{isolation:?}");
    }
    assert_eq!(count_sql(&env, "SELECT 1 FROM shop_orders").await, 6);
}

/// In a plain diesel-async transaction (REPEATABLE READ): a `Mismatch` and
/// a `Conflict` leave the transaction going (a later statement runs and the
/// commit keeps it), and write nothing themselves; `NoUniqueIndex` aborts it.
#[tokio::test]
async fn attack46_plain_transaction_goes_on_after_mismatch_and_conflict() {
    let env = env46(2).await;
    let mut pooled = env.pool.get().await.unwrap();
    let conn: &mut AsyncPgConnection = &mut pooled;
    assert!(order(1, 1, "taken", 1)
        .create_once(conn)
        .await
        .unwrap()
        .is_created());
    let (mismatch, conflict, created) = conn
        .build_transaction()
        .repeatable_read()
        .run::<_, AppError, _>(async |c| {
            let mismatch = order(1, 2, "taken", 2).create_once(&mut *c).await;
            let conflict = order(1, 1, "free", 1).create_once(&mut *c).await;
            let created = order(1, 3, "in-tx", 3).create_once(&mut *c).await?;
            Ok((mismatch, conflict, created))
        })
        .await
        .unwrap();
    assert!(
        matches!(mismatch, Err(CreateOnceError::Mismatch { ref fields }) if fields == &["id", "amount"])
    );
    assert!(
        matches!(conflict, Err(CreateOnceError::Conflict)),
        "{conflict:?}"
    );
    assert!(created.is_created());
    let keys: Vec<String> = env
        .orders()
        .await
        .into_iter()
        .map(|r| r.request_id)
        .collect();
    assert_eq!(keys, ["taken", "in-tx"]);
    // NoUniqueIndex inside a transaction: aborted, nothing written.
    let aborted = conn
        .transaction::<_, AppError, _>(async |c| {
            let guard = loose(1, "x").create_once(&mut *c).await;
            assert!(
                matches!(guard, Err(CreateOnceError::NoUniqueIndex { .. })),
                "{guard:?}"
            );
            order(1, 4, "after-guard", 1).create_once(&mut *c).await?;
            Ok(())
        })
        .await;
    assert!(aborted.is_err());
    assert_eq!(env.orders().await.len(), 2);
    assert_eq!(count_sql(&env, "SELECT 1 FROM loose_orders").await, 0);
    // And the pooled connection is usable afterwards.
    assert!(order(1, 5, "later", 1)
        .create_once(conn)
        .await
        .unwrap()
        .is_created());
}

pub(super) fn loose(id: i64, key: &str) -> LooseOrder {
    LooseOrder {
        id,
        request_id: key.into(),
        amount: 5,
        version: 0,
    }
}

/// The pid of the one backend of this database that waits on a lock.
pub(super) async fn blocked_pid(env: &Env) -> i32 {
    #[derive(QueryableByName)]
    struct Pid {
        #[diesel(sql_type = Integer)]
        pid: i32,
    }
    let mut observer = env.conn().await;
    for _ in 0..1000 {
        let pids = diesel::sql_query(
            "SELECT pid FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .load::<Pid>(&mut observer)
        .await
        .unwrap();
        if let [one] = pids.as_slice() {
            return one.pid;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("no creator ever blocked");
}

/// A side session that holds an uncommitted row under `key` in tenant 1.
async fn holder(env: &Env, id: i64, key: &str, amount: i64) -> AsyncPgConnection {
    let mut conn = env.conn().await;
    conn.batch_execute(&format!(
        "BEGIN; INSERT INTO shop_orders (tenant_id, id, request_id, amount)
         VALUES (1, {id}, '{key}', {amount})"
    ))
    .await
    .unwrap();
    conn
}

/// Outside a retry loop, at REPEATABLE READ and SERIALIZABLE, a create of a
/// key that a row committed after the snapshot holds is a serialization
/// failure: `CreateOnceError::Database`, classified transient by
/// `idem::Transient`, nothing written; the next transaction sees `Existing`.
#[tokio::test]
async fn attack46_outside_a_retry_loop_the_race_is_a_transient_database_error() {
    use idem::Transient;
    let env = env46(2).await;
    for (n, level) in ["REPEATABLE READ", "SERIALIZABLE"].into_iter().enumerate() {
        let key = format!("late-{n}");
        let mut conn = env.pool.get().await.unwrap();
        conn.batch_execute(&format!(
            "BEGIN ISOLATION LEVEL {level}; SELECT count(*) FROM loose_orders"
        ))
        .await
        .unwrap();
        let row = order(1, n as i64, &key, 1);
        assert!(row
            .create_once(&mut env.conn().await)
            .await
            .unwrap()
            .is_created());
        let err = row.create_once(&mut conn).await.unwrap_err();
        assert!(
            matches!(err, CreateOnceError::Database(_)),
            "{level}: {err:?}"
        );
        assert!(err.transient().is_some(), "{level}: {err:?} not transient");
        conn.batch_execute("ROLLBACK").await.unwrap();
        assert!(matches!(
            row.create_once(&mut conn).await,
            Ok(Creation::Existing(_))
        ));
    }
    assert_eq!(count_sql(&env, "SELECT 1 FROM shop_orders").await, 2);
}

/// Inside `#[idempotent]` local mode (SERIALIZABLE, mod.rs's
/// `create_recorded`), a key reused with another amount is a `Mismatch`:
/// not a final error there, so nothing is stored under that call key and a
/// repeat runs again (the same `Mismatch`); the first call key replays.
#[tokio::test]
async fn attack46_idempotent_call_with_a_mismatch_stores_nothing() {
    let env = env46(2).await;
    let first = create_recorded(&env.pool, "m1", &order(3, 9, "idem-m", 70))
        .await
        .unwrap();
    assert_eq!((first.value, first.replayed), ((9, true), false));
    for _ in 0..2 {
        match create_recorded(&env.pool, "m2", &order(3, 9, "idem-m", 71)).await {
            Err(AppError::Once(CreateOnceError::Mismatch { fields })) => {
                assert_eq!(fields, ["amount"])
            }
            other => panic!("{other:?}"),
        }
    }
    let again = create_recorded(&env.pool, "m1", &order(3, 9, "idem-m", 70))
        .await
        .unwrap();
    assert_eq!((again.value, again.replayed), ((9, true), true));
    let records = count_sql(&env, "SELECT 1 FROM idem_requests").await;
    assert_eq!(records, 1, "only m1 is recorded");
    assert_eq!(env.orders().await.len(), 1);
}

/// The unique index with its columns in the other order, `(request_id,
/// tenant_id)`, makes the key just as unique: accepted by the check and
/// the INSERT, and it stops a second row.
#[tokio::test]
async fn attack46_an_index_with_the_columns_reversed_is_accepted() {
    let env = env46(2).await;
    let mut conn = env.conn().await;
    conn.batch_execute(
        "ALTER TABLE shop_orders DROP CONSTRAINT uk_idempotent_key;
         CREATE UNIQUE INDEX rev ON shop_orders (request_id, tenant_id)",
    )
    .await
    .unwrap();
    idem::versioned::check_create_once::<ShopOrder>(&mut conn)
        .await
        .unwrap();
    assert!(order(1, 1, "rev", 1)
        .create_once(&mut conn)
        .await
        .unwrap()
        .is_created());
    assert!(matches!(
        order(1, 2, "rev", 1).create_once(&mut conn).await,
        Err(CreateOnceError::Mismatch { ref fields }) if fields == &["id"]
    ));
    assert!(order(2, 2, "rev", 1)
        .create_once(&mut conn)
        .await
        .unwrap()
        .is_created());
    assert_eq!(env.orders().await.len(), 2);
}
