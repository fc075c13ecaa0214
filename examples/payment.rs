//! The payment contract of seed 000 (10.4.3): backends send the same
//! idempotency key at once, each proposing its own payment id; exactly one
//! payment row and one outbox row are written, and every backend gets the
//! same response. The same key with a different amount is refused and writes
//! nothing.
//!
//! `cargo run --example payment [-- --backends N]` (default 2; PostgreSQL:
//! `DATABASE_URL`, else 127.0.0.1:5432, else a throwaway cluster from the
//! installed server binaries).
//!
//! The idempotency record's unique `(scope, key)` is the arbiter: the claim
//! is the first statement of the transaction, so a duplicate blocks on the
//! winner's uncommitted claim and, once the winner commits, its next READ
//! COMMITTED statement reads the winner's record and replays it. The payment
//! ids differ on purpose: were they equal, the payment's own primary key could
//! decide the race and hide the protocol.

#[path = "common/mod.rs"]
mod common;

use std::collections::HashSet;
use std::sync::Arc;

use diesel::prelude::*;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idem::pool::{build_pool_with, PoolConfig};
use idem::{idempotent, retryable};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::sync::Barrier;

diesel::table! {
    payment_payments (id) {
        id -> Int8,
        order_key -> Text,
        amount -> Int8,
        currency -> Text,
        merchant -> Text,
    }
}

diesel::table! {
    payment_outbox (id) {
        id -> Int8,
        event_key -> Text,
        aggregate_key -> Text,
        event_type -> Text,
        payload -> Jsonb,
    }
}

const SCHEMA: &str = "
    DROP TABLE IF EXISTS payment_outbox;
    DROP TABLE IF EXISTS payment_payments;
    CREATE TABLE payment_payments (
        id        bigint PRIMARY KEY,
        order_key text   NOT NULL,
        amount    bigint NOT NULL,
        currency  text   NOT NULL,
        merchant  text   NOT NULL
    );
    CREATE TABLE payment_outbox (
        id            bigserial PRIMARY KEY,
        event_key     text  NOT NULL UNIQUE,
        aggregate_key text  NOT NULL,
        event_type    text  NOT NULL,
        payload       jsonb NOT NULL
    );
";

/// The key space of this example in `idem_requests`.
const TENANT: &str = "payment-example";
const KEY: &str = "idem-order-1001";
/// The server allows 100 connections; leave room for everything else.
const MAX_POOL: usize = 40;

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Db(#[from] diesel::result::Error),
    #[error(transparent)]
    Idem(#[from] idem::Error),
}

idem::final_errors!(AppError);

struct Ctx {
    tenant: &'static str,
}

struct PaymentCmd {
    idempotency_key: String,
    amount: i64,
    currency: String,
    merchant: String,
    /// The id this backend proposes; only the winner's is ever written.
    payment_id: i64,
}

/// The canonical response every backend gets for the key.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
struct Payment {
    payment_id: i64,
    order_key: String,
    amount: i64,
    currency: String,
    status: String,
}

/// One payment row and its outbox event, in one transaction; the claim on
/// `cmd.idempotency_key` comes first in that same transaction.
#[idempotent(
    key = cmd.idempotency_key,
    scope = ctx.tenant,
    fingerprint(cmd.amount, cmd.currency, cmd.merchant)
)]
#[retryable(max = 4, deadline_ms = 800)]
async fn create_payment(
    conn: &mut AsyncPgConnection,
    ctx: &Ctx,
    cmd: &PaymentCmd,
) -> Result<Payment, AppError> {
    diesel::insert_into(payment_payments::table)
        .values((
            payment_payments::id.eq(cmd.payment_id),
            payment_payments::order_key.eq(&cmd.idempotency_key),
            payment_payments::amount.eq(cmd.amount),
            payment_payments::currency.eq(&cmd.currency),
            payment_payments::merchant.eq(&cmd.merchant),
        ))
        .execute(conn)
        .await?;
    let payment = Payment {
        payment_id: cmd.payment_id,
        order_key: cmd.idempotency_key.clone(),
        amount: cmd.amount,
        currency: cmd.currency.clone(),
        status: "created".to_owned(),
    };
    diesel::insert_into(payment_outbox::table)
        .values((
            payment_outbox::event_key.eq(format!("payment:{}:created", cmd.payment_id)),
            payment_outbox::aggregate_key.eq(&cmd.idempotency_key),
            payment_outbox::event_type.eq("payment.created"),
            payment_outbox::payload.eq(json!(payment)),
        ))
        .execute(conn)
        .await?;
    Ok(payment)
}

