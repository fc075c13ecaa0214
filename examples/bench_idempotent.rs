//! What `#[idempotent]` costs next to the same handler without it.
//!
//! `cargo run --release --example bench_idempotent [-- --iterations N --warmup N]`
//!
//! One handler (insert a payment row and its outbox row, in one transaction),
//! four ways:
//!
//! - `bare`: under `#[retryable]` only: `BEGIN`, two inserts, `COMMIT`;
//! - `local`: `#[idempotent]` (local mode) on top, a new key every call: the
//!   claim, the body and the stored response commit together;
//! - `external`: `#[idempotent(mode = external)]`, a new key every call: the
//!   claim commits first, then the body and the response;
//! - `replay`: the local handler called again with a key it already completed:
//!   the stored response comes back without running the body.
//!
//! Each contender has its own pool of one connection. They run interleaved,
//! round-robin within each iteration with a rotating first place, so drift on
//! a shared machine hits all four alike. The last line is machine-readable:
//! `bare_us=.. local_us=.. external_us=.. replay_us=.. local_ratio=.. replay_ratio=..`
//! (medians in µs; ratios of the local and replay medians to the bare one).

#[path = "common/bench.rs"]
mod bench;
#[path = "common/mod.rs"]
mod common;

use bench::{parse_args, percentile_us};

use std::time::{Duration, Instant};

use diesel::prelude::*;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idem::pool::{build_pool_with, PoolConfig};
use idem::{idempotent, retryable, Deferred, IdempotentError, NoFinalErrors, Pool};
use serde::{Deserialize, Serialize};
use serde_json::json;

diesel::table! {
    bench_idempotent_payments (id) {
        id -> Int8,
        order_key -> Text,
        amount -> Int8,
        currency -> Text,
        merchant -> Text,
    }
}

diesel::table! {
    bench_idempotent_outbox (id) {
        id -> Int8,
        event_key -> Text,
        aggregate_key -> Text,
        event_type -> Text,
        payload -> Jsonb,
    }
}

const SCHEMA: &str = "
    DROP TABLE IF EXISTS bench_idempotent_outbox;
    DROP TABLE IF EXISTS bench_idempotent_payments;
    CREATE TABLE bench_idempotent_payments (
        id        bigint PRIMARY KEY,
        order_key text   NOT NULL,
        amount    bigint NOT NULL,
        currency  text   NOT NULL,
        merchant  text   NOT NULL
    );
    CREATE TABLE bench_idempotent_outbox (
        id            bigserial PRIMARY KEY,
        event_key     text  NOT NULL UNIQUE,
        aggregate_key text  NOT NULL,
        event_type    text  NOT NULL,
        payload       jsonb NOT NULL
    );
";

/// This benchmark's key space in `idem_requests`, emptied at start and end.
const SCOPE: &str = "bench_idempotent";
const NAMES: [&str; 4] = ["bare", "local", "external", "replay"];

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Db(#[from] diesel::result::Error),
    #[error(transparent)]
    Idem(#[from] idem::Error),
}

impl IdempotentError for AppError {
    type Final = NoFinalErrors;
    fn to_final(&self) -> Option<NoFinalErrors> {
        None
    }
    fn from_final(never: NoFinalErrors) -> Self {
        match never {}
    }
}

struct PaymentCmd {
    idempotency_key: String,
    amount: i64,
    currency: &'static str,
    merchant: &'static str,
    payment_id: i64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Payment {
    payment_id: i64,
    order_key: String,
    amount: i64,
    currency: String,
    status: String,
}

/// The handler all four contenders run: one payment row, one outbox row.
async fn write_payment(
    conn: &mut AsyncPgConnection,
    cmd: &PaymentCmd,
) -> Result<Payment, AppError> {
    diesel::insert_into(bench_idempotent_payments::table)
        .values((
            bench_idempotent_payments::id.eq(cmd.payment_id),
            bench_idempotent_payments::order_key.eq(&cmd.idempotency_key),
            bench_idempotent_payments::amount.eq(cmd.amount),
            bench_idempotent_payments::currency.eq(cmd.currency),
            bench_idempotent_payments::merchant.eq(cmd.merchant),
        ))
        .execute(conn)
        .await?;
    let payment = Payment {
        payment_id: cmd.payment_id,
        order_key: cmd.idempotency_key.clone(),
        amount: cmd.amount,
        currency: cmd.currency.to_owned(),
        status: "created".to_owned(),
    };
    diesel::insert_into(bench_idempotent_outbox::table)
        .values((
            bench_idempotent_outbox::event_key.eq(format!("payment:{}:created", cmd.payment_id)),
            bench_idempotent_outbox::aggregate_key.eq(&cmd.idempotency_key),
            bench_idempotent_outbox::event_type.eq("payment.created"),
            bench_idempotent_outbox::payload.eq(json!(payment)),
        ))
        .execute(conn)
        .await?;
    Ok(payment)
}

#[retryable(max = 4, deadline_ms = 800)]
async fn pay_bare(conn: &mut AsyncPgConnection, cmd: &PaymentCmd) -> Result<Payment, AppError> {
    write_payment(conn, cmd).await
}

#[idempotent(
    key = cmd.idempotency_key,
    scope = SCOPE,
    fingerprint(cmd.amount, cmd.currency, cmd.merchant)
)]
#[retryable(max = 4, deadline_ms = 800)]
async fn pay_local(conn: &mut AsyncPgConnection, cmd: &PaymentCmd) -> Result<Payment, AppError> {
    write_payment(conn, cmd).await
}

