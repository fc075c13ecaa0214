//! The unique index `create_once` stands on: without one it can name, a
//! create writes nothing; the check follows the table's indexes and the
//! `search_path` on a connection whose statement is long prepared.

use super::*;

#[tokio::test]
async fn without_the_unique_index_nothing_is_written() {
    let env = env(2).await;
    let mut conn = env.conn().await;
    let row = LooseOrder {
        id: 1,
        request_id: "r".into(),
        amount: 5,
        version: 0,
    };
    // No index, an index on the key plus another column, a partial one, a
    // deferrable one: none makes a repeated create fail.
    for (index, says) in [
        (None, "(request_id)"),
        (
            Some("CREATE UNIQUE INDEX two ON loose_orders (request_id, amount)"),
            "(request_id)",
        ),
        (
            Some("CREATE UNIQUE INDEX part ON loose_orders (request_id) WHERE amount > 0"),
            "(request_id)",
        ),
        (
            Some("ALTER TABLE loose_orders ADD CONSTRAINT later UNIQUE (request_id) DEFERRABLE"),
            "deferrable",
        ),
    ] {
        if let Some(sql) = index {
            conn.batch_execute(sql).await.unwrap();
        }
        assert_unguarded(row.create_once(&mut conn).await, says);
        assert_eq!(count(&mut conn).await, 0, "{index:?}");
        conn.batch_execute("DROP INDEX IF EXISTS two, part; ALTER TABLE loose_orders DROP CONSTRAINT IF EXISTS later")
            .await
            .unwrap();
    }
    conn.batch_execute("CREATE UNIQUE INDEX ON loose_orders (request_id)")
        .await
        .unwrap();
    idem::versioned::check_create_once::<LooseOrder>(&mut conn)
        .await
        .unwrap();
    assert!(row.create_once(&mut conn).await.unwrap().is_created());
    assert!(!row.create_once(&mut conn).await.unwrap().is_created());
    assert_eq!(count(&mut conn).await, 1);
}

fn assert_unguarded(answer: Result<Creation<LooseOrder>, CreateOnceError>, expected: &str) {
    match answer {
        Err(e @ CreateOnceError::NoUniqueIndex { .. }) => {
            assert_eq!(e.http_status(), 500);
            let text = e.to_string();
            assert!(
                text.contains("loose_orders") && text.contains(expected),
                "{text}"
            );
        }
        other => panic!("expected NoUniqueIndex ({expected}), got {other:?}"),
    }
}

/// The guard is part of the INSERT's plan: PostgreSQL plans it again when
/// the table's indexes or the search_path change, on a connection whose
/// statement is long prepared (more than five runs: a generic plan).
#[tokio::test]
async fn the_check_follows_the_index_and_the_search_path() {
    let env = env(2).await;
    let mut conn = env.conn().await;
    conn.batch_execute(
        "CREATE UNIQUE INDEX loose_key ON loose_orders (request_id);
         CREATE SCHEMA other;
         CREATE TABLE other.loose_orders (LIKE public.loose_orders INCLUDING DEFAULTS);",
    )
    .await
    .unwrap();
    let row = |n: i64| LooseOrder {
        id: n,
        request_id: format!("r{n}"),
        amount: 5,
        version: 0,
    };
    for n in 0..8 {
        assert!(row(n).create_once(&mut conn).await.unwrap().is_created());
    }
    // The INSERT is prepared, and PostgreSQL runs it on a plan it keeps (a
    // generic plan after five runs): the guard is planned, not run, per call.
    let prepared: i64 = diesel::sql_query(
        "SELECT count(*) AS n FROM pg_prepared_statements
         WHERE statement LIKE '%idem_create_once_guard%' AND generic_plans >= 2",
    )
    .get_result::<Count>(&mut conn)
    .await
    .unwrap()
    .n;
    assert_eq!(prepared, 1);
    // A same-named table without the index, through the search_path.
    conn.batch_execute("SET search_path = other, public")
        .await
        .unwrap();
    for _ in 0..2 {
        assert_unguarded(row(100).create_once(&mut conn).await, "(request_id)");
    }
    conn.batch_execute("RESET search_path").await.unwrap();
    assert!(row(8).create_once(&mut conn).await.unwrap().is_created());
    // The index dropped after all those creates.
    conn.batch_execute("DROP INDEX loose_key").await.unwrap();
    assert_unguarded(row(9).create_once(&mut conn).await, "(request_id)");
    // Created in a transaction that rolled back.
    conn.batch_execute("BEGIN; CREATE UNIQUE INDEX loose_key ON loose_orders (request_id)")
        .await
        .unwrap();
    assert!(row(9).create_once(&mut conn).await.unwrap().is_created());
    conn.batch_execute("ROLLBACK").await.unwrap();
    assert_unguarded(row(10).create_once(&mut conn).await, "(request_id)");
    // The index back, and an unrelated deferrable constraint, which
    // ON CONFLICT refuses.
    conn.batch_execute(
        "CREATE UNIQUE INDEX loose_key ON loose_orders (request_id);
         ALTER TABLE loose_orders ADD CONSTRAINT pos UNIQUE (amount, id) DEFERRABLE",
    )
    .await
    .unwrap();
    assert_unguarded(row(11).create_once(&mut conn).await, "deferrable");
    assert!(matches!(
        idem::versioned::check_create_once::<LooseOrder>(&mut conn).await,
        Err(CreateOnceError::NoUniqueIndex { .. })
    ));
    conn.batch_execute("ALTER TABLE loose_orders DROP CONSTRAINT pos")
        .await
        .unwrap();
    assert!(row(11).create_once(&mut conn).await.unwrap().is_created());
    let ids: Vec<i64> = loose_orders::table
        .select(loose_orders::id)
        .order(loose_orders::id)
        .load(&mut conn)
        .await
        .unwrap();
    assert_eq!(ids, [0, 1, 2, 3, 4, 5, 6, 7, 8, 11]);
    let other: i64 = diesel::sql_query("SELECT count(*) AS n FROM other.loose_orders")
        .get_result::<Count>(&mut conn)
        .await
        .unwrap()
        .n;
    assert_eq!(other, 0, "nothing written through the other schema");
}

async fn count(conn: &mut AsyncPgConnection) -> i64 {
    loose_orders::table.count().get_result(conn).await.unwrap()
}