fn backends() -> usize {
    let mut args = std::env::args().skip(1);
    let mut backends = 2;
    while let Some(arg) = args.next() {
        let value = match arg.split_once('=') {
            Some(("--backends", value)) => Some(value.to_owned()),
            None if arg == "--backends" => args.next(),
            _ => panic!("unknown argument {arg:?}; usage: [--backends N]"),
        };
        backends = value
            .and_then(|v| v.parse().ok())
            .filter(|n: &usize| *n > 0)
            .expect("--backends needs a positive number");
    }
    backends
}

fn cmd(amount: i64, payment_id: i64) -> PaymentCmd {
    PaymentCmd {
        idempotency_key: KEY.to_owned(),
        amount,
        currency: "CNY".to_owned(),
        merchant: "demo".to_owned(),
        payment_id,
    }
}

async fn counts(conn: &mut AsyncPgConnection) -> QueryResult<(i64, i64)> {
    let payments = payment_payments::table.count().get_result(conn).await?;
    let outbox = payment_outbox::table.count().get_result(conn).await?;
    Ok((payments, outbox))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let backends = backends();
    let url = common::database_url().await;
    let mut conn = AsyncPgConnection::establish(&url).await?;
    idem::migrate(&mut conn).await?;
    conn.batch_execute(SCHEMA).await?;
    // This example's key space starts empty too.
    diesel::sql_query("DELETE FROM idem_requests WHERE scope = $1")
        .bind::<diesel::sql_types::Text, _>(idem::idempotency::scope_hash(&TENANT)?)
        .execute(&mut conn)
        .await?;

    // One connection per backend (up to the cap; beyond it backends queue for
    // a connection), all opened before the barrier so the requests really race.
    let pool = build_pool_with(
        &url,
        &PoolConfig {
            max_size: backends.min(MAX_POOL),
            wait_timeout: std::time::Duration::from_secs(30),
            ..Default::default()
        },
    )?;
    let mut warm = Vec::new();
    for _ in 0..backends.min(MAX_POOL) {
        warm.push(pool.get().await?);
    }
    drop(warm);

    let ctx = Arc::new(Ctx { tenant: TENANT });
    let barrier = Arc::new(Barrier::new(backends));
    let tasks: Vec<_> = (0..backends)
        .map(|i| {
            let (pool, ctx, barrier) = (pool.clone(), Arc::clone(&ctx), Arc::clone(&barrier));
            tokio::spawn(async move {
                let cmd = cmd(3000, 5001 + i as i64);
                barrier.wait().await;
                create_payment(&pool, &ctx, &cmd).await
            })
        })
        .collect();
    let (mut inserted, mut reused) = (0, 0);
    let mut responses = HashSet::new();
    for task in tasks {
        let answer = task.await??;
        if answer.replayed {
            reused += 1;
        } else {
            inserted += 1;
        }
        responses.insert(answer.into_inner());
    }
    let (payments, outbox) = counts(&mut conn).await?;
    println!("requests={backends}");
    println!("inserted={inserted}");
    println!("reused={reused}");
    println!("distinct responses={}", responses.len());
    println!("payment rows={payments}");
    println!("outbox rows={outbox}");

    // The same key for a different request: refused, never answered with the
    // stored payment, and nothing written.
    let mismatch = match create_payment(&pool, &ctx, &cmd(9999, 9999)).await {
        Err(e @ AppError::Idem(idem::Error::FingerprintMismatch)) => e,
        other => panic!("a different amount under the same key must be refused, got {other:?}"),
    };
    let (payments, outbox) = counts(&mut conn).await?;
    println!("mismatch={mismatch}");
    println!("payment rows after mismatch={payments}");
    println!("outbox rows after mismatch={outbox}");
    Ok(())
}
