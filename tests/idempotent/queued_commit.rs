//! A body's own `COMMIT` still on its way to the socket as its call is
//! dropped. tokio-postgres hands a request to its connection's driver
//! task, which may write it on another thread after the dropped
//! transaction looked at the wire. Effects and records counted in the
//! database.

use super::*;
use futures_util::FutureExt;
use tokio::sync::Notify;

/// Effect, then `COMMIT` by hand queued (its future polled once, so that
/// tokio-postgres has it, and dropped), then `reached` told and a panic
/// (`panic`) or a long wait.
#[idempotent(key = key, fingerprint(key), scope = none)]
#[retryable(max = 1, deadline_ms = 20000, commit_timeout_ms = 3000)]
async fn queues_commit(
    conn: &mut AsyncPgConnection,
    key: &str,
    panic: bool,
    reached: &Notify,
) -> Result<i64, AppError> {
    let id = insert_effect(conn, key, 1).await?;
    let commit = conn.batch_execute("COMMIT");
    assert!(commit.now_or_never().is_none(), "answered at once");
    reached.notify_one();
    assert!(!panic, "the body panics with its COMMIT queued");
    tokio::time::sleep(Duration::from_secs(60)).await;
    Ok(id)
}

/// Calls whose body queued its own `COMMIT` and then panicked, or whose
/// caller gave up at once, on a pool of two. Seen: 17 and 30 of 200 effects
/// committed with no record of their key (in two of two runs); a repeat
/// would run again. The transaction's drop read the wire (no `COMMIT`
/// sent), closed the connection and held nothing, while the driver, on the
/// other worker, wrote the `COMMIT` before it saw the close.
/// Fixed: the drop severs the wire first (`Tx::stop_writing_unless_committed`),
/// a sever waiting for a write under way to be counted (`Wire::sever`):
/// what the wire then says is final.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_a_commit_written_after_its_call_was_dropped_is_held() {
    let env = env(2).await;
    let keys: Vec<String> = (0..200).map(|i| format!("queued-{i}")).collect();
    for (i, key) in keys.iter().enumerate() {
        let (pool, key, panic) = (env.pool.clone(), key.clone(), i % 2 == 0);
        let _ = tokio::spawn(async move {
            let reached = Notify::new();
            tokio::select! {
                _ = queues_commit(&pool, &key, panic, &reached) => {}
                () = reached.notified() => {}
            }
        })
        .await;
    }
    let unheld = "SELECT count(*) FROM effects e WHERE e.tag LIKE 'queued-%' AND NOT EXISTS \
                  (SELECT 1 FROM idem_requests r WHERE r.key = e.tag)";
    let held = eventually(Duration::from_secs(10), || async {
        env.scalar(unheld).await == 0
    })
    .await;
    let effects = env
        .scalar("SELECT count(*) FROM effects WHERE tag LIKE 'queued-%'")
        .await;
    let unheld = env.scalar(unheld).await;
    assert!(
        held,
        "{unheld} of {effects} effects committed without their key held"
    );
    // And no key held without its effect: each of those runs once more.
    let false_holds = "SELECT count(*) FROM idem_requests r WHERE r.key LIKE 'queued-%' \
                       AND NOT EXISTS (SELECT 1 FROM effects e WHERE e.tag = r.key)";
    assert_eq!(env.scalar(false_holds).await, 0);
    // Each repeat either is refused (held) or reaches its own `COMMIT`;
    // then it is dropped once its effect shows (no fixed wait: a loaded
    // machine answered neither within 300 ms).
    for key in keys.iter().take(20) {
        let before = env.effects(key).await;
        let reached = Notify::new();
        let mut again = Box::pin(queues_commit(&env.pool, key, false, &reached));
        let answer = tokio::select! {
            answer = &mut again => Some(answer),
            () = reached.notified() => None,
        };
        let ran = answer.is_none()
            && eventually(Duration::from_secs(10), || async {
                env.effects(key).await == before + 1
            })
            .await;
        drop(again);
        let after = env.effects(key).await;
        match before {
            0 => assert!(
                ran && after == 1,
                "{key}: no effect, so the repeat runs: {after}"
            ),
            _ => assert!(
                after == before && matches!(answer, Some(Err(_))),
                "{key}: held, so the repeat is refused: {answer:?}, effects {after}"
            ),
        }
    }
}

