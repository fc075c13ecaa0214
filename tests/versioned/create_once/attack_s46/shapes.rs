//! helper-50: a composite key with a nullable tenant, a key-rewriting
//! trigger, and connections that die or are dropped in a plain transaction.

use super::*;

diesel::table! {
    parcels (id) {
        id -> Int8,
        tenant_id -> Nullable<Int8>,
        region -> Text,
        ext_ref -> Nullable<Text>,
        weight -> Int4,
        version -> Int8,
    }
}

const PARCELS: &str = "
CREATE TABLE parcels (id bigint PRIMARY KEY, tenant_id bigint, region text NOT NULL,
    ext_ref text, weight int NOT NULL, version bigint NOT NULL DEFAULT 0);
CREATE UNIQUE INDEX parcels_key ON parcels (ext_ref, tenant_id, region);";

#[derive(Debug, Clone, PartialEq, Queryable, Selectable, Versioned)]
#[diesel(table_name = parcels)]
#[versioned(tenant = tenant_id, key = id,
            create_once(key = (region, ext_ref), fingerprint(weight)))]
struct Parcel {
    id: i64,
    tenant_id: Option<i64>,
    region: String,
    ext_ref: Option<String>,
    weight: i32,
    version: i64,
}

fn parcel(
    id: i64,
    tenant: Option<i64>,
    region: &str,
    ext_ref: Option<&str>,
    weight: i32,
) -> Parcel {
    Parcel {
        id,
        tenant_id: tenant,
        region: region.into(),
        ext_ref: ext_ref.map(Into::into),
        weight,
        version: 0,
    }
}

/// A composite key (two columns) under a nullable tenant, its index in
/// another column order: a NULL tenant or key part is `MissingKey` (never
/// written), a repeat `Existing`, another weight `Mismatch`, the same key in
/// another region or tenant a new row. An index on a subset of the key
/// columns is refused (it is not the key's index).
#[tokio::test]
async fn attack46_composite_key_with_a_nullable_tenant() {
    let env = env46(2).await;
    let mut conn = env.conn().await;
    conn.batch_execute(PARCELS).await.unwrap();
    idem::versioned::check_create_once::<Parcel>(&mut conn)
        .await
        .unwrap();
    for missing in [
        parcel(1, None, "eu", Some("p1"), 5),
        parcel(2, Some(1), "eu", None, 5),
    ] {
        for _ in 0..2 {
            let answer = missing.create_once(&mut conn).await;
            assert!(
                matches!(answer, Err(CreateOnceError::MissingKey)),
                "{answer:?}"
            );
        }
    }
    assert!(parcel(3, Some(1), "eu", Some("p1"), 5)
        .create_once(&mut conn)
        .await
        .unwrap()
        .is_created());
    assert!(matches!(
        parcel(4, Some(1), "eu", Some("p1"), 5).create_once(&mut conn).await,
        Ok(Creation::Existing(ref p)) if p.id == 3
    ));
    assert!(matches!(
        parcel(5, Some(1), "eu", Some("p1"), 6).create_once(&mut conn).await,
        Err(CreateOnceError::Mismatch { ref fields }) if fields == &["weight"]
    ));
    assert!(parcel(6, Some(1), "us", Some("p1"), 6)
        .create_once(&mut conn)
        .await
        .unwrap()
        .is_created());
    assert!(parcel(7, Some(2), "eu", Some("p1"), 7)
        .create_once(&mut conn)
        .await
        .unwrap()
        .is_created());
    conn.batch_execute(
        "DROP INDEX parcels_key; CREATE UNIQUE INDEX sub ON parcels (tenant_id, region)",
    )
    .await
    .unwrap();
    let answer = parcel(8, Some(3), "eu", Some("p8"), 1)
        .create_once(&mut conn)
        .await;
    assert!(
        matches!(answer, Err(CreateOnceError::NoUniqueIndex { .. })),
        "{answer:?}"
    );
    let ids: Vec<i64> = parcels::table
        .select(parcels::id)
        .order(parcels::id)
        .load(&mut conn)
        .await
        .unwrap();
    assert_eq!(ids, [3, 6, 7]);
}

