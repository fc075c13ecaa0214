//! What `#[idempotent]` costs next to the same handler without it.
//!
//! `cargo run --release --example bench_idempotent [-- --iterations N --warmup N
//! --concurrency N --shuffle]`
//!
//! One handler (insert a payment row and its outbox row, in one transaction),
//! seven ways:
//!
//! - `bare`: under `#[retryable]` only: `BEGIN`, two inserts, `COMMIT`;
//! - `local`: `#[idempotent]` (local mode) on top, a new key every call:
//!   body and completed record (one insert) commit together;
//! - `external`: `#[idempotent(mode = external)]`, a new key every call: the
//!   claim commits first, then the body and the response;
//! - `replay`: the local handler called again with a key it already completed:
//!   the stored response comes back without running the body;
//! - `unguarded`: the bare handler in a diesel-async `transaction` on a
//!   connection of its own, outside idem's pool: no retry loop, and no wire
//!   guard (idem's pool reads every connection's answers to see each failure
//!   and each `COMMIT` that rolled back); `bare / unguarded` is what the loop
//!   and the guard cost;
//! - `handwritten`: what teams write by hand (brandur's Stripe-style keys, the
//!   Powertools pattern): the key row is inserted and committed first, then
//!   the handler and the `UPDATE` that completes the key row commit together
//!   (two commits), a new key every call;
//! - `business_key`: the key on the payment row itself (seed 003's first
//!   layer), under `#[retryable]` only: the payment is a `#[derive(Versioned)]`
//!   model with `create_once(key = order_key, fingerprint(amount, currency,
//!   merchant))` in a table of its own (`bench_idempotent_keyed_payments`:
//!   the payment's columns, `version`, and `UNIQUE (order_key)`), created with
//!   one `INSERT .. ON CONFLICT DO NOTHING RETURNING ..`, then the same
//!   outbox row; no record row. A new key every call.
//!
//! Each contender has its own pool of one connection per caller. They run
//! interleaved, round-robin within each iteration with a rotating first
//! place, so drift on a shared machine hits all seven alike; `--concurrency N`
//! runs N such callers at once. The cycle puts each contender always right
//! after the same one, which is not neutral: a call runs faster right after
//! one that did the same work on the server (at c = 1 here, `guard_ratio`
//! 0.94–1.02 in the cycle, where `bare` follows `business_key`, against
//! 1.07–1.09 shuffled). `--shuffle` runs each iteration in a random order
//! instead (seeded per caller: every run makes the same orders). The last line is machine-readable:
//! `bare_us=.. local_us=.. external_us=.. replay_us=.. handwritten_us=..
//! unguarded_us=.. local_ratio=.. replay_ratio=.. handwritten_ratio=..
//! guard_ratio=.. business_key_us=.. business_key_ratio=..` (medians in µs;
//! local, replay and business_key against bare, handwritten_ratio = local /
//! handwritten, guard_ratio = bare / unguarded).
//!
//! `IDEM_BENCH_VIA=pgbouncer` runs idem's pools through a PgBouncer in
//! transaction pooling, started for the run in front of the same server
//! (idem-testing's, so `pgbouncer` must be installed), with
//! `Pooler::TransactionPooling`: nothing of idem's is prepared there, and
//! `create_once` plans its guard at every call. `unguarded` and
//! `handwritten` stay direct: diesel-async's own connection caches prepared
//! statements, and the hand-written claim runs outside a transaction, where
//! tokio-postgres prepares a statement in one request and runs it in the
//! next, which a transaction pooler may send to another server connection.
//! `guard_ratio` and `handwritten_ratio` then also measure the pooler's hop.

#[path = "common/bench.rs"]
mod bench;
#[path = "common/mod.rs"]
mod common;

use bench::{parse_args, percentile_us};

use std::time::{Duration, Instant};