/// Effect, then `COMMIT` by hand queued (polled once), then `reached` told
/// and `Ok` returned: idem's own `COMMIT` goes out behind the body's.
#[idempotent(key = key, fingerprint(key), scope = none)]
#[retryable(max = 1, deadline_ms = 20000, commit_timeout_ms = 3000)]
async fn queues_commit_and_returns(
    conn: &mut AsyncPgConnection,
    key: &str,
    reached: &Notify,
) -> Result<i64, AppError> {
    let id = insert_effect(conn, key, 1).await?;
    drop(conn.batch_execute("COMMIT").now_or_never());
    reached.notify_one();
    Ok(id)
}

/// Calls whose body queued its own `COMMIT` and returned `Ok`, dropped by
/// their caller a few scheduler turns later: often while idem's own
/// `COMMIT` (withheld behind the body's, see `Wire::withheld`) is in
/// flight. Every effect committed has its key held, whenever the drop
/// lands; no key is held without its effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_dropped_during_commit_behind_a_queued_commit_holds_its_key() {
    let env = env(2).await;
    for i in 0..160_usize {
        let (pool, key) = (env.pool.clone(), format!("behind-{i}"));
        let _ = tokio::spawn(async move {
            let reached = Notify::new();
            let call = queues_commit_and_returns(&pool, &key, &reached);
            tokio::pin!(call);
            tokio::select! {
                _ = &mut call => return,
                () = reached.notified() => {}
            }
            for _ in 0..i % 16 {
                if (&mut call).now_or_never().is_some() {
                    return;
                }
                tokio::task::yield_now().await;
            }
        })
        .await;
    }
    let unheld = "SELECT count(*) FROM effects e WHERE e.tag LIKE 'behind-%' AND NOT EXISTS \
                  (SELECT 1 FROM idem_requests r WHERE r.key = e.tag)";
    let held = eventually(Duration::from_secs(10), || async {
        env.scalar(unheld).await == 0
    })
    .await;
    let effects = env
        .scalar("SELECT count(*) FROM effects WHERE tag LIKE 'behind-%'")
        .await;
    let unheld = env.scalar(unheld).await;
    assert!(
        held,
        "{unheld} of {effects} effects committed, key not held"
    );
    let listed = "SELECT r.key || ' ' || r.state::text || ' ' || coalesce(r.outcome::text, '-') \
                  FROM idem_requests r WHERE r.key LIKE 'behind-%' \
                  AND NOT EXISTS (SELECT 1 FROM effects e WHERE e.tag = r.key)";
    let rows = env.client.query(listed, &[]).await.unwrap();
    let listed: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    assert!(
        listed.is_empty(),
        "records without their effect: {listed:?}"
    );
}

/// On a current-thread runtime the driver runs only once the call awaits:
/// a body's queued `COMMIT` and idem's own go out in one write, and the
/// record rides on the body's (the same text). That was idem's commit: the
/// call answers `Ok`, the record stands with its effect, a repeat is
/// replayed. (It answered `TransactionEnded { committed: true }`, and its
/// hold found the record and logged an error.)
#[tokio::test(flavor = "current_thread")]
async fn a_queued_commit_the_record_rode_on_is_answered_ok() {
    let env = env(2).await;
    for i in 0..5 {
        let key = format!("rode-{i}");
        let first = queues_commit_and_returns(&env.pool, &key, &Notify::new()).await;
        assert!(matches!(&first, Ok(v) if !v.replayed), "{key}: {first:?}");
        assert_eq!(env.effects(&key).await, 1, "{key}");
        let rec = env.record(&key).await;
        let state = rec.as_ref().map(|(s, o, _)| (s.as_str(), o.as_deref()));
        assert_eq!(state, Some(("completed", Some("ok"))), "{key}");
        let again = queues_commit_and_returns(&env.pool, &key, &Notify::new()).await;
        assert!(matches!(&again, Ok(v) if v.replayed), "{key}: {again:?}");
        assert_eq!(env.effects(&key).await, 1, "{key}: replayed, not run");
    }
}

/// Effect, then `COMMIT` by hand and a second write queued behind it (each
/// polled once), then `Ok`.
#[idempotent(key = key, fingerprint(key), scope = none)]
#[retryable(max = 1, deadline_ms = 20000, commit_timeout_ms = 3000)]
async fn queues_commit_and_a_write(
    conn: &mut AsyncPgConnection,
    key: &str,
) -> Result<i64, AppError> {
    let id = insert_effect(conn, key, 1).await?;
    drop(conn.batch_execute("COMMIT").now_or_never());
    let sql = format!("INSERT INTO effects (tag, n) VALUES ('{key}', 2)");
    drop(conn.batch_execute(&sql).now_or_never());
    Ok(id)
}

