//! How much the generated versioned update costs next to the same
//! compare-and-set written by hand.
//!
//! `cargo run --release --example bench_versioned [-- --iterations N --warmup N]`
//!
//! Three contenders, each on its own connection and its own row, run the same
//! `UPDATE .. SET body = $1, version = version + 1 WHERE tenant = $2 AND key = $3
//! AND version = $4 RETURNING ..`:
//!
//! - `versioned`: `Document::update(key).tenant(t).expect_version(v).set(&edit)`;
//! - `diesel`: the same statement hand-written with `diesel::update`, which diesel
//!   never keeps prepared (an UPDATE's SQL may vary with `Option` fields), so it
//!   pays a Parse round trip on every call;
//! - `raw`: tokio-postgres with the statement prepared once: the floor.
//!
//! They run interleaved, round-robin within each iteration with a rotating
//! first place, so drift on a shared machine hits all three alike. The line
//! after their table is machine-readable:
//! `versioned_us=.. diesel_us=.. raw_us=.. ratio_vs_diesel=.. ratio_vs_raw=..`
//! (medians in µs; ratios of the versioned median to the others').
//!
//! A second run, as interleaved, puts the versioned update in a transaction
//! (`BEGIN`, the update, `COMMIT`) three ways, to show what idem's
//! transaction driver costs:
//!
//! - `tx_diesel`: diesel-async's `transaction` on a connection of its own;
//! - `tx_pool`: the same on a connection of idem's pool, whose answers idem
//!   reads on the wire (what sees a failed statement and a `COMMIT` that
//!   rolled back, whatever diesel call ran it): the guard alone;
//! - `retryable`: idem's retry loop (`retry`), with its deadline settings in
//!   `BEGIN`, the guard, and the checkout.
//!
//! Its last line: `tx_diesel_us=.. tx_pool_us=.. retryable_us=..
//! guard_ratio=.. loop_ratio=..` (tx_pool and retryable against tx_diesel).

#[path = "common/bench.rs"]
mod bench;
#[path = "common/mod.rs"]
mod common;

use bench::{parse_args, percentile_us};

use std::time::{Duration, Instant};

use diesel::prelude::*;
use diesel::sql_types::Text;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idem::{Versioned, VersionedChanges};
use scoped_futures::ScopedFutureExt;
use serde_json::json;
use tokio_postgres::types::Json;
use tokio_postgres::NoTls;

diesel::table! {
    bench_versioned_documents (tenant_id, document_id) {
        tenant_id -> Int8,
        document_id -> Int8,
        body -> Jsonb,
        version -> Int8,
    }
}

const SCHEMA: &str = "
    DROP TABLE IF EXISTS bench_versioned_documents;
    CREATE TABLE bench_versioned_documents (
        tenant_id   bigint NOT NULL,
        document_id bigint NOT NULL,
        body        jsonb  NOT NULL,
        version     bigint NOT NULL DEFAULT 0 CHECK (version >= 0),
        PRIMARY KEY (tenant_id, document_id)
    );
";

/// The statement the other two contenders build, written out for tokio-postgres.
const RAW_UPDATE: &str = "UPDATE bench_versioned_documents \
    SET body = $1, version = version + 1 \
    WHERE tenant_id = $2 AND document_id = $3 AND version = $4 \
    RETURNING tenant_id, document_id, body, version";

#[derive(Debug, Queryable, Selectable, Versioned)]
#[diesel(table_name = bench_versioned_documents)]
#[versioned(tenant = tenant_id, key = document_id, version = version)]
struct Document {
    tenant_id: i64,
    document_id: i64,
    body: serde_json::Value,
    version: i64,
}

#[derive(VersionedChanges)]
#[versioned(model = Document)]
#[diesel(table_name = bench_versioned_documents)]
struct Edit {
    body: serde_json::Value,
}

#[derive(QueryableByName)]
struct PreparedStatement {
    #[diesel(sql_type = Text)]
    statement: String,
}

const TENANT: i64 = 1;
const NAMES: [&str; 3] = ["versioned", "diesel", "raw"];

/// Three connections, one per contender, so no contender reuses another's
/// prepared statements or waits behind its traffic.
struct Contenders {
    versioned: AsyncPgConnection,
    diesel: AsyncPgConnection,
    raw: tokio_postgres::Client,
    raw_update: tokio_postgres::Statement,
    /// The version each contender's row is at, i.e. its next expected version.
    versions: [i64; 3],
}

