//! The figures of the last line, read from PostgreSQL (Redis's are passed
//! in), never from what the service answered.

use std::time::{Duration, Instant};

use diesel::sql_types::BigInt;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idem::Pool;

#[derive(diesel::QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

async fn count(conn: &mut AsyncPgConnection, sql: &str) -> i64 {
    diesel::sql_query(sql)
        .get_result::<Count>(conn)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .n
}

/// Waits until no compensation job is due or running.
pub async fn jobs_settled(pool: &Pool, within: Duration) -> bool {
    let started = Instant::now();
    let mut conn = pool.get().await.expect("a connection");
    while started.elapsed() < within {
        let stats = idem::jobs::stats(&mut conn).await.expect("job stats");
        if stats.due == 0 && stats.running == 0 {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("compensation jobs still due or running after {within:?}");
    false
}

pub struct Figures {
    callbacks: i64,
    duplicates: i64,
    paid: i64,
    double_paid: i64,
    race_winners: i64,
    same_request_rows: i64,
    compensated: i64,
    dead: i64,
    cache_hits: u64,
    identical: bool,
    // Beyond the line, checked too.
    orders: i64,
    order_rows: i64,
    self_test_orders: i64,
    mismatched_rows: i64,
    edits_missing: i64,
    inbox_skips: i64,
}

impl Figures {
    pub async fn read(
        conn: &mut AsyncPgConnection,
        orders: i64,
        edited: i64,
        selftest_order: i64,
        mismatched_amount: i64,
        cache_hits: u64,
        identical: bool,
    ) -> Figures {
        let callbacks = count(conn, "SELECT count(*) AS n FROM ord_arrivals").await;
        let distinct = count(conn, "SELECT count(DISTINCT txn) AS n FROM ord_arrivals").await;
        let paid = count(
            conn,
            "SELECT count(*) AS n FROM ord_orders WHERE status IN ('paid', 'shipped')",
        )
        .await;
        let double_paid = count(
            conn,
            "SELECT count(*) AS n FROM (SELECT order_id FROM ord_payments
             GROUP BY order_id HAVING count(*) > 1) AS twice",
        )
        .await;
        let race_winners = count(
            conn,
            &format!(
                "SELECT count(*) AS n FROM ord_edits WHERE order_id = {selftest_order} AND via = 'operator'"
            ),
        )
        .await;
        let same_request_rows = count(
            conn,
            &format!(
                "SELECT count(*) AS n FROM ord_orders WHERE request_id = 'create-{selftest_order}'"
            ),
        )
        .await;
        let self_test_orders = count(
            conn,
            &format!("SELECT count(*) AS n FROM ord_orders WHERE id = {selftest_order}"),
        )
        .await;
        let order_rows = count(conn, "SELECT count(*) AS n FROM ord_orders").await;
        // The request id reused with another amount wrote nothing.
        let mismatched_rows = count(
            conn,
            &format!("SELECT count(*) AS n FROM ord_orders WHERE amount = {mismatched_amount}"),
        )
        .await;
        let compensated = count(
            conn,
            "SELECT count(*) AS n FROM ord_edits WHERE via = 'compensation'",
        )
        .await;
        let dead = count(
            conn,
            "SELECT count(*) AS n FROM idem_jobs WHERE state = 'dead'",
        )
        .await
            + count(
                conn,
                "SELECT count(*) AS n FROM idem_inbox WHERE state = 'dead'",
            )
            .await;
        // Every edited order ends with its operator's note, made at once or
        // by the queue.
        let edits_missing = count(
            conn,
            &format!(
                "SELECT count(*) AS n FROM ord_orders
                 WHERE id <= {edited} AND note <> 'operator-' || id"
            ),
        )
        .await;
        let nats_arrivals = count(
            conn,
            "SELECT count(*) AS n FROM ord_arrivals WHERE via = 'nats'",
        )
        .await;
        let inbox_rows = count(conn, "SELECT count(*) AS n FROM idem_inbox").await;
        Figures {
            callbacks,
            duplicates: callbacks - distinct,
            paid,
            double_paid,
            race_winners,
            same_request_rows,
            compensated,
            dead,
            cache_hits,
            identical,
            orders,
            order_rows,
            self_test_orders,
            mismatched_rows,
            edits_missing,
            inbox_skips: nats_arrivals - inbox_rows,
        }
    }

    /// Prints the details and the last line; true when every figure is right.
    pub fn report(&self) -> bool {
        println!(
            "orders={} order_rows={} edited_missing={} inbox_skipped_redeliveries={} self_test_orders={} mismatched_rows={}",
            self.orders,
            self.order_rows,
            self.edits_missing,
            self.inbox_skips,
            self.self_test_orders,
            self.mismatched_rows
        );
        println!(
            "callbacks={} duplicates={} paid={} double_paid={} race_winners={} same_request_rows={} compensated={} dead={} cache_hits={} cache_down_identical={}",
            self.callbacks,
            self.duplicates,
            self.paid,
            self.double_paid,
            self.race_winners,
            self.same_request_rows,
            self.compensated,
            self.dead,
            self.cache_hits,
            if self.identical { "yes" } else { "no" },
        );
        self.paid == self.orders
            && self.double_paid == 0
            && self.race_winners == 1
            && self.same_request_rows == 1
            && self.self_test_orders == 1
            && self.order_rows == self.orders + 1
            && self.mismatched_rows == 0
            && self.compensated >= 1
            && self.edits_missing == 0
            && self.inbox_skips >= 1
            && self.dead == 0
            && self.cache_hits > 0
            && self.identical
    }
}
