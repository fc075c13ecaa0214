//! State machines: `#[derive(States)]` on the state enum, and
//! `.transition(from, to)` on a model whose state it is. An allowed transition
//! applies; an illegal one is refused before any SQL; a repeated one is a
//! duplicate, not a conflict; a race to the same target gives one `Applied`
//! and one `Duplicate`, to another target a conflict.

use std::time::Duration;

use idem::versioned::{StateMachine, Transitioned};
use idem::States;
use idem_testing::proxy::{Fault, Proxy};

use super::*;

diesel::table! {
    orders (tenant_id, id) {
        tenant_id -> Int8,
        id -> Int8,
        status -> Text,
        note -> Text,
        version -> Int8,
    }
}

const ORDERS: &str = "
CREATE TABLE orders (
    tenant_id bigint NOT NULL,
    id bigint NOT NULL,
    status text NOT NULL,
    note text NOT NULL,
    version bigint NOT NULL DEFAULT 0 CHECK (version >= 0),
    PRIMARY KEY (tenant_id, id));
";

#[derive(Debug, Clone, Copy, PartialEq, Eq, States)]
#[states(Pending => [Paid, Cancelled], Paid => Shipped)]
enum OrderStatus {
    Pending,
    Paid,
    Shipped,
    Cancelled,
}

#[derive(Debug, Clone, PartialEq, Queryable, Selectable, Versioned)]
#[diesel(table_name = orders)]
#[versioned(tenant = tenant_id, key = id, state = status)]
struct Order {
    tenant_id: i64,
    id: i64,
    status: OrderStatus,
    note: String,
    version: i64,
}

#[derive(VersionedChanges)]
#[versioned(model = Order)]
#[diesel(table_name = orders)]
struct SetNote {
    note: String,
}

use OrderStatus::{Cancelled, Paid, Pending, Shipped};

async fn orders_db() -> (idem_testing::TestDatabase, AsyncPgConnection) {
    let db = idem_testing::TestDatabase::create().await.unwrap();
    let mut conn = AsyncPgConnection::establish(db.url()).await.unwrap();
    // A transition records itself in `idem_transitions`.
    idem::migrate(&mut conn).await.unwrap();
    conn.batch_execute(ORDERS).await.unwrap();
    (db, conn)
}

async fn new_order(conn: &mut AsyncPgConnection, id: i64) -> Order {
    Order {
        tenant_id: 1,
        id,
        status: Pending,
        note: String::new(),
        version: 0,
    }
    .insert(conn)
    .await
    .unwrap()
}

/// The row as stored, with its `xmin` (changed by any write, even one that
/// sets the same values) and the raw text of its state.
async fn stored(conn: &mut AsyncPgConnection, id: i64) -> (Order, String, String) {
    #[derive(QueryableByName)]
    struct Raw {
        #[diesel(sql_type = Text)]
        xmin: String,
        #[diesel(sql_type = Text)]
        status: String,
    }
    let order = Order::find(id).tenant(1).load(conn).await.unwrap();
    let raw: Raw = diesel::sql_query(
        "SELECT xmin::text AS xmin, status FROM orders WHERE tenant_id = 1 AND id = $1",
    )
    .bind::<BigInt, _>(id)
    .get_result(conn)
    .await
    .unwrap();
    (order, raw.xmin, raw.status)
}

/// `Order::update(id).tenant(tenant).expect_version(version).transition(from, to)`.
async fn transition(
    conn: &mut AsyncPgConnection,
    (tenant, id): (i64, i64),
    version: i64,
    from: OrderStatus,
    to: OrderStatus,
) -> Result<Transitioned<Order>, VersionedError> {
    Order::update(id)
        .tenant(tenant)
        .expect_version(version)
        .transition(from, to)
        .execute(conn)
        .await
}

fn applied(outcome: Transitioned<Order>) -> Order {
    match outcome {
        Transitioned::Applied(row) => row,
        other => panic!("expected Applied, got {other:?}"),
    }
}