/// On a current-thread runtime: the record rides on the body's queued
/// `COMMIT` (the same text) and commits with its effect; the write queued
/// behind it is withheld. The body's end is the answer (`TransactionEnded`,
/// committed: the write it asked for never ran); the record, committed with
/// the effect, is what a repeat finds. (The call then went on to hold the
/// key as outcome unknown, found the record and logged an error that
/// another request of its key had run.)
#[tokio::test(flavor = "current_thread")]
async fn a_record_that_rode_before_a_withheld_write_is_not_held_again() {
    let env = env(2).await;
    let log = Log::default();
    let _default = tracing::subscriber::set_default(log.subscriber());
    for i in 0..3 {
        let key = format!("rode-withheld-{i}");
        let first = queues_commit_and_a_write(&env.pool, &key).await;
        assert!(
            matches!(
                first,
                Err(AppError::Idem(idem::Error::TransactionEnded {
                    committed: true
                }))
            ),
            "{key}: {first:?}"
        );
        let n2 = "SELECT count(*) FROM effects WHERE tag = $1 AND n = 2";
        let n2: i64 = env.client.query_one(n2, &[&key]).await.unwrap().get(0);
        assert_eq!((env.effects(&key).await, n2), (1, 0), "{key}");
        let rec = env.record(&key).await;
        let state = rec.as_ref().map(|(s, o, _)| (s.as_str(), o.as_deref()));
        assert_eq!(state, Some(("completed", Some("ok"))), "{key}");
        let again = queues_commit_and_a_write(&env.pool, &key).await;
        assert!(matches!(&again, Ok(v) if v.replayed), "{key}: {again:?}");
        assert_eq!(env.effects(&key).await, 1, "{key}: replayed, not run");
    }
    let errors = log.lines("", " ERROR ");
    assert!(errors.is_empty(), "{errors:?}");
    let holds = log.lines("rode-withheld-", "outcome unknown");
    assert!(holds.is_empty(), "{holds:?}");
}

/// The body sends its `COMMIT` (in a text with another statement, so that
/// nothing of idem's rides on it) behind a deferred check of 4.5 s, and
/// returns 2 s later, the `COMMIT` still running. It is given
/// `commit_timeout_ms` (3 s) from its send, not from the return (which
/// would let the check finish at 4.5 s and commit): cancelled at 3 s,
/// nothing committed, answered `TransactionEnded { committed: false }`
/// well before 4.5 s, the key free (held in external mode, where the body
/// may have called out). In every call shape, whether the body returns
/// `Ok` or an error. Before, every shape waited 3 s from the return
/// (`Tx::settle`, or idem's `ROLLBACK` queued behind), so the check ended
/// at 4.5 s and committed: answered truly, but past the bound the seal
/// keeps for the same `COMMIT` (6 of 6 cases on a5750be).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_in_flight_at_the_return_is_bounded_from_its_send() {
    use super::kit::*;
    let env = env_slow(2).await;
    if env.db.via().is_transaction_pooling() {
        return; // no cancel behind a transaction pooler (documented)
    }
    let steps: &'static [A] = &[
        W("INSERT INTO slowc VALUES ('{k}', 4500, false)"),
        Q("SELECT 1; COMMIT"),
        Ms(2000),
    ];
    let mut bad = Vec::new();
    for v in [V::Rc, V::Ext, V::Plain] {
        for end in [OK, PLAIN] {
            let key = format!("from-send-{v:?}-{end}");
            let s = probe(&env, &env.pool, v, &key, (steps, end), TEN, 0).await;
            let what = format!(
                "{key}: {} in {:?}, n {:?}, rec {:?}",
                s.ans, s.took, s.ns, s.rec
            );
            if s.took > Duration::from_millis(4000) {
                bad.push(format!("{what}: not cancelled at the bound from its send"));
            }
            if !s.ans.contains("committed: false") || s.ns != (0, 0, 0) {
                bad.push(format!("{what}: expected nothing committed"));
            }
            let held = s.rec.as_deref() == Some("unknown");
            if held != (v == V::Ext) || v == V::Rc && s.rec.is_some() {
                bad.push(format!("{what}: held only in external mode"));
            }
        }
    }
    bad.extend(hygiene(&env, &env.pool, "from-send").await);
    verdict(&bad);
}
