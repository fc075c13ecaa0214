//! The consumer process (`--consumer`): `idem::inbox::Inbox::run` on the
//! durable pull consumer, applying each order event to the consumer's own
//! tables in the transaction that records the message.

use std::time::Duration;

use diesel::sql_types::BigInt;
use diesel::OptionalExtension;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use futures_util::StreamExt;
use idem::inbox::{message_id, Inbox, InboxConfig, Outcome};
use idem::pool::{build_pool_with, PoolConfig};
use scoped_futures::{ScopedBoxFuture, ScopedFutureExt};

use crate::orders::{AppError, OrderChanged};
use crate::relay::Stall;
use crate::ChildArgs;

/// The durable consumer's name, which is also the inbox's key space.
pub const NAME: &str = "chaos-orders";

#[derive(diesel::QueryableByName)]
struct Progress {
    #[diesel(sql_type = BigInt)]
    last_step: i64,
}

/// The effect: log the event as applied, noting whether the order's
/// previous step was applied before it, and move the order's progress on.
/// Runs inside the inbox's transaction, so it commits with the message's
/// record or not at all.
fn apply<'c>(
    conn: &'c mut AsyncPgConnection,
    payload: &'c [u8],
) -> ScopedBoxFuture<'static, 'c, Result<(), AppError>> {
    async move {
        let event: OrderChanged = serde_json::from_slice(payload).expect("an OrderChanged body");
        let before: Option<Progress> = diesel::sql_query(
            "SELECT last_step FROM chaos_progress WHERE order_id = $1 FOR UPDATE",
        )
        .bind::<BigInt, _>(event.order)
        .get_result(conn)
        .await
        .optional()?;
        let last = before.map_or(0, |p| p.last_step);
        diesel::sql_query(
            "INSERT INTO chaos_applied (order_id, step, in_order) VALUES ($1, $2, $3)",
        )
        .bind::<BigInt, _>(event.order)
        .bind::<BigInt, _>(event.step)
        .bind::<diesel::sql_types::Bool, _>(last == event.step - 1)
        .execute(conn)
        .await?;
        diesel::sql_query(
            "INSERT INTO chaos_progress (order_id, last_step) VALUES ($1, $2)
             ON CONFLICT (order_id) DO UPDATE
             SET last_step = greatest(chaos_progress.last_step, excluded.last_step)",
        )
        .bind::<BigInt, _>(event.order)
        .bind::<BigInt, _>(event.step)
        .execute(conn)
        .await?;
        Ok(())
    }
    .scope_boxed()
}

pub async fn main(args: ChildArgs) {
    let pool = build_pool_with(
        &args.database,
        &PoolConfig {
            max_size: 2,
            wait_timeout: Duration::from_secs(10),
            ..PoolConfig::default()
        },
    )
    .expect("consumer pool");
    let js = async_nats::jetstream::new(
        async_nats::connect(&args.nats)
            .await
            .expect("connect to NATS"),
    );
    let consumer: async_nats::jetstream::consumer::PullConsumer = js
        .get_stream(&args.stream)
        .await
        .expect("the stream")
        .get_consumer(NAME)
        .await
        .expect("the durable consumer");
    let inbox = Inbox::new(pool, NAME, InboxConfig::new()).expect("inbox");
    let Some((Stall::Ack, after)) = args.stall else {
        let report = inbox
            .run(&consumer, crate::stdin_closed(), apply)
            .await
            .expect("the consumer loop");
        println!(
            "REPORT done={} duplicates={} retried={} errors={}",
            report.done, report.duplicates, report.retried, report.errors
        );
        return;
    };
    // Run normally for `after`, then take messages by hand and stop dead
    // once one has committed, before its ack: the crash the inbox exists
    // for, at a moment a random kill almost never hits.
    let closed = crate::stdin_closed();
    tokio::pin!(closed);
    let mut closing = false;
    let until = async {
        tokio::select! {
            () = &mut closed => closing = true,
            () = tokio::time::sleep(after) => {}
        }
    };
    inbox
        .run(&consumer, until, apply)
        .await
        .expect("the consumer loop");
    if closing {
        return;
    }
    loop {
        let mut batch = consumer
            .fetch()
            .max_messages(1)
            .expires(Duration::from_secs(1))
            .messages()
            .await
            .expect("fetch");
        let Some(Ok(message)) = batch.next().await else {
            continue;
        };
        let info = message.info().expect("a JetStream message");
        let id = message_id(message.headers.as_ref(), info.stream_sequence);
        let delivered = u64::try_from(info.delivered).unwrap_or(1);
        let outcome = inbox
            .handle(&id, &message.payload, delivered, apply)
            .await
            .expect("handled");
        if let Outcome::Done(()) = outcome {
            println!("STALLED ack {id}");
            std::future::pending::<()>().await;
        }
        message.ack().await.expect("ack");
    }
}