#[test]
fn the_table_is_declared_once_on_the_enum() {
    assert_eq!(OrderStatus::STATES, [Pending, Paid, Shipped, Cancelled]);
    assert_eq!(
        OrderStatus::TRANSITIONS,
        [(Pending, Paid), (Pending, Cancelled), (Paid, Shipped)]
    );
    assert!(OrderStatus::allowed(&Pending, &Paid));
    assert!(!OrderStatus::allowed(&Paid, &Pending));
    assert!(!OrderStatus::allowed(&Pending, &Shipped));
    assert!(!OrderStatus::allowed(&Shipped, &Shipped));
    assert_eq!(
        OrderStatus::targets(&Pending).collect::<Vec<_>>(),
        [&Paid, &Cancelled]
    );
    assert_eq!(OrderStatus::targets(&Cancelled).count(), 0);
    assert_eq!(Cancelled.as_text(), "cancelled");
    assert_eq!(OrderStatus::from_text("paid"), Some(Paid));
    assert_eq!(OrderStatus::from_text("Paid"), None);
}

#[tokio::test]
async fn an_allowed_transition_applies_and_bumps_the_version() {
    let (_db, mut conn) = orders_db().await;
    new_order(&mut conn, 1).await;

    let paid = applied(
        transition(&mut conn, (1, 1), 0, Pending, Paid)
            .await
            .unwrap(),
    );
    assert_eq!((paid.status, paid.version), (Paid, 1));

    // With other columns changed in the same statement.
    let shipped = Order::update(1)
        .tenant(1)
        .expect_version(1)
        .set(&SetNote {
            note: "DHL 42".into(),
        })
        .transition(Paid, Shipped)
        .execute(&mut conn)
        .await
        .unwrap();
    assert!(!shipped.is_duplicate());
    let shipped = shipped.into_row();
    assert_eq!(
        (shipped.status, shipped.note.as_str(), shipped.version),
        (Shipped, "DHL 42", 2)
    );

    // Stored as the state's text, and read back as the enum.
    let (row, _, text) = stored(&mut conn, 1).await;
    assert_eq!(row, shipped);
    assert_eq!(text, "shipped");
}

#[tokio::test]
async fn an_illegal_transition_is_refused_before_any_sql() {
    let (db, mut conn) = orders_db().await;
    new_order(&mut conn, 1).await;
    let (before, xmin_before, _) = stored(&mut conn, 1).await;

    // Every statement about orders sent through this proxy cuts the
    // connection: a refusal that sent any would fail with a database error.
    let proxy = Proxy::start(db.url()).await.unwrap();
    let mut watched = AsyncPgConnection::establish(proxy.url()).await.unwrap();
    proxy.arm("orders", Fault::CutBefore);

    for (from, to) in [(Pending, Shipped), (Paid, Pending), (Shipped, Shipped)] {
        let err = transition(&mut watched, (1, 1), 0, from, to)
            .await
            .unwrap_err();
        match &err {
            VersionedError::IllegalTransition { from: f, to: t } => {
                assert_eq!(
                    (f.as_str(), t.as_str()),
                    (&*format!("{from:?}"), &*format!("{to:?}"))
                );
            }
            other => panic!("expected IllegalTransition, got {other:?}"),
        }
        assert_eq!(err.http_status(), 409);
    }
    assert_eq!(proxy.fired(), 0, "a refused transition reached the server");

    // The detector works: an allowed transition on the same connection is cut.
    let err = transition(&mut watched, (1, 1), 0, Pending, Paid)
        .await
        .unwrap_err();
    assert!(matches!(err, VersionedError::Database(_)), "{err:?}");
    assert_eq!(proxy.fired(), 1);

    let (after, xmin_after, _) = stored(&mut conn, 1).await;
    assert_eq!(after, before);
    assert_eq!(xmin_after, xmin_before, "the row was written");
}

