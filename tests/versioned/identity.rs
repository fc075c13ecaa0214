//! What a transition's record is bound to: the table as the server resolved
//! it, and the very write that made the row's current version.
//!
//! Two schemas with a table of the same name (schema per tenant, one
//! unqualified diesel table reached through `search_path`) never share
//! records; and a version that repeats (TRUNCATE, tombstones purged sooner
//! than records, a delete and re-insert without the backstop) is never taken
//! for the write the record was made with. Both were answered `Duplicate`
//! for rows that never made the transition. What a record must still
//! recognise is checked too: a transition made inside a savepoint, and a row
//! frozen by VACUUM since.

use diesel::sql_types::Nullable;
use idem::versioned::backstop::install_version_guard;
use idem::versioned::Transitioned;
use idem::States;

use super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq, States)]
#[states(Pending => [Paid, Cancelled], Paid => [Shipped])]
enum Status {
    Pending,
    Paid,
    Shipped,
    Cancelled,
}

use Status::{Cancelled, Paid, Pending, Shipped};

// One unqualified table: which one a statement writes is the search_path's
// choice, as with a schema per tenant.
diesel::table! {
    orders (id) {
        id -> Int8,
        status -> Text,
        version -> Int8,
    }
}

#[derive(Debug, Clone, PartialEq, Queryable, Selectable, Versioned)]
#[diesel(table_name = orders)]
#[versioned(tenant = none, key = id, state = status)]
struct Order {
    id: i64,
    status: Status,
    version: i64,
}

#[derive(VersionedChanges)]
#[versioned(model = Order)]
#[diesel(table_name = orders)]
struct OrderStatus {
    status: Status,
}

diesel::table! {
    pays (tenant_id, id) {
        tenant_id -> Int8,
        id -> Int8,
        status -> Text,
        version -> Int8,
    }
}

#[derive(Debug, Clone, PartialEq, Queryable, Selectable, Versioned)]
#[diesel(table_name = pays)]
#[versioned(tenant = tenant_id, key = id, state = status)]
struct Pay {
    tenant_id: i64,
    id: i64,
    status: Status,
    version: i64,
}

#[derive(VersionedChanges)]
#[versioned(model = Pay)]
#[diesel(table_name = pays)]
struct PayStatus {
    status: Status,
}

const TABLES: &str = "
CREATE SCHEMA tenant_a;
CREATE SCHEMA tenant_b;
CREATE TABLE tenant_a.orders (id bigint PRIMARY KEY, status text NOT NULL, version bigint NOT NULL DEFAULT 0 CHECK (version >= 0));
CREATE TABLE tenant_b.orders (id bigint PRIMARY KEY, status text NOT NULL, version bigint NOT NULL DEFAULT 0 CHECK (version >= 0));
INSERT INTO tenant_a.orders (id, status) VALUES (1, 'pending');
INSERT INTO tenant_b.orders (id, status) VALUES (1, 'pending');
CREATE TABLE pays (tenant_id bigint NOT NULL, id bigint NOT NULL, status text NOT NULL, version bigint NOT NULL DEFAULT 0 CHECK (version >= 0), PRIMARY KEY (tenant_id, id));
";

/// A fresh database with idem's migrations (idem's tables in `public`) and
/// the tables above.
async fn identity_db() -> (idem_testing::TestDatabase, AsyncPgConnection) {
    let db = idem_testing::TestDatabase::create().await.unwrap();
    let mut conn = AsyncPgConnection::establish(db.url()).await.unwrap();
    idem::migrate(&mut conn).await.unwrap();
    conn.batch_execute(TABLES).await.unwrap();
    (db, conn)
}

/// A connection whose unqualified `orders` is `<schema>.orders`.
async fn tenant(db: &idem_testing::TestDatabase, schema: &str) -> AsyncPgConnection {
    let mut conn = AsyncPgConnection::establish(db.url()).await.unwrap();
    conn.batch_execute(&format!("SET search_path = {schema}, public"))
        .await
        .unwrap();
    conn
}

async fn order_transition(
    conn: &mut AsyncPgConnection,
    version: i64,
    from: Status,
    to: Status,
) -> Result<Transitioned<Order>, VersionedError> {
    Order::update(1)
        .expect_version(version)
        .transition(from, to)
        .execute(conn)
        .await
}

async fn pay_transition(
    conn: &mut AsyncPgConnection,
    version: i64,
    from: Status,
    to: Status,
) -> Result<Transitioned<Pay>, VersionedError> {
    Pay::update(1)
        .tenant(1)
        .expect_version(version)
        .transition(from, to)
        .execute(conn)
        .await
}

fn kind<T: std::fmt::Debug>(outcome: &Result<Transitioned<T>, VersionedError>) -> String {
    match outcome {
        Ok(Transitioned::Applied(_)) => "Applied".into(),
        Ok(Transitioned::Duplicate(_)) => "Duplicate".into(),
        Err(VersionedError::Stale { expected, actual }) => format!("Stale({expected}, {actual})"),
        Err(other) => format!("{other:?}"),
    }
}

#[derive(QueryableByName, Debug, PartialEq)]
struct Stored {
    #[diesel(sql_type = Text)]
    status: String,
    #[diesel(sql_type = BigInt)]
    version: i64,
    #[diesel(sql_type = Text)]
    xmin: String,
}

/// A row as its table holds it (`table` schema-qualified or not), with its
/// `xmin`, which every write changes.
async fn stored(conn: &mut AsyncPgConnection, table: &str, id: i64) -> Stored {
    diesel::sql_query(format!(
        "SELECT status, version, xmin::text AS xmin FROM {table} WHERE id = $1"
    ))
    .bind::<BigInt, _>(id)
    .get_result(conn)
    .await
    .unwrap()
}

