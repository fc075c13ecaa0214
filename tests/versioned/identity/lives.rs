//! A version that repeats (TRUNCATE, tombstones purged sooner than
//! records, a delete and re-insert without the backstop) is never taken for
//! the write a record was made with; a transition made inside a savepoint,
//! and a row frozen by VACUUM since, are still recognised.

use super::*;

/// Make `Pending -> Paid` from 0 on pay (1, 1), then `reset` the table
/// (so that the key's version starts again), insert the row at version 0
/// and set it `Paid` with a plain update: at version 1, in `Paid`, as the
/// transition left it, but never by it. Its repeat must be `Stale`.
async fn repeated_version(conn: &mut AsyncPgConnection, reset: &[&str]) {
    let new = Pay {
        tenant_id: 1,
        id: 1,
        status: Pending,
        version: 0,
    };
    new.insert(conn).await.unwrap();
    assert_eq!(
        kind(&pay_transition(conn, 0, Pending, Paid).await),
        "Applied"
    );
    for statement in reset {
        // One statement at a time: each in its own transaction.
        conn.batch_execute(statement).await.unwrap();
    }
    let again = new.insert(conn).await.unwrap();
    assert_eq!(again.version, 0, "the version starts again");
    Pay::update(1)
        .tenant(1)
        .expect_version(0)
        .set(&PayStatus { status: Paid })
        .execute(conn)
        .await
        .unwrap();
    let before = stored(conn, "pays", 1).await;
    assert_eq!((before.status.as_str(), before.version), ("paid", 1));

    let repeat = pay_transition(conn, 0, Pending, Paid).await;
    assert_eq!(kind(&repeat), "Stale(0, 1)", "this row never made the edge");
    assert_eq!(stored(conn, "pays", 1).await, before);
    // The record is the first life's, and stays as it was.
    let kept = records(conn).await;
    assert_eq!(kept.len(), 1);
    assert_eq!((kept[0].2, kept[0].4.as_str()), (1, "paid"));
}

/// TRUNCATE fires no row trigger, so even with the backstop the versions of
/// a re-inserted key start again.
#[tokio::test]
async fn a_version_repeated_after_truncate_is_no_duplicate() {
    let (_db, mut conn) = identity_db().await;
    install_version_guard::<Pay>(&mut conn).await.unwrap();
    repeated_version(&mut conn, &["TRUNCATE pays"]).await;
}

/// Tombstones purged sooner than the records of transitions: the backstop
/// no longer remembers the deleted row, and its versions start again.
#[tokio::test]
async fn a_version_repeated_after_tombstones_are_purged_is_no_duplicate() {
    let (_db, mut conn) = identity_db().await;
    install_version_guard::<Pay>(&mut conn).await.unwrap();
    let purge = [
        "DELETE FROM pays WHERE tenant_id = 1 AND id = 1",
        "SELECT idem_purge_version_tombstones(interval '0')",
    ];
    repeated_version(&mut conn, &purge).await;
    // Deleted with the backstop and purged: no tombstone is left.
    let tombstones: i64 = diesel::select(diesel::dsl::sql::<BigInt>(
        "(SELECT count(*) FROM idem_version_tombstones)",
    ))
    .get_result(&mut conn)
    .await
    .unwrap();
    assert_eq!(tombstones, 0);
}

/// Without the backstop a deleted and re-inserted row starts at version 0:
/// the record of its previous life does not match its new one.
#[tokio::test]
async fn a_row_deleted_and_inserted_again_without_the_backstop() {
    let (_db, mut conn) = identity_db().await;
    repeated_version(&mut conn, &["DELETE FROM pays"]).await;
}

