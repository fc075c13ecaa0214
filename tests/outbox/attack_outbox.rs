//! A hostile pass on the outbox: forged subjects, keys and payloads; emits
//! in every transaction shape; relays killed and cut off between publish and
//! mark-sent. Every count is read from `idem_outbox` or from the stream.

use idem::outbox::Publisher;

use super::*;

/// An event whose key, subject and JSON body the test chooses.
struct Forged {
    key: String,
    subject: String,
    body: serde_json::Value,
}

impl Serialize for Forged {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.body.serialize(s)
    }
}

impl Event for Forged {
    const KIND: &'static str = "forged";
    const VERSION: u32 = 1;
    fn key(&self) -> String {
        self.key.clone()
    }
    fn subject(&self) -> String {
        self.subject.clone()
    }
}

#[retryable(max = 5, deadline_ms = 30000)]
async fn emit_forged(
    conn: &mut AsyncPgConnection,
    key: &str,
    subject: &str,
    body: &serde_json::Value,
) -> Result<EventId, AppError> {
    Ok(emit(
        conn,
        &Forged {
            key: key.to_owned(),
            subject: subject.to_owned(),
            body: body.clone(),
        },
    )
    .await?)
}

/// Floats, published as a bare JSON array, under the key `floats`.
async fn emit_floats(pool: &Pool, subject: &str, values: &[f64]) -> Result<EventId, AppError> {
    emit_forged(pool, "floats", subject, &serde_json::json!(values)).await
}

/// One message as the stream holds it: subject, headers as async-nats
/// parses them, body bytes.
struct Raw {
    subject: String,
    headers: HashMap<String, String>,
    payload: Vec<u8>,
}

async fn raw_messages(js: &jetstream::Context, stream: &str) -> Vec<Raw> {
    let mut stream = js.get_stream(stream).await.expect("the stream");
    let info = stream.info().await.expect("stream info").state.clone();
    let mut out = Vec::new();
    for seq in info.first_sequence..=info.last_sequence {
        let Ok(m) = stream.get_raw_message(seq).await else {
            continue;
        };
        let mut headers = HashMap::new();
        for (name, values) in m.headers.iter() {
            headers.insert(
                name.to_string(),
                values
                    .first()
                    .map(|v| v.as_str().to_owned())
                    .unwrap_or_default(),
            );
        }
        out.push(Raw {
            subject: m.subject.to_string(),
            headers,
            payload: m.payload.to_vec(),
        });
    }
    out
}

/// A publisher with no subject prefix: the event's subject is the whole
/// NATS subject, as `NatsPublisher::new` sends it by default.
async fn bare_publisher(env: &Env) -> NatsPublisher {
    let client = async_nats::connect(nats_url().await)
        .await
        .expect("connect to NATS");
    NatsPublisher::new(jetstream::new(client), &env.stream)
}

/// Run rounds until one claims nothing (the backoff of a refused event is
/// waited out while `pending` rows remain due soon).
async fn drain<P: Publisher>(relay: &Relay<P>, env: &Env) {
    bounded(async {
        loop {
            let round = relay.run_once().await.expect("round");
            if round.claimed == 0
                && env
                    .scalar("SELECT count(*) FROM idem_outbox WHERE state = 'pending'")
                    .await
                    == 0
            {
                return;
            }
            if round.claimed == 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    })
    .await;
}

// ---------------------------------------------------------------------------
// Forged subjects
// ---------------------------------------------------------------------------

/// Found: `Event::subject` was documented as "dot-separated tokens of
/// visible ASCII, no wildcards", and `emit` checked exactly that.
/// `$JS.API.STREAM.PURGE.<S>` is such a subject: the relay published the
/// event as a JetStream API request, and the stream lost every event
/// already published. `emit` now refuses a subject starting with `$` (and
/// one under `_INBOX`), writing nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn found_a_subject_into_the_jetstream_api_purges_the_stream() {
    let env = env("atk_purge", Duration::from_secs(120)).await;
    let ok = format!("{}.ok", env.stream);
    for n in 0..3 {
        emit_forged(&env.pool, "good", &ok, &serde_json::json!({ "n": n }))
            .await
            .expect("emit");
    }
    let relay = Relay::new(env.pool.clone(), bare_publisher(&env).await)
        .listen(false)
        .max_attempts(2)
        .backoff(Duration::from_millis(10), Duration::from_millis(20));
    drain(&relay, &env).await;
    assert_eq!(env.stream_count().await, 3, "three events stored");

    // A subject emit accepts: tokens of visible ASCII, no wildcard.
    let forged = format!("$JS.API.STREAM.PURGE.{}", env.stream);
    let accepted = emit_forged(&env.pool, "evil", &forged, &serde_json::json!({})).await;
    drain(&relay, &env).await;
    let stored = env.stream_count().await;
    let states = env.rows().await;
    println!(
        "forged subject accepted: {}; stream now holds {stored}; rows {states:?}",
        accepted.is_ok()
    );
    assert_eq!(
        stored, 3,
        "the stream must still hold the three events published before (emit accepted {forged}: {accepted:?})"
    );
    let refused = format!("{accepted:?}");
    assert!(refused.contains("JetStream's API"), "{refused}");
    assert_eq!(
        states.len(),
        3,
        "nothing written for the forged subject: {states:?}"
    );
    let reply = emit_forged(&env.pool, "evil", "_INBOX.abc", &serde_json::json!({})).await;
    assert!(format!("{reply:?}").contains("for replies"), "{reply:?}");
}