/// The records of `idem_transitions` as `(table, identity, version, from,
/// to)`, the table as the server names it from `public`.
async fn records(conn: &mut AsyncPgConnection) -> Vec<(String, String, i64, String, String)> {
    #[derive(QueryableByName)]
    struct Record {
        #[diesel(sql_type = Nullable<Text>)]
        table_oid: Option<String>,
        #[diesel(sql_type = Text)]
        identity: String,
        #[diesel(sql_type = BigInt)]
        version: i64,
        #[diesel(sql_type = Text)]
        from_state: String,
        #[diesel(sql_type = Text)]
        to_state: String,
    }
    conn.batch_execute("SET search_path = public")
        .await
        .unwrap();
    diesel::sql_query(
        "SELECT table_oid::text AS table_oid, identity::text AS identity, version, from_state, \
         to_state FROM idem_transitions ORDER BY 1, 2",
    )
    .load::<Record>(conn)
    .await
    .unwrap()
    .into_iter()
    .map(|r| {
        (
            r.table_oid.unwrap_or_default(),
            r.identity,
            r.version,
            r.from_state,
            r.to_state,
        )
    })
    .collect()
}

fn record(
    table: &str,
    version: i64,
    from: &str,
    to: &str,
) -> (String, String, i64, String, String) {
    (table.into(), "[1]".into(), version, from.into(), to.into())
}

/// Tenant A's row 1 made `Pending -> Paid`; tenant B's row 1 reached `Paid`
/// at version 1 by a plain update. B's `Pending -> Paid` from 0 was never
/// made: `Stale`, though the table's name, the key, the version and the edge
/// are all A's.
#[tokio::test]
async fn a_table_of_the_same_name_in_another_schema_shares_no_record() {
    let (db, mut setup) = identity_db().await;
    let (mut a, mut b) = (tenant(&db, "tenant_a").await, tenant(&db, "tenant_b").await);

    let applied = order_transition(&mut a, 0, Pending, Paid).await;
    assert_eq!(kind(&applied), "Applied");
    Order::update(1)
        .expect_version(0)
        .set(&OrderStatus { status: Paid })
        .execute(&mut b)
        .await
        .unwrap();
    let b_before = stored(&mut setup, "tenant_b.orders", 1).await;
    assert_eq!((b_before.status.as_str(), b_before.version), ("paid", 1));

    let repeat = order_transition(&mut b, 0, Pending, Paid).await;
    assert_eq!(kind(&repeat), "Stale(0, 1)", "B's row never made the edge");
    // A's own repeat is still its duplicate.
    assert_eq!(
        kind(&order_transition(&mut a, 0, Pending, Paid).await),
        "Duplicate"
    );

    // Nothing written, and the one record names A's table.
    assert_eq!(stored(&mut setup, "tenant_b.orders", 1).await, b_before);
    assert_eq!(
        records(&mut setup).await,
        [record("tenant_a.orders", 1, "pending", "paid")]
    );
}

/// The other way round: B's own transition must not replace A's record, or
/// A's genuine repeat is refused.
#[tokio::test]
async fn another_schemas_transition_does_not_replace_the_record() {
    let (db, mut setup) = identity_db().await;
    let (mut a, mut b) = (tenant(&db, "tenant_a").await, tenant(&db, "tenant_b").await);

    assert_eq!(
        kind(&order_transition(&mut a, 0, Pending, Paid).await),
        "Applied"
    );
    assert_eq!(
        kind(&order_transition(&mut b, 0, Pending, Cancelled).await),
        "Applied"
    );
    assert_eq!(
        kind(&order_transition(&mut a, 0, Pending, Paid).await),
        "Duplicate",
        "A's row made Pending -> Paid from 0"
    );
    assert_eq!(
        kind(&order_transition(&mut b, 0, Pending, Cancelled).await),
        "Duplicate"
    );
    assert_eq!(
        kind(&order_transition(&mut b, 0, Pending, Paid).await),
        "Stale(0, 1)"
    );
    assert_eq!(
        records(&mut setup).await,
        [
            record("tenant_a.orders", 1, "pending", "paid"),
            record("tenant_b.orders", 1, "pending", "cancelled"),
        ]
    );
}

/// One connection that moves between tenants: the transition's statement
/// is prepared once, and each execution still names the table its
/// `search_path` resolves.
#[tokio::test]
async fn one_connection_across_search_paths() {
    let (db, mut setup) = identity_db().await;
    let mut conn = tenant(&db, "tenant_a").await;
    assert_eq!(
        kind(&order_transition(&mut conn, 0, Pending, Paid).await),
        "Applied"
    );
    conn.batch_execute("SET search_path = tenant_b, public")
        .await
        .unwrap();
    Order::update(1)
        .expect_version(0)
        .set(&OrderStatus { status: Paid })
        .execute(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        kind(&order_transition(&mut conn, 0, Pending, Paid).await),
        "Stale(0, 1)"
    );
    assert_eq!(
        kind(&order_transition(&mut conn, 1, Paid, Shipped).await),
        "Applied"
    );
    conn.batch_execute("SET search_path = tenant_a, public")
        .await
        .unwrap();
    assert_eq!(
        kind(&order_transition(&mut conn, 0, Pending, Paid).await),
        "Duplicate"
    );
    assert_eq!(
        kind(&order_transition(&mut conn, 1, Paid, Shipped).await),
        "Applied"
    );
    assert_eq!(
        records(&mut setup).await,
        [
            record("tenant_a.orders", 2, "paid", "shipped"),
            record("tenant_b.orders", 2, "paid", "shipped"),
        ]
    );
}

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
