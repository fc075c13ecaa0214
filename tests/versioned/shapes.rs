//! The other model shapes the derive supports: no tenant, a composite key, an `i32` version.

use super::*;

#[tokio::test]
async fn untenanted_model() {
    let (_db, mut conn) = setup().await;
    let stored = Setting {
        name: "mode".into(),
        value: "a".into(),
        version: 9,
    }
    .insert(&mut conn)
    .await
    .unwrap();
    assert_eq!(stored.version, 0);

    let read = Setting::find("mode".to_owned())
        .load(&mut conn)
        .await
        .unwrap();
    let written = Setting::update("mode".to_owned())
        .expect_version(read.version)
        .set(&SetValue { value: "b".into() })
        .execute(&mut conn)
        .await
        .unwrap();
    assert_eq!((written.value.as_str(), written.version), ("b", 1));

    let err = Setting::update("mode".to_owned())
        .expect_version(0)
        .set(&SetValue { value: "c".into() })
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert_stale(&err, 0, 1);
    let err = Setting::update("other".to_owned())
        .expect_version(0)
        .set(&SetValue { value: "c".into() })
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert_not_found(&err);
    let err = Setting::delete("mode".to_owned())
        .expect_version(0)
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert_stale(&err, 0, 1);
    assert_eq!(
        Setting::find("mode".to_owned())
            .load(&mut conn)
            .await
            .unwrap(),
        written
    );
    Setting::delete("mode".to_owned())
        .expect_version(1)
        .execute(&mut conn)
        .await
        .unwrap();
    let err = Setting::find("mode".to_owned())
        .load(&mut conn)
        .await
        .unwrap_err();
    assert_not_found(&err);
}

#[tokio::test]
async fn composite_key_model_writes_exactly_one_row() {
    let (_db, mut conn) = setup().await;
    let line = |tenant_id, order_id, line_no| OrderLine {
        tenant_id,
        order_id,
        line_no,
        qty: 1,
        version: 0,
    };
    // Rows that share every part of the key but one with the row written.
    for l in [line(1, 1, 1), line(1, 1, 2), line(1, 2, 1), line(2, 1, 1)] {
        l.insert(&mut conn).await.unwrap();
    }

    let written = OrderLine::update((1, 1))
        .tenant(1)
        .expect_version(0)
        .set(&SetQty { qty: 5 })
        .execute(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        written,
        OrderLine {
            qty: 5,
            version: 1,
            ..line(1, 1, 1)
        }
    );

    let err = OrderLine::update((1, 1))
        .tenant(1)
        .expect_version(0)
        .set(&SetQty { qty: 6 })
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert_stale(&err, 0, 1);
    let err = OrderLine::update((1, 3))
        .tenant(1)
        .expect_version(0)
        .set(&SetQty { qty: 6 })
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert_not_found(&err);
    let err = OrderLine::delete((1, 2))
        .tenant(1)
        .expect_version(1)
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert_stale(&err, 1, 0);

    let rows: Vec<(i64, i64, i32, i32, i64)> = order_lines::table
        .select((
            order_lines::tenant_id,
            order_lines::order_id,
            order_lines::line_no,
            order_lines::qty,
            order_lines::version,
        ))
        .order((
            order_lines::tenant_id,
            order_lines::order_id,
            order_lines::line_no,
        ))
        .load(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        rows,
        vec![
            (1, 1, 1, 5, 1),
            (1, 1, 2, 1, 0),
            (1, 2, 1, 1, 0),
            (2, 1, 1, 1, 0)
        ]
    );
}

#[tokio::test]
async fn i32_version_column() {
    let (_db, mut conn) = setup().await;
    Counter {
        tenant_id: 1,
        id: 1,
        hits: 0,
        version: 3,
    }
    .insert(&mut conn)
    .await
    .unwrap();
    let written = Counter::update(1)
        .tenant(1)
        .expect_version(0)
        .set(&SetHits { hits: 1 })
        .execute(&mut conn)
        .await
        .unwrap();
    assert_eq!((written.hits, written.version), (1, 1));
    assert_eq!(written.version(), 1_i64);

    let err = Counter::update(1)
        .tenant(1)
        .expect_version(0)
        .set(&SetHits { hits: 2 })
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert_stale(&err, 0, 1);

    // Versions no i32 column can hold: stale, not a panic and not a database error.
    for too_big in [i64::from(i32::MAX) + 2, 1 << 40, i64::MAX, i64::MIN, -1] {
        let err = Counter::update(1)
            .tenant(1)
            .expect_version(too_big)
            .set(&SetHits { hits: 2 })
            .execute(&mut conn)
            .await
            .unwrap_err();
        assert_stale(&err, too_big, 1);
        let err = Counter::delete(1)
            .tenant(1)
            .expect_version(too_big)
            .execute(&mut conn)
            .await
            .unwrap_err();
        assert_stale(&err, too_big, 1);
    }
    // ... and NotFound when there is no row to be stale against.
    let err = Counter::update(2)
        .tenant(1)
        .expect_version(1 << 40)
        .set(&SetHits { hits: 2 })
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert_not_found(&err);

    let stored = Counter::find(1).tenant(1).load(&mut conn).await.unwrap();
    assert_eq!(stored, written);
}