// ---------------------------------------------------------------------------
// Forged keys
// ---------------------------------------------------------------------------

/// Found: a key with an end space (or a no-break space) was valid for
/// `emit`, and the stream's `Idem-Event-Key` header, read back by
/// async-nats (the client idem's own inbox uses), named another key (the
/// client trims header values): `"k "`, `" k"` and `"k\u{a0}"` all read as
/// `"k"`. `emit` now refuses white space at either end of a key; every key
/// it takes reads back as itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn found_a_key_with_end_spaces_reads_back_as_another_key() {
    let env = env("atk_keyspace", Duration::from_secs(120)).await;
    let subject = format!("{}.k", env.stream);
    for key in ["k ", " k", "k\u{a0}", "\u{3000}k"] {
        let refused = emit_forged(&env.pool, key, &subject, &serde_json::json!({})).await;
        assert!(
            format!("{refused:?}").contains("white space at either end"),
            "{key:?}: {refused:?}"
        );
    }
    let keys = ["k", "k k", "ключ", "a:b"];
    for key in keys {
        emit_forged(&env.pool, key, &subject, &serde_json::json!({ "key": key }))
            .await
            .unwrap_or_else(|e| panic!("emit {key:?}: {e}"));
    }
    let relay = Relay::new(env.pool.clone(), bare_publisher(&env).await).listen(false);
    drain(&relay, &env).await;
    let ids: HashMap<String, String> = env
        .rows()
        .await
        .into_iter()
        .map(|(id, key, ..)| (id, key))
        .collect();
    let raw = raw_messages(&env.js, &env.stream).await;
    assert_eq!(raw.len(), keys.len(), "one message per event");
    let mut wrong = Vec::new();
    for m in &raw {
        let id = &m.headers["Nats-Msg-Id"];
        let emitted = &ids[id];
        let header = &m.headers["Idem-Event-Key"];
        if header != emitted {
            wrong.push((emitted.clone(), header.clone()));
        }
    }
    assert!(
        wrong.is_empty(),
        "(emitted key, key the header reads back as): {wrong:?}"
    );
}

// ---------------------------------------------------------------------------
// Forged payloads
// ---------------------------------------------------------------------------