impl Contenders {
    /// Run contender `which` once on its own row (document_id = which + 1);
    /// panics unless the row was written at the next version.
    async fn update(&mut self, which: usize, body: serde_json::Value) -> Duration {
        let key = which as i64 + 1;
        let expected = self.versions[which];
        let start = Instant::now();
        let written = match which {
            0 => {
                let edit = Edit { body };
                Document::update(key)
                    .tenant(TENANT)
                    .expect_version(expected)
                    .set(&edit)
                    .execute(&mut self.versioned)
                    .await
                    .expect("versioned update")
                    .version
            }
            1 => {
                use bench_versioned_documents::{document_id, table, tenant_id, version};
                diesel::update(
                    table
                        .filter(tenant_id.eq(TENANT))
                        .filter(document_id.eq(key))
                        .filter(version.eq(expected)),
                )
                .set((
                    bench_versioned_documents::body.eq(&body),
                    version.eq(version + 1),
                ))
                .returning(Document::as_select())
                .get_result(&mut self.diesel)
                .await
                .expect("diesel update")
                .version
            }
            _ => {
                let row = self
                    .raw
                    .query_one(&self.raw_update, &[&Json(&body), &TENANT, &key, &expected])
                    .await
                    .expect("raw update");
                // Decode the whole row, as the other two do.
                let _: (i64, i64, Json<serde_json::Value>) = (row.get(0), row.get(1), row.get(2));
                row.get::<_, i64>(3)
            }
        };
        let elapsed = start.elapsed();
        assert_eq!(
            written,
            expected + 1,
            "{} did not write its row at the next version",
            NAMES[which]
        );
        self.versions[which] = written;
        elapsed
    }
}

async fn connect_raw(url: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(url, NoTls)
        .await
        .expect("connect tokio-postgres");
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            eprintln!("tokio-postgres connection: {e}");
        }
    });
    client
}

/// How many UPDATE statements the server holds prepared for this connection.
async fn prepared_updates(conn: &mut AsyncPgConnection) -> usize {
    diesel::sql_query("SELECT statement FROM pg_prepared_statements")
        .load::<PreparedStatement>(conn)
        .await
        .expect("read pg_prepared_statements")
        .iter()
        .filter(|p| p.statement.trim_start().starts_with("UPDATE"))
        .count()
}

const TX_NAMES: [&str; 3] = ["tx_diesel", "tx_pool", "retryable"];

/// One versioned update of `key` from `expected`, on `conn`.
async fn update_in(
    conn: &mut AsyncPgConnection,
    key: i64,
    expected: i64,
    i: usize,
) -> Result<i64, BenchError> {
    let edit = Edit {
        body: json!({ "iteration": i }),
    };
    Ok(Document::update(key)
        .tenant(TENANT)
        .expect_version(expected)
        .set(&edit)
        .execute(conn)
        .await?
        .version)
}