use diesel::prelude::*;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idem::pool::{build_pool_with, PoolConfig, Pooler};
use idem::{idempotent, retryable, CreateOnceError, Deferred, Pool, Versioned};
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
    bench_idempotent_keyed_payments (id) {
        id -> Int8,
        order_key -> Text,
        amount -> Int8,
        currency -> Text,
        merchant -> Text,
        version -> Int8,
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
    DROP TABLE IF EXISTS bench_idempotent_keyed_payments;
    CREATE TABLE bench_idempotent_keyed_payments (
        id        bigint PRIMARY KEY,
        order_key text   NOT NULL UNIQUE,
        amount    bigint NOT NULL,
        currency  text   NOT NULL,
        merchant  text   NOT NULL,
        version   bigint NOT NULL DEFAULT 0
    );
    DROP TABLE IF EXISTS bench_idempotent_keys;
    CREATE TABLE bench_idempotent_keys (
        key         text PRIMARY KEY,
        fingerprint text NOT NULL,
        state       text NOT NULL,
        response    jsonb
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
const NAMES: [&str; 7] = [
    "bare",
    "local",
    "external",
    "replay",
    "handwritten",
    "unguarded",
    "business_key",
];
const CONTENDERS: usize = NAMES.len();

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Db(#[from] diesel::result::Error),
    #[error(transparent)]
    Idem(#[from] idem::Error),
    #[error(transparent)]
    Once(#[from] CreateOnceError),
}

idem::final_errors!(AppError);

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

/// The business_key contender's payment: the idempotency key is its
/// `order_key`, unique in its table.
#[derive(Debug, Clone, Queryable, Selectable, Versioned)]
#[diesel(table_name = bench_idempotent_keyed_payments)]
#[versioned(tenant = none, key = id,
            create_once(key = order_key, fingerprint(amount, currency, merchant)))]
struct KeyedPayment {
    id: i64,
    order_key: String,
    amount: i64,
    currency: String,
    merchant: String,
    version: i64,
}

/// The handler every contender run: one payment row, one outbox row.
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
    write_event(conn, &payment).await?;
    Ok(payment)
}

/// The payment's outbox row.
async fn write_event(conn: &mut AsyncPgConnection, payment: &Payment) -> Result<(), AppError> {
    diesel::insert_into(bench_idempotent_outbox::table)
        .values((
            bench_idempotent_outbox::event_key
                .eq(format!("payment:{}:created", payment.payment_id)),
            bench_idempotent_outbox::aggregate_key.eq(&payment.order_key),
            bench_idempotent_outbox::event_type.eq("payment.created"),
            bench_idempotent_outbox::payload.eq(json!(payment)),
        ))
        .execute(conn)
        .await?;
    Ok(())
}

#[retryable(max = 4, deadline_ms = 800)]
async fn pay_bare(conn: &mut AsyncPgConnection, cmd: &PaymentCmd) -> Result<Payment, AppError> {
    write_payment(conn, cmd).await
}

/// The key on the payment row: created once per `order_key`; the outbox row
/// only with the payment that this call created. Answers whether the payment
/// was already there (a repeat).
#[retryable(max = 4, deadline_ms = 800)]
async fn pay_business_key(
    conn: &mut AsyncPgConnection,
    cmd: &PaymentCmd,
) -> Result<(Payment, bool), AppError> {
    let created = KeyedPayment {
        id: cmd.payment_id,
        order_key: cmd.idempotency_key.clone(),
        amount: cmd.amount,
        currency: cmd.currency.to_owned(),
        merchant: cmd.merchant.to_owned(),
        version: 0,
    }
    .create_once(conn)
    .await?;
    let repeat = !created.is_created();
    let row = created.into_row();
    let payment = Payment {
        payment_id: row.id,
        order_key: row.order_key,
        amount: row.amount,
        currency: row.currency,
        status: "created".to_owned(),
    };
    if !repeat {
        write_event(conn, &payment).await?;
    }
    Ok((payment, repeat))
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

/// The hand-written pattern: claim the key in its own commit, then run the
/// handler and complete the key row in a second transaction.
async fn pay_handwritten(pool: &Pool, cmd: &PaymentCmd) -> Result<Payment, AppError> {
    use diesel::sql_types::{Jsonb, Text};
    use std::ops::DerefMut;
    let mut conn = pool.get().await.map_err(idem::Error::from)?;
    let fingerprint = format!("{}:{}:{}", cmd.amount, cmd.currency, cmd.merchant);
    let claimed = diesel::sql_query(
        "INSERT INTO bench_idempotent_keys (key, fingerprint, state) VALUES ($1, $2, 'started') \
         ON CONFLICT DO NOTHING",
    )
    .bind::<Text, _>(&cmd.idempotency_key)
    .bind::<Text, _>(&fingerprint)
    .execute(&mut *conn)
    .await?;
    assert_eq!(claimed, 1, "the benchmark sends new keys only");
    conn.deref_mut()
        .transaction(async |conn| {
            let payment = write_payment(conn, cmd).await?;
            diesel::sql_query(
                "UPDATE bench_idempotent_keys SET state = 'done', response = $2 WHERE key = $1",
            )
            .bind::<Text, _>(&cmd.idempotency_key)
            .bind::<Jsonb, _>(json!(payment))
            .execute(conn)
            .await?;
            Ok(payment)
        })
        .await
}

/// One caller: a pool of one connection per contender, so none reuses
/// another's prepared statements or waits behind its traffic.
struct Contenders {
    /// By contender, but for `unguarded` (its own connection below).
    pools: [Pool; 6],
    /// The unguarded contender's connection, outside idem's pool.
    own: AsyncPgConnection,
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
        let pool = &self.pools[if which == 6 { 5 } else { which.min(4) }];
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
            (4, Some(cmd)) => (
                pay_handwritten(pool, cmd).await.expect("handwritten"),
                false,
            ),
            (5, Some(cmd)) => (
                self.own
                    .transaction(async |conn| write_payment(conn, cmd).await)
                    .await
                    .expect("unguarded"),
                false,
            ),
            (6, Some(cmd)) => pay_business_key(pool, cmd).await.expect("business_key"),
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
    let scope = idem::idempotency::scope_hash(&SCOPE).expect("a string scope");
    diesel::sql_query("DELETE FROM idem_requests WHERE scope = $1")
        .bind::<diesel::sql_types::Text, _>(scope)
        .execute(conn)
        .await
}

/// One caller's samples per contender: its own pools and key range, the
/// contenders interleaved with a rotating first place.
async fn caller(
    url: String,
    pooled: Option<String>,
    caller: i64,
    iterations: usize,
    warmup: usize,
    shuffle: bool,
) -> [Vec<Duration>; CONTENDERS] {
    let one = PoolConfig {
        max_size: 1,
        pooler: match pooled {
            Some(_) => Pooler::TransactionPooling,
            None => Pooler::Direct,
        },
        ..PoolConfig::default()
    };
    let direct = PoolConfig {
        pooler: Pooler::Direct,
        ..one.clone()
    };
    let pool_url = pooled.unwrap_or_else(|| url.clone());
    let pool = || build_pool_with(&pool_url, &one).expect("pool");
    let handwritten = build_pool_with(&url, &direct).expect("pool");
    let mut c = Contenders {
        pools: [pool(), pool(), pool(), pool(), handwritten, pool()],
        own: AsyncPgConnection::establish(&url).await.expect("connect"),
        replayed: PaymentCmd {
            idempotency_key: format!("replay-{caller}"),
            amount: 3000,
            currency: "CNY",
            merchant: "demo",
            payment_id: caller * 1_000_000_000,
        },
        next_id: caller * 1_000_000_000,
    };
    let first = pay_local(&c.pools[3], &c.replayed)
        .await
        .expect("the replayed key's first call");
    assert!(!first.replayed);
    let mut samples: [Vec<Duration>; CONTENDERS] = Default::default();
    let mut order: [usize; CONTENDERS] = std::array::from_fn(|slot| slot);
    // xorshift64, seeded per caller: the same orders in every run.
    let mut state = 0x9E37_79B9_7F4A_7C15_u64 ^ (caller as u64 + 1);
    for i in 0..warmup + iterations {
        if shuffle {
            for k in (1..CONTENDERS).rev() {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                order.swap(k, (state % (k as u64 + 1)) as usize);
            }
        } else {
            order = std::array::from_fn(|slot| (i + slot) % CONTENDERS);
        }
        for which in order {
            let elapsed = c.call(which).await;
            if i >= warmup {
                samples[which].push(elapsed);
            }
        }
    }
    samples
}

#[tokio::main]
async fn main() {
    let args = parse_args();
    let url = common::database_url().await;
    let bouncer = match std::env::var("IDEM_BENCH_VIA").as_deref() {
        Ok("pgbouncer") => {
            let server = url.clone();
            let start = move || idem_testing::pgbouncer::PgBouncer::start(&server);
            let started = tokio::task::spawn_blocking(start).await.expect("join");
            Some(started.expect("start PgBouncer (is pgbouncer installed?)"))
        }
        Ok("") | Ok("direct") | Err(_) => None,
        Ok(other) => panic!("IDEM_BENCH_VIA={other:?}: expected pgbouncer or direct"),
    };
    let pooled = bouncer
        .as_ref()
        .map(|b| b.url_for(&url).expect("PgBouncer's URL"));

    let mut setup = AsyncPgConnection::establish(&url).await.expect("connect");
    idem::migrate(&mut setup).await.expect("migrate");
    setup.batch_execute(SCHEMA).await.expect("create schema");
    reset_scope(&mut setup).await.expect("reset key space");

    let callers: Vec<_> = (0..args.concurrency as i64)
        .map(|n| {
            tokio::spawn(caller(
                url.clone(),
                pooled.clone(),
                n,
                args.iterations,
                args.warmup,
                args.shuffle,
            ))
        })
        .collect();
    let mut samples: [Vec<Duration>; CONTENDERS] = Default::default();
    for task in callers {
        for (all, mine) in samples
            .iter_mut()
            .zip(task.await.expect("a caller panicked"))
        {
            all.extend(mine);
        }
    }
    reset_scope(&mut setup).await.expect("clean up key space");

    println!(
        "{} iterations per contender after {} warm-up, interleaved ({}), concurrency={}{}",
        args.iterations,
        args.warmup,
        if args.shuffle { "shuffled" } else { "cycle" },
        args.concurrency,
        if bouncer.is_some() {
            ", idem's pools through PgBouncer"
        } else {
            ""
        }
    );
    println!(
        "{:<12} {:>10} {:>10} {:>10} {:>8}",
        "contender", "median_us", "p90_us", "p99_us", "vs_bare"
    );
    let mut medians = [0.0; CONTENDERS];
    for (which, s) in samples.iter_mut().enumerate() {
        s.sort();
        medians[which] = percentile_us(s, 0.5);
    }
    for (which, s) in samples.iter().enumerate() {
        println!(
            "{:<12} {:>10.1} {:>10.1} {:>10.1} {:>8.2}",
            NAMES[which],
            medians[which],
            percentile_us(s, 0.9),
            percentile_us(s, 0.99),
            medians[which] / medians[0]
        );
    }
    let [bare, local, external, replay, handwritten, unguarded, business_key] = medians;
    println!(
        "bare_us={bare:.1} local_us={local:.1} external_us={external:.1} replay_us={replay:.1} \
         handwritten_us={handwritten:.1} unguarded_us={unguarded:.1} local_ratio={:.2} \
         replay_ratio={:.2} handwritten_ratio={:.2} guard_ratio={:.2} \
         business_key_us={business_key:.1} business_key_ratio={:.2}",
        local / bare,
        replay / bare,
        local / handwritten,
        bare / unguarded,
        business_key / bare
    );
}