/// Found: the body is "the JSON event". Floats go through `jsonb` (numeric,
/// printed in full) and back through serde_json's parser, whose default
/// (best-effort) reading changed 931 of 3000 of them by a unit in the last
/// place. The workspace's serde_json now reads floats exactly
/// (`float_roundtrip`): each published float is the float emitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn found_floats_change_on_their_way_through_the_outbox() {
    let env = env("atk_floats", Duration::from_secs(120)).await;
    let subject = format!("{}.f", env.stream);
    // A deterministic spread of finite doubles over the whole range.
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    // Below 1e308: nearer f64::MAX the body cannot even be read back (the
    // next test).
    let mut values = vec![1.7e308, f64::MIN_POSITIVE, 5e-324, 1e300, 0.1, 1.0 / 3.0];
    while values.len() < 3000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let f = f64::from_bits(x);
        if f.is_finite() && f.abs() < 1e308 {
            values.push(f);
        }
    }
    emit_floats(&env.pool, &subject, &values)
        .await
        .expect("emit");
    let relay = Relay::new(env.pool.clone(), bare_publisher(&env).await).listen(false);
    drain(&relay, &env).await;
    let raw = raw_messages(&env.js, &env.stream).await;
    assert_eq!(raw.len(), 1);
    let body = std::str::from_utf8(&raw[0].payload).expect("utf-8");
    // Parsed with the standard library's correctly rounded parser.
    let published: Vec<f64> = body
        .trim_start_matches('[')
        .trim_end_matches(']')
        .split(',')
        .map(|t| t.parse::<f64>().unwrap_or_else(|e| panic!("{t}: {e}")))
        .collect();
    assert_eq!(published.len(), values.len());
    let changed: Vec<(f64, f64)> = values
        .iter()
        .zip(&published)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .map(|(a, b)| (*a, *b))
        .collect();
    println!("{} of {} floats changed", changed.len(), values.len());
    assert!(
        changed.is_empty(),
        "{} of {} floats published differ from the ones emitted, e.g. {:?}",
        changed.len(),
        values.len(),
        &changed[..changed.len().min(5)]
    );
}

/// Three events of keys `good-0..2` behind one event emitted by `poison`;
/// five relay rounds, a lease apart: how many of the good events were sent
/// and stored.
async fn behind_a_poison<F: Future<Output = ()>>(env: &Env, poison: F) -> (i64, u64) {
    poison.await;
    let subject = format!("{}.g", env.stream);
    for n in 0..3 {
        emit_forged(
            &env.pool,
            &format!("good-{n}"),
            &subject,
            &serde_json::json!({ "n": n }),
        )
        .await
        .expect("emit");
    }
    // Rounds as `run` makes them, each once every lease has run out (so
    // each claims the heads that are due, as a relay polling after the
    // lease does; `run` logs a failed round and polls again).
    let lease = Duration::from_millis(200);
    let relay = Relay::new(env.pool.clone(), bare_publisher(env).await)
        .max_attempts(2)
        .lease(lease)
        .backoff(Duration::from_millis(10), Duration::from_millis(20));
    for _ in 0..5 {
        let round = bounded(relay.run_once()).await;
        println!("round: {round:?}");
        tokio::time::sleep(lease + Duration::from_millis(100)).await;
    }
    let sent = env
        .scalar("SELECT count(*) FROM idem_outbox WHERE key LIKE 'good-%' AND state = 'sent'")
        .await;
    let poison = env
        .rows()
        .await
        .into_iter()
        .filter(|r| !r.1.starts_with("good-"))
        .collect::<Vec<_>>();
    let stored = env.stream_count().await;
    println!("good sent={sent} stored={stored}; the poison row: {poison:?}");
    (sent, stored)
}

/// Found: one event whose body holds `f64::MAX` (valid JSON, valid
/// `jsonb`, written by `emit` without complaint) must block at most its own
/// key: "a poison event ... blocking only its key". `jsonb` prints it as 309
/// digits, which serde_json's default parser read as out of range, so the
/// claim of every round failed to decode its rows (after leasing them):
/// nothing of any key was published, for ever. It now reads back (exact
/// floats), and is published with the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn found_one_unreadable_body_stops_the_relay_for_every_key() {
    let env = env("atk_maxf", Duration::from_secs(120)).await;
    let subject = format!("{}.f", env.stream);
    let got = behind_a_poison(&env, async {
        emit_floats(&env.pool, &subject, &[f64::MAX])
            .await
            .expect("emit accepts f64::MAX");
    })
    .await;
    assert_eq!(
        got,
        (3, 4),
        "the three events of other keys, and the f64::MAX one, are published"
    );
}