/// A `BEFORE INSERT` trigger that rewrites the key (upper-cases it): the
/// docs say a repeat the index refuses but the read cannot find is
/// `Conflict`, never a wrong `Existing` or a second row.
#[tokio::test]
async fn attack46_a_key_rewriting_trigger_is_a_conflict() {
    let env = env46(2).await;
    let mut conn = env.conn().await;
    conn.batch_execute(
        "CREATE FUNCTION up() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN NEW.request_id := upper(NEW.request_id); RETURN NEW; END $$;
         CREATE TRIGGER up BEFORE INSERT ON shop_orders FOR EACH ROW EXECUTE FUNCTION up();",
    )
    .await
    .unwrap();
    match order(1, 1, "low", 1).create_once(&mut conn).await {
        Ok(Creation::Created(row)) => assert_eq!(row.request_id, "LOW"),
        other => panic!("{other:?}"),
    }
    let answer = order(1, 1, "low", 1).create_once(&mut conn).await;
    assert!(
        matches!(answer, Err(CreateOnceError::Conflict)),
        "{answer:?}"
    );
    assert!(matches!(
        order(1, 1, "LOW", 1).create_once(&mut conn).await,
        Ok(Creation::Existing(ref r)) if r.request_id == "LOW"
    ));
    assert_eq!(env.orders().await.len(), 1);
}

/// A raw connection killed while its create waits (outside any retry
/// loop): a typed `Database` error, no panic, nothing written; the dead
/// connection keeps answering typed errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn attack46_a_killed_raw_connection_is_a_typed_error() {
    let env = env46(2).await;
    let mut winner = holder(&env, 1, "kill", 1).await;
    let mut victim = env.conn().await;
    let call = tokio::spawn(async move {
        let first = order(1, 1, "kill", 1).create_once(&mut victim).await;
        let second = order(1, 2, "after", 1).create_once(&mut victim).await;
        (first, second)
    });
    let pid = blocked_pid(&env).await;
    env.conn()
        .await
        .batch_execute(&format!("SELECT pg_terminate_backend({pid})"))
        .await
        .unwrap();
    let (first, second) = tokio::time::timeout(Duration::from_secs(20), call)
        .await
        .expect("hung")
        .unwrap();
    assert!(
        matches!(first, Err(CreateOnceError::Database(_))),
        "{first:?}"
    );
    assert!(
        matches!(second, Err(CreateOnceError::Database(_))),
        "{second:?}"
    );
    winner.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(env.orders().await.len(), 0);
}

/// A pooled connection dropped inside a plain transaction of its own
/// (diesel-async's `transaction`, or a hand-sent `BEGIN`) while its create
/// waits; the winner then rolls back, so the abandoned INSERT goes through
/// on the server. The pool (one connection) must not hand the next caller
/// that transaction: the next autocommit create is committed, and the
/// abandoned row never is.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn attack46_a_connection_dropped_in_a_plain_transaction_commits_nothing() {
    let env = env46(1).await;
    for by_hand in [false, true] {
        let key = format!("abandoned-{by_hand}");
        let mut winner = holder(&env, 1, &key, 5).await;
        let pool = env.pool.clone();
        let row = order(1, 1, &key, 5);
        let call = tokio::spawn(async move {
            let mut pooled = pool.get().await.unwrap();
            let conn: &mut AsyncPgConnection = &mut pooled;
            if by_hand {
                conn.batch_execute("BEGIN").await.unwrap();
                let _ = row.create_once(conn).await;
            } else {
                let _ = conn
                    .transaction::<_, AppError, _>(async |c| Ok(row.create_once(&mut *c).await?))
                    .await;
            }
        });
        blocked_pid(&env).await;
        call.abort();
        let _ = call.await;
        winner.batch_execute("ROLLBACK").await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let next = format!("next-{by_hand}");
        let answer = match env.pool.get().await {
            Ok(mut conn) => format!("{:?}", order(1, 2, &next, 1).create_once(&mut conn).await),
            Err(e) => format!("checkout: {e:?}"),
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        let (abandoned, committed) = (
            count_sql(
                &env,
                &format!("SELECT 1 FROM shop_orders WHERE request_id = '{key}'"),
            )
            .await,
            count_sql(
                &env,
                &format!("SELECT 1 FROM shop_orders WHERE request_id = '{next}'"),
            )
            .await,
        );
        assert_eq!(
            abandoned, 0,
            "by hand {by_hand}: the abandoned row committed; next: {answer}"
        );
        assert!(
            !answer.contains("Created") || committed == 1,
            "by hand {by_hand}: next answered {answer} but {committed} rows"
        );
        env.conn()
            .await
            .batch_execute("DELETE FROM shop_orders")
            .await
            .unwrap();
    }
}

