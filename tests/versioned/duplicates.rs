//! What makes a transition that matched no row a duplicate (issue 18, item
//! 5): the row really made this transition, from this version. A row in the
//! target state at the expected version + 1 is not enough when the target has
//! a second way in (two declared edges), or when the write that made that
//! version was not this transition at all (a plain update): those are
//! `Stale`, with the row's version, and nothing is written.

use idem::versioned::Transitioned;
use idem::States;

use super::*;

diesel::table! {
    payments (tenant_id, id) {
        tenant_id -> Int8,
        id -> Int8,
        status -> Text,
        note -> Text,
        version -> Int8,
    }
}

const PAYMENTS: &str = "
CREATE TABLE payments (
    tenant_id bigint NOT NULL,
    id bigint NOT NULL,
    status text NOT NULL,
    note text NOT NULL,
    version bigint NOT NULL DEFAULT 0 CHECK (version >= 0),
    PRIMARY KEY (tenant_id, id));
";

/// Two ways into `Refunded` (from `Paid` and from `Returned`) and two into
/// `Cancelled` (from `Pending` and from `Paid`); one into `Paid`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, States)]
#[states(
    Pending => [Paid, Cancelled],
    Paid => [Returned, Refunded, Cancelled],
    Returned => Refunded,
)]
enum PaymentStatus {
    Pending,
    Paid,
    Returned,
    Refunded,
    Cancelled,
}

#[derive(Debug, Clone, PartialEq, Queryable, Selectable, Versioned)]
#[diesel(table_name = payments)]
#[versioned(tenant = tenant_id, key = id, state = status)]
struct Payment {
    tenant_id: i64,
    id: i64,
    status: PaymentStatus,
    note: String,
    version: i64,
}

#[derive(VersionedChanges)]
#[versioned(model = Payment)]
#[diesel(table_name = payments)]
struct SetNote {
    note: String,
}

use PaymentStatus::{Cancelled, Paid, Pending, Refunded, Returned};

/// A fresh database with idem's migrations and the `payments` table.
async fn payments_db() -> (idem_testing::TestDatabase, AsyncPgConnection) {
    let db = idem_testing::TestDatabase::create().await.unwrap();
    let mut conn = AsyncPgConnection::establish(db.url()).await.unwrap();
    idem::migrate(&mut conn).await.unwrap();
    conn.batch_execute(PAYMENTS).await.unwrap();
    (db, conn)
}

async fn new_payment(conn: &mut AsyncPgConnection, (tenant_id, id): (i64, i64)) {
    Payment {
        tenant_id,
        id,
        status: Pending,
        note: String::new(),
        version: 0,
    }
    .insert(conn)
    .await
    .unwrap();
}

async fn transition(
    conn: &mut AsyncPgConnection,
    (tenant, id): (i64, i64),
    version: i64,
    from: PaymentStatus,
    to: PaymentStatus,
) -> Result<Transitioned<Payment>, VersionedError> {
    Payment::update(id)
        .tenant(tenant)
        .expect_version(version)
        .transition(from, to)
        .execute(conn)
        .await
}

/// Walk the row along `path` from `Pending` at version 0, one applied
/// transition per step.
async fn walk(conn: &mut AsyncPgConnection, row: (i64, i64), path: &[PaymentStatus]) {
    let mut at = Payment::find(row.1).tenant(row.0).load(conn).await.unwrap();
    for &to in path {
        match transition(conn, row, at.version, at.status, to).await {
            Ok(Transitioned::Applied(next)) => at = next,
            other => panic!("{:?} -> {to:?} at v{}: {other:?}", at.status, at.version),
        }
    }
}

/// The row as the table holds it: state text, version, and `xmin`, which
/// any write changes (even one that stores the same values).
async fn stored(conn: &mut AsyncPgConnection, (tenant, id): (i64, i64)) -> (String, i64, String) {
    #[derive(QueryableByName)]
    struct Raw {
        #[diesel(sql_type = Text)]
        status: String,
        #[diesel(sql_type = BigInt)]
        version: i64,
        #[diesel(sql_type = Text)]
        xmin: String,
    }
    let raw: Raw = diesel::sql_query(
        "SELECT status, version, xmin::text AS xmin FROM payments WHERE tenant_id = $1 AND id = $2",
    )
    .bind::<BigInt, _>(tenant)
    .bind::<BigInt, _>(id)
    .get_result(conn)
    .await
    .unwrap();
    (raw.status, raw.version, raw.xmin)
}

fn duplicate(outcome: Result<Transitioned<Payment>, VersionedError>) -> Payment {
    match outcome {
        Ok(Transitioned::Duplicate(row)) => row,
        other => panic!("expected Duplicate, got {other:?}"),
    }
}