/// Found: the same with a body nested 200 deep: `serde_json::to_value` and
/// `jsonb` took it, serde_json's parser stops at 128 levels when the relay
/// reads it back, and the whole batch failed. `emit` now refuses a body
/// nested deeper than `MAX_STORED_DEPTH` (`EmitError::Unstorable`), and a
/// row the relay cannot read back (written by hand here, as an older build
/// could have) is parked dead at once, blocking its key only.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn found_a_deeply_nested_body_stops_the_relay_for_every_key() {
    let env = env("atk_deep", Duration::from_secs(120)).await;
    let subject = format!("{}.d", env.stream);
    let mut deep = serde_json::json!(1);
    for _ in 0..200 {
        deep = serde_json::json!([deep]);
    }
    let refused = emit_forged(&env.pool, "deep", &subject, &deep).await;
    assert!(
        format!("{refused:?}").contains("TooDeep"),
        "emit refuses a body nested 200 deep: {refused:?}"
    );
    let got = behind_a_poison(&env, async {
        env.client
            .execute(
                "INSERT INTO idem_outbox (id, key, seq, subject, kind, version, payload) \
                 VALUES (gen_random_uuid(), 'deep', 1, $1, 'forged', 1, $2::text::jsonb)",
                &[&subject, &deep.to_string()],
            )
            .await
            .expect("a deep row written by hand");
    })
    .await;
    assert_eq!(
        got,
        (3, 3),
        "the three events of other keys must be published past the one unreadable body"
    );
    let dead = env
        .scalar("SELECT count(*) FROM idem_outbox WHERE key = 'deep' AND state = 'dead' AND last_error LIKE '%cannot be read back%'")
        .await;
    assert_eq!(dead, 1, "the unreadable row parked dead at once");
}

/// A string holding NUL is valid JSON (`"\u0000"`) but not valid `jsonb`:
/// the emit fails, and with it the business transaction: nothing of it
/// commits (no half: counter without event).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_a_nul_in_the_payload_commits_neither_event_nor_business_write() {
    let env = env("atk_nul", Duration::from_secs(120)).await;

    #[retryable(max = 3, deadline_ms = 30000)]
    async fn bump_and_emit(conn: &mut AsyncPgConnection, text: &str) -> Result<(), AppError> {
        diesel_async::RunQueryDsl::execute(
            diesel::sql_query("INSERT INTO counters (key, n) VALUES ('nul', 1)"),
            conn,
        )
        .await?;
        emit(
            conn,
            &Forged {
                key: "nul".into(),
                subject: "x.y".into(),
                body: serde_json::json!({ "text": text }),
            },
        )
        .await?;
        Ok(())
    }
    let r = bump_and_emit(&env.pool, "a\0b").await;
    println!("emit of a NUL payload: {r:?}");
    assert!(r.is_err(), "refused: {r:?}");
    assert_eq!(env.scalar("SELECT count(*) FROM idem_outbox").await, 0);
    assert_eq!(env.scalar("SELECT count(*) FROM counters").await, 0);
    // A huge payload (4 MiB, over the default max_payload of 1 MiB) is
    // written, and a relay parks it without sending it; other keys go on.
    let big = "x".repeat(4 << 20);
    emit_forged(
        &env.pool,
        "big",
        &format!("{}.big", env.stream),
        &serde_json::json!({ "big": big }),
    )
    .await
    .expect("a big event is written");
    emit_forged(
        &env.pool,
        "small",
        &format!("{}.small", env.stream),
        &serde_json::json!({}),
    )
    .await
    .expect("emit");
    let relay = Relay::new(env.pool.clone(), bare_publisher(&env).await)
        .listen(false)
        .max_attempts(2)
        .backoff(Duration::from_millis(10), Duration::from_millis(20));
    drain(&relay, &env).await;
    assert_eq!(
        env.scalar("SELECT count(*) FROM idem_outbox WHERE key = 'big' AND state = 'dead'")
            .await,
        1
    );
    let raw = raw_messages(&env.js, &env.stream).await;
    assert_eq!(raw.len(), 1, "only the small event is stored");
    assert_eq!(raw[0].subject, format!("{}.small", env.stream));
}

// ---------------------------------------------------------------------------
// Transaction shapes
// ---------------------------------------------------------------------------

/// The database of the shapes test, for the connection its spawned task opens.
static SHAPES_URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();

