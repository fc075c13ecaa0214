//! `check_create_once` on a hot standby (a read-only server in recovery).

use idem_testing::replica::{ReplicaPair, Replication};

use super::*;

/// `check_create_once` against a hot standby (a read pool on a replica):
/// the guard's EXPLAIN plans an INSERT, which takes RowExclusiveLock, the
/// strongest lock a server in recovery still grants, and writes nothing:
/// Ok for the replicated `p48_orders`, `NoUniqueIndex` for `loose_orders`.
/// A create there is refused by PostgreSQL as a write in a read-only
/// transaction (`CreateOnceError::Database`), nothing written on the primary.
#[tokio::test]
async fn attack48_check_create_once_works_on_a_hot_standby() {
    let pair = ReplicaPair::start(Replication::Async)
        .await
        .expect("a primary and a standby");
    pair.create_database("s48").await.expect("a database");
    let mut primary = AsyncPgConnection::establish(&pair.primary_url_for("s48"))
        .await
        .unwrap();
    primary.batch_execute(SCHEMA).await.unwrap();
    idem::migrate(&mut primary).await.unwrap();
    primary.batch_execute(P48_TABLE).await.unwrap();
    // The check passes on the primary.
    idem::versioned::check_create_once::<P48Order>(&mut primary)
        .await
        .unwrap();
    pair.wait_caught_up(Duration::from_secs(30)).await.unwrap();
    let mut standby = AsyncPgConnection::establish(&pair.standby_url_for("s48"))
        .await
        .unwrap();
    let on_standby = idem::versioned::check_create_once::<P48Order>(&mut standby).await;
    let loose = idem::versioned::check_create_once::<LooseOrder>(&mut standby).await;
    assert!(
        on_standby.is_ok() && matches!(loose, Err(CreateOnceError::NoUniqueIndex { .. })),
        "p48_orders on the standby: {on_standby:?}; loose_orders: {loose:?}"
    );
    let create = p48(1, 1, "k").create_once(&mut standby).await;
    assert!(
        matches!(&create, Err(CreateOnceError::Database(e)) if e.to_string().contains("read-only")),
        "{create:?}"
    );
    let rows: i64 = diesel::dsl::select(diesel::dsl::sql::<diesel::sql_types::BigInt>(
        "(SELECT count(*) FROM p48_orders)",
    ))
    .get_result(&mut primary)
    .await
    .unwrap();
    assert_eq!(rows, 0);
}