fn stale(outcome: Result<Transitioned<Payment>, VersionedError>, expected: i64, actual: i64) {
    match outcome {
        Err(err) => assert_stale(&err, expected, actual),
        Ok(other) => panic!("expected Stale {{ {expected}, {actual} }}, got {other:?}"),
    }
}

#[tokio::test]
async fn a_second_way_into_the_state_is_not_a_duplicate() {
    let (_db, mut conn) = payments_db().await;
    let row = (1, 1);
    new_payment(&mut conn, row).await;
    walk(&mut conn, row, &[Paid, Refunded]).await;
    let before = stored(&mut conn, row).await;
    assert_eq!((before.0.as_str(), before.1), ("refunded", 2));

    // The issue: the row was never Returned, so `Returned -> Refunded` from
    // version 1 was not made; it is stale (the row is at version 2).
    stale(
        transition(&mut conn, row, 1, Returned, Refunded).await,
        1,
        2,
    );
    // The transition the row did make, repeated: a duplicate, with the row.
    let row_now = duplicate(transition(&mut conn, row, 1, Paid, Refunded).await);
    assert_eq!((row_now.status, row_now.version), (Refunded, 2));

    // Nothing was written by either answer.
    assert_eq!(stored(&mut conn, row).await, before);
}

#[tokio::test]
async fn the_other_way_round_too() {
    let (_db, mut conn) = payments_db().await;
    let row = (1, 1);
    new_payment(&mut conn, row).await;
    // Pending -> Paid (v1) -> Returned (v2) -> Refunded (v3).
    walk(&mut conn, row, &[Paid, Returned, Refunded]).await;
    let before = stored(&mut conn, row).await;

    stale(transition(&mut conn, row, 2, Paid, Refunded).await, 2, 3);
    duplicate(transition(&mut conn, row, 2, Returned, Refunded).await);
    // Into `Cancelled`, the other state with two ways in, from `Pending`.
    let other = (1, 2);
    new_payment(&mut conn, other).await;
    walk(&mut conn, other, &[Cancelled]).await;
    duplicate(transition(&mut conn, other, 0, Pending, Cancelled).await);
    stale(transition(&mut conn, other, 0, Paid, Cancelled).await, 0, 1);

    assert_eq!(stored(&mut conn, row).await, before);
    assert_eq!(stored(&mut conn, other).await.1, 1);
}

#[tokio::test]
async fn a_version_made_by_a_plain_update_is_no_duplicate_of_a_transition() {
    let (_db, mut conn) = payments_db().await;
    let row = (1, 1);
    new_payment(&mut conn, row).await;
    walk(&mut conn, row, &[Paid]).await;
    // Version 2 is a note, written while the row stayed Paid.
    Payment::update(1)
        .tenant(1)
        .expect_version(1)
        .set(&SetNote {
            note: "receipt sent".into(),
        })
        .execute(&mut conn)
        .await
        .unwrap();
    let before = stored(&mut conn, row).await;
    assert_eq!((before.0.as_str(), before.1), ("paid", 2));

    // Paid has one way in, and the row is Paid at 1 + 1; but the row was
    // Paid at version 1 already, so `Pending -> Paid` from 1 was not made.
    stale(transition(&mut conn, row, 1, Pending, Paid).await, 1, 2);
    assert_eq!(stored(&mut conn, row).await, before);
}

#[tokio::test]
async fn what_a_row_made_is_told_per_tenant() {
    let (_db, mut conn) = payments_db().await;
    // The same key in two tenants, both Refunded at version 3, each by
    // another way in.
    let (one, two) = ((1, 7), (2, 7));
    new_payment(&mut conn, one).await;
    new_payment(&mut conn, two).await;
    walk(&mut conn, one, &[Paid, Returned, Refunded]).await;
    walk(&mut conn, two, &[Paid]).await;
    Payment::update(7)
        .tenant(2)
        .expect_version(1)
        .set(&SetNote { note: "n".into() })
        .execute(&mut conn)
        .await
        .unwrap();
    walk(&mut conn, two, &[Refunded]).await;
    let before = (stored(&mut conn, one).await, stored(&mut conn, two).await);
    assert_eq!((before.0 .1, before.1 .1), (3, 3));

    duplicate(transition(&mut conn, one, 2, Returned, Refunded).await);
    stale(transition(&mut conn, one, 2, Paid, Refunded).await, 2, 3);
    duplicate(transition(&mut conn, two, 2, Paid, Refunded).await);
    stale(
        transition(&mut conn, two, 2, Returned, Refunded).await,
        2,
        3,
    );

    let after = (stored(&mut conn, one).await, stored(&mut conn, two).await);
    assert_eq!(after, before);
}