#[retryable(max = 5, deadline_ms = 30000)]
async fn shapes(conn: &mut AsyncPgConnection, shape: &str, key: &str) -> Result<(), AppError> {
    let ev = |n: i64| Changed {
        key: key.to_owned(),
        n,
    };
    let bump = |k: &str| {
        format!("INSERT INTO counters (key, n) VALUES ('{k}', 1) ON CONFLICT (key) DO UPDATE SET n = counters.n + 1")
    };
    match shape {
        "savepoint" => {
            // An emit inside a savepoint that rolls back, then one that stays.
            let rolled_back = ev(100);
            let inner: Result<(), AppError> = conn
                .transaction::<(), AppError, _>(async |c| {
                    emit(c, &rolled_back).await?;
                    Err(AppError::Refused)
                })
                .await;
            // And a savepoint by hand, rolled back to.
            conn.batch_execute("SAVEPOINT atk").await?;
            emit(conn, &ev(101)).await?;
            conn.batch_execute("ROLLBACK TO SAVEPOINT atk").await?;
            assert!(inner.is_err());
            conn.batch_execute(&bump(key)).await?;
            emit(conn, &ev(1)).await?;
        }
        "replayed" => {
            conn.batch_execute(&bump(key)).await?;
            emit(conn, &ev(1)).await?;
            if idem::attempt::current_attempt() == Some(1) {
                idem::attempt::lost_race();
                return Err(AppError::Refused);
            }
        }
        "commit" => {
            conn.batch_execute(&bump(key)).await?;
            emit(conn, &ev(1)).await?;
            conn.batch_execute("COMMIT").await?;
        }
        "rollback_insert" => {
            conn.batch_execute(&bump(key)).await?;
            emit(conn, &ev(1)).await?;
            conn.batch_execute(&format!("ROLLBACK; {}", bump("after-rollback")))
                .await?;
        }
        "spawned" => {
            let key = key.to_owned();
            let r = tokio::spawn(async move {
                // No connection of the attempt here: a fresh one.
                let url = SHAPES_URL.get().expect("set by the test").clone();
                let mut other = AsyncPgConnection::establish(&url).await.expect("connect");
                emit(&mut other, &Changed { key, n: 1 }).await
            })
            .await
            .expect("the task");
            assert!(matches!(r, Err(EmitError::OutsideAttempt)), "{r:?}");
        }
        _ => unreachable!(),
    }
    Ok(())
}

/// Each shape, then the rows of `idem_outbox` and `counters` it left, and
/// what a relay stored: an event exists exactly when the write made with it
/// in its transaction committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn attack_emits_in_every_transaction_shape_commit_with_their_transaction() {
    let env = env("atk_shapes", Duration::from_secs(120)).await;
    SHAPES_URL.get_or_init(|| env.db.url().to_owned());
    let mut results = Vec::new();
    for shape in [
        "savepoint",
        "replayed",
        "commit",
        "rollback_insert",
        "spawned",
    ] {
        let r = shapes(&env.pool, shape, shape).await;
        results.push((shape, format!("{r:?}")));
    }
    println!("{results:?}");
    let relay = Relay::new(env.pool.clone(), env.publisher().await).listen(false);
    while bounded(relay.run_once()).await.expect("round").claimed > 0 {}
    let rows = env.rows().await;
    let per_key = |k: &str| -> Vec<(i64, String)> {
        rows.iter()
            .filter(|r| r.1 == k)
            .map(|r| (r.2, r.3.clone()))
            .collect()
    };
    let counters: HashMap<String, i64> = env
        .client
        .query("SELECT key, n FROM counters", &[])
        .await
        .expect("counters")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let counter = |k: &str| counters.get(k).copied().unwrap_or(0);
    // The rolled-back savepoint's emit left no row and no gap.
    assert_eq!(per_key("savepoint"), vec![(1, "sent".to_owned())]);
    assert_eq!(counter("savepoint"), 1);
    // The replayed attempt left one event, with its one write.
    assert_eq!(per_key("replayed"), vec![(1, "sent".to_owned())]);
    assert_eq!(counter("replayed"), 1);
    // COMMIT by hand: the write and its event committed together.
    assert_eq!(per_key("commit"), vec![(1, "sent".to_owned())]);
    assert_eq!(counter("commit"), 1);
    // ROLLBACK; INSERT: the write and the event before it rolled back
    // together; the write after it is outside any transaction.
    assert_eq!(per_key("rollback_insert"), vec![]);
    assert_eq!(counter("rollback_insert"), 0);
    // Spawned: refused, nothing written.
    assert_eq!(per_key("spawned"), vec![]);
    let stored = env.stored().await;
    let keys: Vec<&str> = stored.iter().map(|m| m.key.as_str()).collect();
    assert_eq!(stored.len(), 3, "{keys:?}");
}