/// Inside `conn.transaction(..)` within a transaction the UPDATE runs in a
/// savepoint, and the row version's `xmin` is the subtransaction's id, not
/// the transaction's: the record is bound to what the UPDATE wrote, so the
/// repeat is still a duplicate, after the savepoint is released and after
/// the commit.
#[tokio::test]
async fn a_transition_made_in_a_savepoint_is_recognised() {
    let (_db, mut conn) = identity_db().await;
    conn.batch_execute("INSERT INTO pays VALUES (1, 1, 'pending', 0)")
        .await
        .unwrap();
    let inside = conn
        .transaction::<_, diesel::result::Error, _>(async |conn| {
            diesel::sql_query("SELECT pg_current_xact_id()")
                .execute(conn)
                .await?;
            let applied = conn
                .transaction::<_, diesel::result::Error, _>(async |conn| {
                    Ok(kind(&pay_transition(conn, 0, Pending, Paid).await))
                })
                .await?;
            let repeat = kind(&pay_transition(conn, 0, Pending, Paid).await);
            #[derive(QueryableByName)]
            struct Xids {
                #[diesel(sql_type = Text)]
                top: String,
                #[diesel(sql_type = Text)]
                row: String,
            }
            let xids: Xids = diesel::sql_query(
                "SELECT pg_current_xact_id()::text AS top, xmin::text AS row FROM pays",
            )
            .get_result(conn)
            .await?;
            Ok((applied, repeat, xids.top != xids.row))
        })
        .await
        .unwrap();
    assert_eq!(
        inside,
        ("Applied".into(), "Duplicate".into(), true),
        "(transition, its repeat, whether the row's xmin is a subtransaction's)"
    );
    assert_eq!(
        kind(&pay_transition(&mut conn, 0, Pending, Paid).await),
        "Duplicate"
    );

    // A transition in a savepoint rolled back leaves neither row nor record.
    conn.transaction::<_, diesel::result::Error, _>(async |conn| {
        let nested = conn
            .transaction::<(), _, _>(async |conn| {
                assert_eq!(
                    kind(&pay_transition(conn, 1, Paid, Shipped).await),
                    "Applied"
                );
                Err(diesel::result::Error::RollbackTransaction)
            })
            .await;
        assert!(nested.is_err());
        Ok(())
    })
    .await
    .unwrap();
    assert_eq!(stored(&mut conn, "pays", 1).await.version, 1);
    let kept = records(&mut conn).await;
    assert_eq!((kept.len(), kept[0].2, kept[0].4.as_str()), (1, 1, "paid"));
    assert_eq!(
        kind(&pay_transition(&mut conn, 1, Paid, Shipped).await),
        "Applied"
    );
}

/// A transaction that makes the transition and then writes the row again:
/// the same `xmin`, but the version moved on, so the repeat is `Stale`.
#[tokio::test]
async fn a_row_written_again_by_the_same_transaction_is_stale() {
    let (_db, mut conn) = identity_db().await;
    conn.batch_execute("INSERT INTO pays VALUES (1, 1, 'pending', 0)")
        .await
        .unwrap();
    conn.transaction::<_, VersionedError, _>(async |conn| {
        pay_transition(conn, 0, Pending, Paid).await?;
        Pay::update(1)
            .tenant(1)
            .expect_version(1)
            .set(&PayStatus { status: Paid })
            .execute(conn)
            .await?;
        Ok(())
    })
    .await
    .unwrap();
    assert_eq!(
        kind(&pay_transition(&mut conn, 0, Pending, Paid).await),
        "Stale(0, 2)"
    );
    assert_eq!(
        kind(&pay_transition(&mut conn, 1, Pending, Paid).await),
        "Stale(1, 2)"
    );
}