#[tokio::test]
async fn a_repeated_transition_is_a_duplicate_not_a_conflict() {
    let (_db, mut conn) = orders_db().await;
    new_order(&mut conn, 1).await;
    let first = applied(
        transition(&mut conn, (1, 1), 0, Pending, Paid)
            .await
            .unwrap(),
    );
    let (_, xmin, _) = stored(&mut conn, 1).await;

    // The same callback, twice more: answered as success, with the row.
    for _ in 0..2 {
        match transition(&mut conn, (1, 1), 0, Pending, Paid)
            .await
            .unwrap()
        {
            Transitioned::Duplicate(row) => assert_eq!(row, first),
            other => panic!("expected Duplicate, got {other:?}"),
        }
    }
    let (row, xmin_after, _) = stored(&mut conn, 1).await;
    assert_eq!(row, first);
    assert_eq!(xmin_after, xmin, "a duplicate wrote the row");

    // Once the row has moved on, the old transition is a conflict again.
    transition(&mut conn, (1, 1), 1, Paid, Shipped)
        .await
        .unwrap();
    let err = transition(&mut conn, (1, 1), 0, Pending, Paid)
        .await
        .unwrap_err();
    assert_stale(&err, 0, 2);
}

/// `conn` runs `from -> to` at version 0 on order 1 while another transaction
/// holds the row after making `Pending -> Paid` at version 0 itself; the
/// holder commits once `conn`'s UPDATE waits for its lock.
async fn race_behind_a_paid_transaction(
    db: &idem_testing::TestDatabase,
    from: OrderStatus,
    to: OrderStatus,
) -> Result<Transitioned<Order>, VersionedError> {
    let mut holder = AsyncPgConnection::establish(db.url()).await.unwrap();
    let mut observer = AsyncPgConnection::establish(db.url()).await.unwrap();
    holder.batch_execute("BEGIN").await.unwrap();
    let won = transition(&mut holder, (1, 1), 0, Pending, Paid)
        .await
        .unwrap();
    assert!(!won.is_duplicate());

    let url = db.url().to_owned();
    let racer = tokio::spawn(async move {
        let mut conn = AsyncPgConnection::establish(&url).await.unwrap();
        transition(&mut conn, (1, 1), 0, from, to).await
    });
    // Commit only once the racer's UPDATE is blocked on the row: the two
    // statements really overlap.
    let mut waited = Duration::ZERO;
    loop {
        #[derive(QueryableByName)]
        struct Waiting {
            #[diesel(sql_type = BigInt)]
            n: i64,
        }
        let w: Waiting = diesel::sql_query(
            "SELECT count(*) AS n FROM pg_stat_activity WHERE datname = current_database() \
             AND wait_event_type = 'Lock' AND query LIKE '%UPDATE \"orders\"%'",
        )
        .get_result(&mut observer)
        .await
        .unwrap();
        if w.n == 1 {
            break;
        }
        assert!(waited < Duration::from_secs(10), "the racer never blocked");
        tokio::time::sleep(Duration::from_millis(10)).await;
        waited += Duration::from_millis(10);
    }
    holder.batch_execute("COMMIT").await.unwrap();
    racer.await.unwrap()
}

#[tokio::test]
async fn concurrent_transitions_to_the_same_target_one_applies_one_is_a_duplicate() {
    let (db, mut conn) = orders_db().await;
    new_order(&mut conn, 1).await;

    match race_behind_a_paid_transaction(&db, Pending, Paid).await {
        Ok(Transitioned::Duplicate(row)) => assert_eq!((row.status, row.version), (Paid, 1)),
        other => panic!("expected Duplicate, got {other:?}"),
    }
    let (row, _, _) = stored(&mut conn, 1).await;
    assert_eq!((row.status, row.version), (Paid, 1));
}

#[tokio::test]
async fn concurrent_transitions_to_another_target_the_loser_conflicts() {
    let (db, mut conn) = orders_db().await;
    new_order(&mut conn, 1).await;

    let err = race_behind_a_paid_transaction(&db, Pending, Cancelled)
        .await
        .unwrap_err();
    assert_stale(&err, 0, 1);
    let (row, _, _) = stored(&mut conn, 1).await;
    assert_eq!((row.status, row.version), (Paid, 1));
}