/// `idem_transitions` as stored: `(table, identity, version, from, to,
/// xmin)`, by identity (the table as its oid reads: `payments`).
async fn records(
    conn: &mut AsyncPgConnection,
) -> Vec<(String, String, i64, String, String, String)> {
    #[derive(QueryableByName)]
    struct Record {
        #[diesel(sql_type = Text)]
        table_name: String,
        #[diesel(sql_type = Text)]
        identity: String,
        #[diesel(sql_type = BigInt)]
        version: i64,
        #[diesel(sql_type = Text)]
        from_state: String,
        #[diesel(sql_type = Text)]
        to_state: String,
        #[diesel(sql_type = Text)]
        xmin: String,
    }
    diesel::sql_query(
        "SELECT table_oid::text AS table_name, identity::text AS identity, version, from_state, \
         to_state, xmin::text AS xmin FROM idem_transitions ORDER BY identity",
    )
    .load::<Record>(conn)
    .await
    .unwrap()
    .into_iter()
    .map(|r| {
        (
            r.table_name,
            r.identity,
            r.version,
            r.from_state,
            r.to_state,
            r.xmin,
        )
    })
    .collect()
}

#[tokio::test]
async fn a_transition_records_itself_with_its_write_and_only_then() {
    let (_db, mut conn) = payments_db().await;
    new_payment(&mut conn, (1, 1)).await;
    new_payment(&mut conn, (2, 1)).await;

    // Rolled back: neither the row nor a record.
    conn.batch_execute("BEGIN").await.unwrap();
    walk(&mut conn, (1, 1), &[Paid]).await;
    conn.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(stored(&mut conn, (1, 1)).await.1, 0);
    assert!(records(&mut conn).await.is_empty());

    // One record per row, replaced by the row's next transition.
    walk(&mut conn, (1, 1), &[Paid, Returned]).await;
    walk(&mut conn, (2, 1), &[Cancelled]).await;
    let kept = records(&mut conn).await;
    let edges: Vec<_> = kept
        .iter()
        .map(|(t, i, v, f, to, _)| (t.as_str(), i.as_str(), *v, f.as_str(), to.as_str()))
        .collect();
    assert_eq!(
        edges,
        [
            ("payments", "[1, 1]", 2, "paid", "returned"),
            ("payments", "[2, 1]", 1, "pending", "cancelled"),
        ]
    );

    // A duplicate, a stale transition, a state mismatch, a row not found
    // and a plain update record nothing.
    duplicate(transition(&mut conn, (1, 1), 1, Paid, Returned).await);
    stale(transition(&mut conn, (1, 1), 1, Paid, Refunded).await, 1, 2);
    assert!(matches!(
        transition(&mut conn, (1, 1), 2, Paid, Refunded).await,
        Err(VersionedError::StateMismatch { .. })
    ));
    assert!(matches!(
        transition(&mut conn, (3, 1), 0, Pending, Paid).await,
        Err(VersionedError::NotFound)
    ));
    Payment::update(1)
        .tenant(1)
        .expect_version(2)
        .set(&SetNote { note: "n".into() })
        .execute(&mut conn)
        .await
        .unwrap();
    assert_eq!(records(&mut conn).await, kept);
}

#[tokio::test]
async fn without_idem_migrations_a_transition_fails_and_writes_nothing() {
    let db = idem_testing::TestDatabase::create().await.unwrap();
    let mut conn = AsyncPgConnection::establish(db.url()).await.unwrap();
    conn.batch_execute(PAYMENTS).await.unwrap();
    new_payment(&mut conn, (1, 1)).await;

    let err = transition(&mut conn, (1, 1), 0, Pending, Paid)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, VersionedError::Database(_)) && err.to_string().contains("idem_transitions"),
        "{err:?}"
    );
    assert_eq!(stored(&mut conn, (1, 1)).await.0, "pending");
}

#[tokio::test]
async fn the_recorded_transition_is_prepared_once_per_connection() {
    let (_db, mut conn) = payments_db().await;
    for id in 1..=3 {
        new_payment(&mut conn, (1, id)).await;
        walk(&mut conn, (1, id), &[Paid]).await;
    }
    #[derive(QueryableByName)]
    struct Prepared {
        #[diesel(sql_type = BigInt)]
        runs: i64,
    }
    let prepared: Vec<i64> = diesel::sql_query(
        "SELECT generic_plans + custom_plans AS runs FROM pg_prepared_statements \
         WHERE statement LIKE 'WITH \"idem_transition\" AS (UPDATE \"payments\"%'",
    )
    .load::<Prepared>(&mut conn)
    .await
    .unwrap()
    .into_iter()
    .map(|p| p.runs)
    .collect();
    assert_eq!(prepared, [3]);
}