/// Found by helper-50 (fixed by migration 17): the guard counted an
/// index's key columns and checked each was one of the tenant and key
/// columns, but not that each of them was covered: a unique index on
/// `(request_id, request_id)` (PostgreSQL accepts one) passed for
/// `(tenant_id, request_id)`, and a key tenant 1 held was answered
/// `Conflict` in tenant 2 (its existence leaked), a free one `Created`.
/// Failed 3 of 3 runs before. Now the index is refused, at the check and at
/// every create, with nothing written.
#[tokio::test]
async fn found_guard_accepts_an_index_that_omits_the_tenant() {
    let env = env46(2).await;
    let mut conn = env.conn().await;
    conn.batch_execute(
        "ALTER TABLE shop_orders DROP CONSTRAINT uk_idempotent_key;
         CREATE UNIQUE INDEX twice ON shop_orders (request_id, request_id)",
    )
    .await
    .unwrap();
    let check = idem::versioned::check_create_once::<ShopOrder>(&mut conn).await;
    let first = order(1, 1, "t1-secret", 1).create_once(&mut conn).await;
    let other_tenant = order(2, 1, "t1-secret", 1).create_once(&mut conn).await;
    let rows = env.orders().await.len();
    assert!(
        matches!(check, Err(CreateOnceError::NoUniqueIndex { .. }))
            && matches!(first, Err(CreateOnceError::NoUniqueIndex { .. }))
            && matches!(other_tenant, Err(CreateOnceError::NoUniqueIndex { .. }))
            && rows == 0,
        "check {check:?}; tenant 1: {first:?}; tenant 2 with tenant 1's key: {other_tenant:?}; rows {rows}"
    );
}

/// Without migration 16 the check and a create are `Database` errors naming
/// the function, and nothing is written.
#[tokio::test]
async fn attack46_without_migration_16_nothing_is_written() {
    let db = idem_testing::TestDatabase::create().await.unwrap();
    let mut conn = AsyncPgConnection::establish(db.url()).await.unwrap();
    conn.batch_execute(SCHEMA).await.unwrap();
    match idem::versioned::check_create_once::<ShopOrder>(&mut conn).await {
        Err(CreateOnceError::Database(e)) => {
            assert!(e.to_string().contains("idem_create_once_guard"), "{e}")
        }
        other => panic!("{other:?}"),
    }
    match order(1, 1, "nomig", 1).create_once(&mut conn).await {
        Err(CreateOnceError::Database(e)) => {
            assert!(e.to_string().contains("idem_create_once_guard"), "{e}")
        }
        other => panic!("{other:?}"),
    }
    let rows: i64 = shop_orders::table
        .count()
        .get_result(&mut conn)
        .await
        .unwrap();
    assert_eq!(rows, 0);
}

/// A 2 MB fingerprint value: the same is `Existing`, one byte off at the end
/// `Mismatch { ["note"] }` (and the error does not carry it); a NUL byte in
/// it is a typed `Database` error with nothing written.
#[tokio::test]
async fn attack46_huge_and_nul_fingerprint_values() {
    let env = env46(2).await;
    let mut conn = env.conn().await;
    let mut big = order(1, 1, "big-note", 1);
    big.note = Some("n".repeat(2 << 20));
    assert!(big.create_once(&mut conn).await.unwrap().is_created());
    assert!(matches!(
        big.create_once(&mut conn).await,
        Ok(Creation::Existing(_))
    ));
    let mut off = big.clone();
    off.note.as_mut().unwrap().push('!');
    let err = off.create_once(&mut conn).await.unwrap_err();
    assert!(matches!(&err, CreateOnceError::Mismatch { fields } if fields == &["note"]));
    assert!(err.to_string().len() < 1000 && format!("{err:?}").len() < 1000);
    let mut nul = order(1, 2, "nul-note", 1);
    nul.note = Some("a\0b".into());
    let answer = nul.create_once(&mut conn).await;
    assert!(
        matches!(answer, Err(CreateOnceError::Database(_))),
        "{answer:?}"
    );
    assert_eq!(env.orders().await.len(), 1);
}