#[idempotent(
    key = cmd.idempotency_key,
    scope = SCOPE,
    fingerprint(cmd.amount, cmd.currency, cmd.merchant),
    mode = external
)]
#[retryable(max = 4, deadline_ms = 800)]
async fn pay_external(db: &mut Deferred<'_>, cmd: &PaymentCmd) -> Result<Payment, AppError> {
    // (The outside call would be here, with nothing open.)
    write_payment(db.conn().await?, cmd).await
}

/// One pool of one connection per contender, so none reuses another's
/// prepared statements or waits behind its traffic.
struct Contenders {
    pools: [Pool; 4],
    /// The key the replay contender repeats, completed during setup.
    replayed: PaymentCmd,
    next_id: i64,
}

impl Contenders {
    fn new_cmd(&mut self, which: usize) -> PaymentCmd {
        self.next_id += 1;
        PaymentCmd {
            idempotency_key: format!("{}-{}", NAMES[which], self.next_id),
            amount: 3000,
            currency: "CNY",
            merchant: "demo",
            payment_id: self.next_id,
        }
    }

    /// Run contender `which` once; panics unless it did what it is measured for.
    async fn call(&mut self, which: usize) -> Duration {
        let cmd = match which {
            3 => None,
            _ => Some(self.new_cmd(which)),
        };
        let pool = &self.pools[which];
        let start = Instant::now();
        let (payment, replayed) = match (which, &cmd) {
            (0, Some(cmd)) => (pay_bare(pool, cmd).await.expect("bare"), false),
            (1, Some(cmd)) => {
                let answer = pay_local(pool, cmd).await.expect("local");
                (answer.value, answer.replayed)
            }
            (2, Some(cmd)) => {
                let answer = pay_external(pool, cmd).await.expect("external");
                (answer.value, answer.replayed)
            }
            _ => {
                let answer = pay_local(pool, &self.replayed).await.expect("replay");
                (answer.value, answer.replayed)
            }
        };
        let elapsed = start.elapsed();
        let expected = cmd.as_ref().unwrap_or(&self.replayed);
        assert_eq!(payment.payment_id, expected.payment_id, "{}", NAMES[which]);
        assert_eq!(replayed, which == 3, "{} replayed={replayed}", NAMES[which]);
        elapsed
    }
}

async fn reset_scope(conn: &mut AsyncPgConnection) -> QueryResult<usize> {
    diesel::sql_query("DELETE FROM idem_requests WHERE scope = $1")
        .bind::<diesel::sql_types::Text, _>(serde_json::to_string(SCOPE).expect("a string"))
        .execute(conn)
        .await
}

#[tokio::main]
async fn main() {
    let args = parse_args();
    let url = common::database_url().await;

    let mut setup = AsyncPgConnection::establish(&url).await.expect("connect");
    idem::migrate(&mut setup).await.expect("migrate");
    setup.batch_execute(SCHEMA).await.expect("create schema");
    reset_scope(&mut setup).await.expect("reset key space");

    let one = PoolConfig {
        max_size: 1,
        ..PoolConfig::default()
    };
    let pool = || build_pool_with(&url, &one).expect("pool");
    let mut c = Contenders {
        pools: [pool(), pool(), pool(), pool()],
        replayed: PaymentCmd {
            idempotency_key: "replay-0".to_owned(),
            amount: 3000,
            currency: "CNY",
            merchant: "demo",
            payment_id: 0,
        },
        next_id: 0,
    };
    let first = pay_local(&c.pools[3], &c.replayed)
        .await
        .expect("the replayed key's first call");
    assert!(!first.replayed);

    let mut samples: [Vec<Duration>; 4] = Default::default();
    for i in 0..args.warmup + args.iterations {
        for slot in 0..4 {
            let which = (i + slot) % 4;
            let elapsed = c.call(which).await;
            if i >= args.warmup {
                samples[which].push(elapsed);
            }
        }
    }
    reset_scope(&mut setup).await.expect("clean up key space");

    println!(
        "{} iterations per contender after {} warm-up, interleaved",
        args.iterations, args.warmup
    );
    println!(
        "{:<10} {:>10} {:>10} {:>10} {:>8}",
        "contender", "median_us", "p90_us", "p99_us", "vs_bare"
    );
    let mut medians = [0.0; 4];
    for (which, s) in samples.iter_mut().enumerate() {
        s.sort();
        medians[which] = percentile_us(s, 0.5);
    }
    for (which, s) in samples.iter().enumerate() {
        println!(
            "{:<10} {:>10.1} {:>10.1} {:>10.1} {:>8.2}",
            NAMES[which],
            medians[which],
            percentile_us(s, 0.9),
            percentile_us(s, 0.99),
            medians[which] / medians[0]
        );
    }
    let [bare, local, external, replay] = medians;
    println!(
        "bare_us={bare:.1} local_us={local:.1} external_us={external:.1} replay_us={replay:.1} local_ratio={:.2} replay_ratio={:.2}",
        local / bare,
        replay / bare
    );
}
