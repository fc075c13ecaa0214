//! The figures of the report, each read back from PostgreSQL (the outbox,
//! the inbox's records, the consumer's applied log) or from the stream.

use std::collections::{HashMap, HashSet};

use async_nats::header::NATS_MESSAGE_ID;
use async_nats::jetstream;

use crate::consumer;

pub struct Figures {
    /// Outbox rows: the events the producer committed.
    pub events: i64,
    expected: i64,
    /// Outbox rows not marked sent.
    unsent: i64,
    /// Outbox rows whose seq is not the order's step: commit order broken.
    seq_mismatches: i64,
    /// Messages the stream holds, and how many times each event id.
    stored: u64,
    stored_ids: HashMap<String, usize>,
    /// Distinct event ids in the stream.
    pub published: usize,
    /// Stream ids the outbox never emitted.
    unknown: usize,
    /// Emitted events with no applied-log row.
    pub lost: i64,
    /// Emitted events with no `done` record in the consumer's inbox.
    unrecorded: i64,
    /// Applied-log rows beyond one per (order, step).
    pub duplicate_effects: i64,
    /// Events applied before their order's previous step.
    pub order_inversions: i64,
    /// Deliveries the broker made beyond one per message: each was either
    /// skipped by the inbox or a first delivery whose transaction died.
    redeliveries: u64,
    /// Inbox records settled on a delivery after the first: the earlier
    /// ones died before their transaction committed.
    settled_late: i64,
}

impl Figures {
    pub fn stored_copies(&self, event: &str) -> usize {
        self.stored_ids.get(event).copied().unwrap_or(0)
    }

    /// Print what the last line sums up; true when all is as it must be.
    pub fn print(&self) -> bool {
        println!(
            "outbox: rows={} (expected {}) unsent={} seq≠step={}; inbox: events without a done record={}",
            self.events, self.expected, self.unsent, self.seq_mismatches, self.unrecorded
        );
        println!(
            "stream: messages={} distinct event ids={} ids the outbox never emitted={}",
            self.stored, self.published, self.unknown
        );
        println!(
            "consumer: redeliveries={}, events settled on a later delivery={} (the rest were \
             redeliveries of committed events, which the inbox skipped)",
            self.redeliveries, self.settled_late
        );
        self.events == self.expected
            && self.unsent == 0
            && self.seq_mismatches == 0
            && self.unrecorded == 0
            && self.stored == self.published as u64
            && self.published as i64 == self.events
            && self.unknown == 0
            && self.lost == 0
            && self.duplicate_effects == 0
            && self.order_inversions == 0
    }
}

async fn count(client: &tokio_postgres::Client, query: &str) -> i64 {
    client
        .query_one(query, &[])
        .await
        .unwrap_or_else(|e| panic!("{query}: {e}"))
        .get(0)
}

/// Every event id the stream stores, with its number of copies.
async fn stream_ids(js: &jetstream::Context, stream: &str) -> (u64, HashMap<String, usize>) {
    let mut handle = js.get_stream(stream).await.expect("the stream");
    let info = handle.info().await.expect("stream info");
    let (messages, first, last) = (
        info.state.messages,
        info.state.first_sequence,
        info.state.last_sequence,
    );
    let mut ids: HashMap<String, usize> = HashMap::new();
    for seq in first.max(1)..=last {
        let message = handle.get_raw_message(seq).await.expect("a stored message");
        let id = message
            .headers
            .get(NATS_MESSAGE_ID)
            .map(|v| v.as_str().to_owned())
            .unwrap_or_default();
        *ids.entry(id).or_default() += 1;
    }
    (messages, ids)
}

pub async fn read(
    client: &tokio_postgres::Client,
    js: &jetstream::Context,
    stream: &str,
    expected: i64,
) -> Figures {
    let events = count(client, "SELECT count(*) FROM idem_outbox").await;
    let unsent = count(
        client,
        "SELECT count(*) FROM idem_outbox WHERE state <> 'sent'",
    )
    .await;
    let seq_mismatches = count(
        client,
        "SELECT count(*) FROM idem_outbox WHERE (payload->>'step')::bigint <> seq",
    )
    .await;
    let lost = count(
        client,
        "SELECT count(*) FROM idem_outbox o WHERE NOT EXISTS (
             SELECT 1 FROM chaos_applied a
             WHERE 'order-' || a.order_id = o.key AND a.step = o.seq)",
    )
    .await;
    let unrecorded = client
        .query_one(
            "SELECT count(*) FROM idem_outbox o WHERE NOT EXISTS (
                 SELECT 1 FROM idem_inbox i
                 WHERE i.consumer = $1 AND i.msg_id = o.id::text AND i.state = 'done')",
            &[&consumer::NAME],
        )
        .await
        .expect("unrecorded events")
        .get(0);
    let duplicate_effects = count(
        client,
        "SELECT count(*) - count(DISTINCT (order_id, step)) FROM chaos_applied",
    )
    .await;
    let settled_late = count(
        client,
        "SELECT count(*) FROM idem_inbox WHERE deliveries > 1",
    )
    .await;
    let order_inversions = count(
        client,
        "SELECT count(*) FROM chaos_applied WHERE NOT in_order",
    )
    .await;

    let (stored, stored_ids) = stream_ids(js, stream).await;
    let emitted: HashSet<String> = client
        .query("SELECT id::text FROM idem_outbox", &[])
        .await
        .expect("event ids")
        .iter()
        .map(|r| r.get(0))
        .collect();
    let unknown = stored_ids
        .keys()
        .filter(|id| !emitted.contains(*id))
        .count();

    let info = js
        .get_stream(stream)
        .await
        .expect("the stream")
        .get_consumer::<jetstream::consumer::pull::Config>(consumer::NAME)
        .await
        .expect("the durable consumer")
        .info()
        .await
        .expect("consumer info")
        .clone();
    // The consumer sequence counts every delivery, the stream sequence each
    // message once.
    let redeliveries = info
        .delivered
        .consumer_sequence
        .saturating_sub(info.delivered.stream_sequence);

    Figures {
        events,
        expected,
        unsent,
        seq_mismatches,
        stored,
        published: stored_ids.len(),
        stored_ids,
        unknown,
        lost,
        unrecorded,
        duplicate_effects,
        order_inversions,
        redeliveries,
        settled_late,
    }
}