#[derive(Debug, thiserror::Error)]
enum BenchError {
    #[error(transparent)]
    Versioned(#[from] idem::VersionedError),
    #[error(transparent)]
    Db(#[from] diesel::result::Error),
    #[error(transparent)]
    Idem(#[from] idem::Error),
}

/// The transaction run: rows 4 to 6, one per contender.
async fn transactions(url: &str, iterations: usize, warmup: usize) {
    let mut own = AsyncPgConnection::establish(url).await.expect("connect");
    let one = idem::pool::PoolConfig {
        max_size: 1,
        ..Default::default()
    };
    let held = idem::pool::build_pool_with(url, &one).expect("pool");
    let mut pooled = held.get().await.expect("a pooled connection");
    let looped = idem::pool::build_pool_with(url, &one).expect("pool");
    let mut versions = [0_i64; 3];
    let mut samples: [Vec<Duration>; 3] = Default::default();
    for i in 0..warmup + iterations {
        for slot in 0..3 {
            let which = (i + slot) % 3;
            let (key, expected) = (which as i64 + 4, versions[which]);
            let start = Instant::now();
            let written = match which {
                0 => own
                    .transaction(async |c| update_in(c, key, expected, i).await)
                    .await
                    .expect("tx_diesel"),
                1 => pooled
                    .transaction(async |c| update_in(c, key, expected, i).await)
                    .await
                    .expect("tx_pool"),
                _ => idem::retry::retry(&looped, idem::RetryPolicy::new(), "bench", |c| {
                    update_in(c, key, expected, i).scope_boxed()
                })
                .await
                .expect("retryable"),
            };
            let elapsed = start.elapsed();
            assert_eq!(written, expected + 1, "{}", TX_NAMES[which]);
            versions[which] = written;
            if i >= warmup {
                samples[which].push(elapsed);
            }
        }
    }
    println!(
        "{:<10} {:>10} {:>10} {:>10}",
        "contender", "median_us", "p90_us", "p99_us"
    );
    let mut medians = [0.0; 3];
    for (which, s) in samples.iter_mut().enumerate() {
        s.sort();
        medians[which] = percentile_us(s, 0.5);
        println!(
            "{:<10} {:>10.1} {:>10.1} {:>10.1}",
            TX_NAMES[which],
            medians[which],
            percentile_us(s, 0.9),
            percentile_us(s, 0.99)
        );
    }
    let [diesel_tx, pool_tx, retryable] = medians;
    println!(
        "tx_diesel_us={diesel_tx:.1} tx_pool_us={pool_tx:.1} retryable_us={retryable:.1} \
         guard_ratio={:.2} loop_ratio={:.2}",
        pool_tx / diesel_tx,
        retryable / diesel_tx
    );
}

#[tokio::main]
async fn main() {
    let args = parse_args();
    assert_eq!(args.concurrency, 1, "this benchmark runs one caller");
    let url = common::database_url().await;

    let mut setup = AsyncPgConnection::establish(&url).await.expect("connect");
    setup.batch_execute(SCHEMA).await.expect("create schema");
    for key in 1..=6 {
        Document {
            tenant_id: TENANT,
            document_id: key,
            body: json!({}),
            version: 0,
        }
        .insert(&mut setup)
        .await
        .expect("insert row");
    }

    let raw = connect_raw(&url).await;
    let raw_update = raw.prepare(RAW_UPDATE).await.expect("prepare raw update");
    let mut c = Contenders {
        versioned: AsyncPgConnection::establish(&url).await.expect("connect"),
        diesel: AsyncPgConnection::establish(&url).await.expect("connect"),
        raw,
        raw_update,
        versions: [0; 3],
    };

    let mut samples: [Vec<Duration>; 3] = Default::default();
    for i in 0..args.warmup + args.iterations {
        for slot in 0..3 {
            let which = (i + slot) % 3;
            let body = json!({ "iteration": i, "by": NAMES[which] });
            let elapsed = c.update(which, body).await;
            if i >= args.warmup {
                samples[which].push(elapsed);
            }
        }
    }

    let prepared = [
        prepared_updates(&mut c.versioned).await,
        prepared_updates(&mut c.diesel).await,
        c.raw
            .query(
                "SELECT 1 FROM pg_prepared_statements WHERE statement LIKE 'UPDATE%'",
                &[],
            )
            .await
            .expect("read pg_prepared_statements")
            .len(),
    ];

    println!(
        "{} iterations per contender after {} warm-up, interleaved",
        args.iterations, args.warmup
    );
    println!(
        "{:<10} {:>10} {:>10} {:>10} {:>17}",
        "contender", "median_us", "p90_us", "p99_us", "prepared_updates"
    );
    let mut medians = [0.0; 3];
    for (which, s) in samples.iter_mut().enumerate() {
        s.sort();
        medians[which] = percentile_us(s, 0.5);
        println!(
            "{:<10} {:>10.1} {:>10.1} {:>10.1} {:>17}",
            NAMES[which],
            medians[which],
            percentile_us(s, 0.9),
            percentile_us(s, 0.99),
            prepared[which]
        );
    }
    if prepared[0] == 0 {
        eprintln!("warning: the versioned connection holds no prepared UPDATE: the generated update is re-prepared on every call");
    }
    let [versioned, diesel, raw] = medians;
    println!(
        "versioned_us={versioned:.1} diesel_us={diesel:.1} raw_us={raw:.1} ratio_vs_diesel={:.2} ratio_vs_raw={:.2}",
        versioned / diesel,
        versioned / raw
    );
    transactions(&url, args.iterations, args.warmup).await;
}