/// With the version guard installed, a row deleted at version 5 and
/// created again continues above 5, as the docs promise for create_once;
/// also when, in between, create_once calls for that identity were refused
/// (`Mismatch`, `Conflict`: their INSERT met another row, and the guard's
/// BEFORE INSERT trigger fired for each, as the limits say).
#[tokio::test]
async fn attack46_version_guard_survives_refused_creates() {
    let env = env46(2).await;
    let mut conn = env.conn().await;
    idem::versioned::backstop::install_version_guard::<ShopOrder>(&mut conn)
        .await
        .unwrap();
    assert!(order(1, 2, "gone", 1)
        .create_once(&mut conn)
        .await
        .unwrap()
        .is_created());
    for _ in 0..5 {
        conn.batch_execute("UPDATE shop_orders SET version = version + 1 WHERE id = 2")
            .await
            .unwrap();
    }
    conn.batch_execute("DELETE FROM shop_orders WHERE id = 2")
        .await
        .unwrap();
    assert!(order(1, 3, "held", 1)
        .create_once(&mut conn)
        .await
        .unwrap()
        .is_created());
    // id 2 under a key that id 3 holds: Mismatch on id; nothing written.
    assert!(matches!(
        order(1, 2, "held", 1).create_once(&mut conn).await,
        Err(CreateOnceError::Mismatch { ref fields }) if fields == &["id"]
    ));
    // id 3 under a new key: Conflict on the primary key.
    assert!(matches!(
        order(1, 3, "new", 1).create_once(&mut conn).await,
        Err(CreateOnceError::Conflict)
    ));
    match order(1, 2, "back", 1).create_once(&mut conn).await {
        Ok(Creation::Created(row)) => assert!(
            row.version > 5,
            "version {} after a delete at 5",
            row.version
        ),
        other => panic!("{other:?}"),
    }
    assert_eq!(env.orders().await.len(), 2);
}

/// One transaction creating a key twice (a handler that retries inside its
/// own transaction), at every level under the retry loop: `Created`, then
/// `Existing` with the same row (its own uncommitted row), then `Mismatch`
/// for another amount; one row committed.
#[tokio::test]
async fn attack46_the_same_key_twice_in_one_transaction() {
    let env = env46(2).await;
    for (n, isolation) in LEVELS.into_iter().enumerate() {
        let key = format!("twice-{n}");
        let policy = RetryPolicy::new()
            .isolation(isolation)
            .max_attempts(4)
            .deadline(Duration::from_secs(10));
        let (a, b, c) = retry(&env.pool, policy, "twice", |conn| {
            let key = key.clone();
            async move {
                let a = order(1, n as i64, &key, 1).create_once(conn).await?;
                let b = order(1, n as i64, &key, 1).create_once(conn).await?;
                let c = order(1, n as i64, &key, 2).create_once(conn).await;
                Ok::<_, AppError>((a, b, c))
            }
            .scope_boxed()
        })
        .await
        .unwrap();
        assert!(a.is_created(), "{isolation:?}");
        assert_eq!(b, Creation::Existing(a.row().clone()), "{isolation:?}");
        assert!(
            matches!(c, Err(CreateOnceError::Mismatch { ref fields }) if fields == &["amount"])
        );
    }
    assert_eq!(env.orders().await.len(), 3);
}

/// A routine `REINDEX INDEX CONCURRENTLY` of the key's index, five times,
/// while 6 creators each create 30 keys (every one new, every create
/// repeated once) under the retry loop at READ COMMITTED: the index is
/// never missing, so every answer is `Created` then `Existing`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn attack46_reindex_concurrently_under_load() {
    let env = unique_k(8).await;
    let tasks: Vec<_> = (0..6i64)
        .map(|t| {
            let pool = env.pool.clone();
            tokio::spawn(async move {
                let policy = RetryPolicy::new()
                    .isolation(Isolation::ReadCommitted)
                    .max_attempts(4)
                    .deadline(Duration::from_secs(20));
                let mut wrong = Vec::new();
                for k in 0..30i64 {
                    let row = loose(t * 100 + k, &format!("r{t}-{k}"));
                    for expect_created in [true, false] {
                        let answer = retry(&pool, policy, "reindex", |c| {
                            let row = row.clone();
                            async move { Ok::<_, AppError>(row.create_once(c).await?) }
                                .scope_boxed()
                        })
                        .await;
                        match answer {
                            Ok(a) if a.is_created() == expect_created => {}
                            other => wrong.push(format!("{t}/{k}: {other:?}")),
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                wrong
            })
        })
        .collect();
    let mut ddl = env.conn().await;
    for _ in 0..5 {
        ddl.batch_execute("REINDEX INDEX CONCURRENTLY k")
            .await
            .unwrap();
    }
    let mut wrong = Vec::new();
    for task in tasks {
        wrong.extend(task.await.unwrap());
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
    assert_eq!(count_sql(&env, "SELECT 1 FROM loose_orders").await, 180);
}