/// `VACUUM FREEZE` marks the row version frozen but keeps its `xmin`
/// readable (PostgreSQL 9.4 and later): a duplicate stays a duplicate.
#[tokio::test]
async fn a_frozen_row_keeps_its_duplicate() {
    let (_db, mut conn) = identity_db().await;
    conn.batch_execute("INSERT INTO pays VALUES (1, 1, 'pending', 0)")
        .await
        .unwrap();
    assert_eq!(
        kind(&pay_transition(&mut conn, 0, Pending, Paid).await),
        "Applied"
    );
    let before = stored(&mut conn, "pays", 1).await;
    conn.batch_execute("VACUUM (FREEZE) pays").await.unwrap();
    // Frozen: the live version's infomask has both HEAP_XMIN_COMMITTED and
    // HEAP_XMIN_INVALID set (0x0300, HEAP_XMIN_FROZEN), yet its xmin reads
    // as it was written.
    conn.batch_execute("CREATE EXTENSION pageinspect")
        .await
        .unwrap();
    let frozen: bool = diesel::select(diesel::dsl::sql::<diesel::sql_types::Bool>(
        "(SELECT bool_and(t_infomask & 768 = 768) FROM heap_page_items(get_raw_page('pays', 0)) \
          WHERE t_xmin::text = (SELECT xmin::text FROM pays))",
    ))
    .get_result(&mut conn)
    .await
    .unwrap();
    assert!(frozen, "the row is frozen");
    assert_eq!(stored(&mut conn, "pays", 1).await, before);
    assert_eq!(
        kind(&pay_transition(&mut conn, 0, Pending, Paid).await),
        "Duplicate"
    );
}

/// A record left by an earlier build (migration 11: named by the table's
/// text, bound to no write) never makes a duplicate.
#[tokio::test]
async fn a_record_of_an_earlier_build_is_no_duplicate() {
    let (_db, mut conn) = identity_db().await;
    conn.batch_execute(
        "INSERT INTO pays VALUES (1, 1, 'paid', 1); \
         INSERT INTO idem_transitions (table_name, identity, version, from_state, to_state) \
         VALUES ('\"pays\"', '[1, 1]', 1, 'pending', 'paid');",
    )
    .await
    .unwrap();
    assert_eq!(
        kind(&pay_transition(&mut conn, 0, Pending, Paid).await),
        "Stale(0, 1)"
    );
}

/// The record as stored: the table's oid, the edge, and the full id of the
/// transaction that wrote the row version, whose low 32 bits are the row's
/// `xmin`; and no table text.
#[tokio::test]
async fn a_record_holds_its_tables_oid_and_its_writes_xid() {
    let (_db, mut conn) = identity_db().await;
    conn.batch_execute("INSERT INTO pays VALUES (1, 1, 'pending', 0)")
        .await
        .unwrap();
    assert_eq!(
        kind(&pay_transition(&mut conn, 0, Pending, Paid).await),
        "Applied"
    );
    #[derive(QueryableByName, Debug, PartialEq)]
    struct Bound {
        #[diesel(sql_type = diesel::sql_types::Bool)]
        table_is_pays: bool,
        #[diesel(sql_type = diesel::sql_types::Bool)]
        no_table_name: bool,
        #[diesel(sql_type = diesel::sql_types::Bool)]
        xid_is_the_rows: bool,
        #[diesel(sql_type = diesel::sql_types::Bool)]
        xid_is_current: bool,
    }
    let bound: Bound = diesel::sql_query(
        "SELECT r.table_oid = 'pays'::regclass AS table_is_pays, \
                r.table_name IS NULL AS no_table_name, \
                r.row_xid % 4294967296 = p.xmin::text::bigint AS xid_is_the_rows, \
                r.row_xid <= pg_snapshot_xmax(pg_current_snapshot())::text::bigint \
                  AND r.row_xid > pg_snapshot_xmax(pg_current_snapshot())::text::bigint - 1000 \
                  AS xid_is_current \
         FROM idem_transitions r, pays p",
    )
    .get_result(&mut conn)
    .await
    .unwrap();
    assert_eq!(
        bound,
        Bound {
            table_is_pays: true,
            no_table_name: true,
            xid_is_the_rows: true,
            xid_is_current: true,
        }
    );
}
