//! A key reused after its record expired is a new request: its events are
//! new events, end to end. Before, their ids were derived from (scope, key,
//! n-th emit) alone: the second request could not commit while the first
//! event's outbox row was kept (`idem_outbox_pkey`), and once it could, the
//! consumer's inbox skipped its event as a copy of the first. Counted in
//! the database (fees, outbox rows, effects, inbox records) and the stream.

use async_nats::jetstream::stream;
use idem::outbox::{emit, EmitError, Event, NatsPublisher, Relay};
use idem::{idempotent, retryable};
use serde::Serialize;

use super::*;

/// A fee charged to an account, to apply downstream.
#[derive(Debug, Serialize)]
struct Fee {
    account: String,
    cents: i64,
}

impl Event for Fee {
    const KIND: &'static str = "fee";
    const VERSION: u32 = 1;
    fn key(&self) -> String {
        self.account.clone()
    }
}

#[derive(Debug, thiserror::Error)]
enum FeeError {
    #[error(transparent)]
    Idem(#[from] idem::Error),
    #[error(transparent)]
    Db(#[from] diesel::result::Error),
    #[error(transparent)]
    Emit(#[from] EmitError),
}

impl idem::IdempotentError for FeeError {
    type Final = ();
    fn to_final(&self) -> Option<()> {
        None
    }
    fn from_final(_: ()) -> Self {
        FeeError::Idem(idem::Error::ClaimLost)
    }
}

#[idempotent(key = key, scope = account, fingerprint(account, cents))]
#[retryable(max = 4, deadline_ms = 30000)]
async fn charge(
    conn: &mut AsyncPgConnection,
    account: &str,
    key: &str,
    cents: &i64,
) -> Result<(), FeeError> {
    diesel::sql_query("INSERT INTO fees (account, cents) VALUES ($1, $2)")
        .bind::<Text, _>(account)
        .bind::<diesel::sql_types::BigInt, _>(*cents)
        .execute(conn)
        .await?;
    emit(
        conn,
        &Fee {
            account: account.to_owned(),
            cents: *cents,
        },
    )
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_reused_after_expiry_emits_new_events_that_the_consumer_applies() {
    let env = env().await;
    env.client
        .batch_execute("CREATE TABLE fees (account text NOT NULL, cents bigint NOT NULL)")
        .await
        .expect("fees");
    // A stream of the test's own that captures the relay's subjects.
    let name = format!("REUSED_{}", env.stream.name());
    env.js
        .create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![format!("{name}.>")],
            storage: stream::StorageType::Memory,
            ..Default::default()
        })
        .await
        .expect("stream");
    let consumer = env
        .js
        .get_stream(&name)
        .await
        .expect("the stream")
        .create_consumer(pull::Config {
            durable_name: Some("fees".to_owned()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(30),
            ..Default::default()
        })
        .await
        .expect("consumer");
    let relay = Relay::new(
        env.pool.clone(),
        NatsPublisher::new(env.js.clone(), &name).subject_prefix(&name),
    )
    .listen(false);
    let inbox = Inbox::new(env.pool.clone(), "fees", InboxConfig::new()).expect("inbox");
    let deliver = || async {
        while relay.run_once().await.expect("relay round").claimed > 0 {}
        env.run_until_settled(&inbox, &consumer, record_body).await
    };

    charge(&env.pool, "acct-1", "fee-2026-11", &100)
        .await
        .expect("the first request");
    deliver().await;
    // The record expires (the relay keeps the sent outbox row an hour):
    // the key is new again, and the next request with it is another one.
    env.client
        .batch_execute("UPDATE idem_requests SET expires_at = now() - interval '1 second'")
        .await
        .expect("expire");
    charge(&env.pool, "acct-1", "fee-2026-11", &100)
        .await
        .expect("the second request with the key commits");
    deliver().await;

    let client = &env.client;
    let count = |sql: &'static str| async move {
        client
            .query_one(sql, &[])
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .get::<_, i64>(0)
    };
    assert_eq!(count("SELECT count(*) FROM fees").await, 2, "two fees");
    assert_eq!(
        count("SELECT count(DISTINCT id) FROM idem_outbox WHERE state = 'sent'").await,
        2,
        "two events, each with its own id, both sent"
    );
    let messages = env
        .js
        .get_stream(&name)
        .await
        .expect("the stream")
        .info()
        .await
        .expect("stream info")
        .state
        .messages;
    assert_eq!(messages, 2, "the stream stored both events");
    assert_eq!(
        count("SELECT count(*) FROM idem_inbox WHERE consumer = 'fees' AND state = 'done'").await,
        2,
        "the consumer recorded both"
    );
    assert_eq!(
        env.effect_bodies().await.len(),
        2,
        "and applied both: the second is no copy of the first"
    );
    env.js.delete_stream(&name).await.expect("delete stream");
}