#[tokio::test]
async fn many_racers_of_one_transition_all_succeed_once_applied() {
    const RACERS: usize = 8;
    let (db, mut conn) = orders_db().await;
    new_order(&mut conn, 1).await;
    let barrier = Arc::new(Barrier::new(RACERS));
    let mut tasks = Vec::new();
    for _ in 0..RACERS {
        let (url, barrier) = (db.url().to_owned(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            let mut conn = AsyncPgConnection::establish(&url).await.unwrap();
            barrier.wait().await;
            transition(&mut conn, (1, 1), 0, Pending, Paid)
                .await
                .unwrap()
        }));
    }
    let mut applied = 0;
    for task in tasks {
        let outcome = task.await.unwrap();
        assert_eq!((outcome.row().status, outcome.row().version), (Paid, 1));
        applied += usize::from(!outcome.is_duplicate());
    }
    assert_eq!(applied, 1);
    let (row, _, _) = stored(&mut conn, 1).await;
    assert_eq!(row.version, 1);
}

#[tokio::test]
async fn a_row_elsewhere_stays_a_conflict() {
    let (_db, mut conn) = orders_db().await;
    new_order(&mut conn, 1).await;
    new_order(&mut conn, 2).await;

    // Out of order: ship an order that is still pending (right version).
    let err = transition(&mut conn, (1, 1), 0, Paid, Shipped)
        .await
        .unwrap_err();
    match &err {
        VersionedError::StateMismatch { expected, actual } => {
            assert_eq!((expected.as_str(), actual.as_str()), ("Paid", "Pending"));
        }
        other => panic!("expected StateMismatch, got {other:?}"),
    }

    // Cancelled by someone else; paying it from the version read after that.
    transition(&mut conn, (1, 2), 0, Pending, Cancelled)
        .await
        .unwrap();
    let err = transition(&mut conn, (1, 2), 1, Pending, Paid)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, VersionedError::StateMismatch { actual, .. } if actual == "Cancelled"),
        "{err:?}"
    );

    // In the target state, but not at expected + 1: not a duplicate.
    transition(&mut conn, (1, 1), 0, Pending, Paid)
        .await
        .unwrap();
    Order::update(1)
        .tenant(1)
        .expect_version(1)
        .set(&SetNote { note: "x".into() })
        .execute(&mut conn)
        .await
        .unwrap();
    // Paid at version 2: a `Pending -> Paid` from version 0 is stale, from
    // version 2 a state mismatch, neither a duplicate.
    for (expected, stale) in [(0, true), (2, false)] {
        let err = transition(&mut conn, (1, 1), expected, Pending, Paid)
            .await
            .unwrap_err();
        if stale {
            assert_stale(&err, 0, 2);
        } else {
            assert!(
                matches!(err, VersionedError::StateMismatch { .. }),
                "{err:?}"
            );
        }
    }

    // No such order, or another tenant's: not found.
    for (tenant, id) in [(1, 99), (2, 1)] {
        let err = transition(&mut conn, (tenant, id), 0, Pending, Paid)
            .await
            .unwrap_err();
        assert_not_found(&err);
    }
}

#[tokio::test]
async fn an_unknown_text_in_the_column_is_an_error_naming_the_states() {
    let (_db, mut conn) = orders_db().await;
    conn.batch_execute("INSERT INTO orders VALUES (1, 1, 'refunded', '', 0)")
        .await
        .unwrap();
    let err = Order::find(1).tenant(1).load(&mut conn).await.unwrap_err();
    // diesel names the field; its source, the text and the states.
    let mut message = err.to_string();
    let mut source = std::error::Error::source(&err);
    while let Some(cause) = source {
        message += &format!(": {cause}");
        source = cause.source();
    }
    assert!(
        message.contains("`refunded` is not a state of")
            && message.contains("`pending`, `paid`, `shipped`, `cancelled`"),
        "{message}"
    );
}
