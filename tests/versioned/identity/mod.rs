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

mod lives;
