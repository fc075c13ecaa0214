//! The figures of the last line, counted on the final primary and in the
//! stream, never from what idem, the relay or the consumer reported.

use std::collections::{HashMap, HashSet};

use async_nats::header::NATS_MESSAGE_ID;
use async_nats::jetstream;

use crate::payments::PaymentMade;

#[derive(Debug, Default)]
pub struct Figures {
    /// Keys a call returned `Ok` for at least once (fresh or replay), as
    /// the clients recorded it.
    pub acknowledged: usize,
    /// Acknowledged keys of which a payment id a client was given is not a
    /// payment on the final primary.
    pub lost_acknowledged: usize,
    /// Payment rows beyond one per key, plus applied effects beyond one per
    /// payment.
    pub duplicate_effects: usize,
    /// Payments named by a stream message or an applied effect that do not
    /// exist on the final primary.
    pub ghost_events: usize,
    /// Payments on the final primary whose event is not in the stream or
    /// whose effect the consumer never applied.
    pub lost_events: usize,

    payments: usize,
    keys_paid: usize,
    keys_paid_twice: usize,
    effects: usize,
    effects_applied_twice: usize,
    stream_messages: usize,
    stream_ids: usize,
    stream_unreadable: usize,
    ghosts_in_stream: usize,
    ghosts_applied: usize,
    not_in_stream: usize,
    not_applied: usize,
    outbox_unsent: i64,
    outbox_dead: i64,
    records: i64,
}

impl Figures {
    /// The detail behind the last line.
    pub fn print(&self) {
        println!(
            "primary: payments={} keys_paid={} keys_paid_twice={} idem_requests={} outbox_unsent={} \
             outbox_dead={}",
            self.payments,
            self.keys_paid,
            self.keys_paid_twice,
            self.records,
            self.outbox_unsent,
            self.outbox_dead
        );
        println!(
            "stream: messages={} distinct_event_ids={} unreadable={} payments_not_on_primary={} \
             primary_payments_missing={}",
            self.stream_messages,
            self.stream_ids,
            self.stream_unreadable,
            self.ghosts_in_stream,
            self.not_in_stream
        );
        println!(
            "consumer: effects={} payments_applied_twice={} payments_not_on_primary={} \
             primary_payments_not_applied={}",
            self.effects, self.effects_applied_twice, self.ghosts_applied, self.not_applied
        );
    }
}

async fn number(db: &tokio_postgres::Client, sql: &str) -> i64 {
    db.query_one(sql, &[])
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .get(0)
}

/// The payment id of every message the stream stores, with the number of
/// distinct event ids and the messages that could not be read.
async fn stream_payments(
    js: &jetstream::Context,
    stream: &str,
) -> (usize, HashSet<String>, Vec<String>, usize) {
    let mut handle = js.get_stream(stream).await.expect("the stream");
    let info = handle.info().await.expect("stream info");
    let (first, last) = (info.state.first_sequence, info.state.last_sequence);
    let mut ids = HashSet::new();
    let mut payments = Vec::new();
    let (mut read, mut unreadable) = (0, 0);
    for seq in first.max(1)..=last {
        let Ok(message) = handle.get_raw_message(seq).await else {
            unreadable += 1;
            continue;
        };
        read += 1;
        if let Some(id) = message.headers.get(NATS_MESSAGE_ID) {
            ids.insert(id.as_str().to_owned());
        }
        match serde_json::from_slice::<PaymentMade>(&message.payload) {
            Ok(event) => payments.push(event.payment_id),
            Err(_) => unreadable += 1,
        }
    }
    (read, ids, payments, unreadable)
}

/// Counts on the final primary (`db`) and in `stream`; `acked` holds every
/// payment id the clients were answered with, by key.
pub async fn read(
    db: &tokio_postgres::Client,
    js: &jetstream::Context,
    stream: &str,
    acked: &HashMap<String, HashSet<String>>,
) -> Figures {
    let rows = db
        .query("SELECT payment_id::text, key FROM failover_payments", &[])
        .await
        .expect("the payments");
    let mut by_key: HashMap<String, usize> = HashMap::new();
    let mut payments: HashSet<String> = HashSet::new();
    for row in &rows {
        payments.insert(row.get(0));
        *by_key.entry(row.get(1)).or_default() += 1;
    }
    let mut applied: HashMap<String, usize> = HashMap::new();
    for row in db
        .query("SELECT payment_id::text FROM failover_effects", &[])
        .await
        .expect("the effects")
    {
        *applied.entry(row.get(0)).or_default() += 1;
    }
    let (stream_messages, stream_ids, in_stream, stream_unreadable) =
        stream_payments(js, stream).await;
    let in_stream: HashSet<String> = in_stream.into_iter().collect();

    let lost_acknowledged = acked
        .values()
        .filter(|ids| ids.iter().any(|id| !payments.contains(id)))
        .count();
    let extra_payments: usize = by_key.values().map(|n| n - 1).sum();
    let extra_effects: usize = applied.values().map(|n| n - 1).sum();
    let ghosts_in_stream = in_stream.iter().filter(|p| !payments.contains(*p)).count();
    let ghosts_applied = applied.keys().filter(|p| !payments.contains(*p)).count();
    let ghosts: HashSet<&String> = in_stream
        .iter()
        .chain(applied.keys())
        .filter(|p| !payments.contains(*p))
        .collect();
    let not_in_stream = payments.iter().filter(|p| !in_stream.contains(*p)).count();
    let not_applied = payments
        .iter()
        .filter(|p| !applied.contains_key(*p))
        .count();
    let lost_events = payments
        .iter()
        .filter(|p| !in_stream.contains(*p) || !applied.contains_key(*p))
        .count();

    Figures {
        acknowledged: acked.len(),
        lost_acknowledged,
        duplicate_effects: extra_payments + extra_effects,
        ghost_events: ghosts.len(),
        lost_events,
        payments: payments.len(),
        keys_paid: by_key.len(),
        keys_paid_twice: by_key.values().filter(|n| **n > 1).count(),
        effects: applied.values().sum(),
        effects_applied_twice: applied.values().filter(|n| **n > 1).count(),
        stream_messages,
        stream_ids: stream_ids.len(),
        stream_unreadable,
        ghosts_in_stream,
        ghosts_applied,
        not_in_stream,
        not_applied,
        outbox_unsent: number(
            db,
            "SELECT count(*) FROM idem_outbox WHERE state = 'pending'",
        )
        .await,
        outbox_dead: number(db, "SELECT count(*) FROM idem_outbox WHERE state = 'dead'").await,
        records: number(db, "SELECT count(*) FROM idem_requests").await,
    }
}
