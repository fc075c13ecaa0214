//! Hostile pass (helper, session 52) on 3f1c580: an external call that ends
//! before its body ran releases its claim by claiming again (waiting on the
//! key's unique index for the claim's own transaction) and deleting by its
//! token. Attacked with a duplicate arriving in between, `max` 2 and 3, a
//! tiny deadline, an expired record of the key, a claim `COMMIT` that
//! outlasts the release's bound, and a release whose own `COMMIT` is slow.
//! Outside calls counted by the body itself, effects and records in the
//! database.
use super::*;

/// Every outside call made, by key (the body's first act).
static OUTSIDE: Mutex<Vec<String>> = Mutex::new(Vec::new());

fn outside(key: &str) -> usize {
    OUTSIDE.lock().unwrap().iter().filter(|k| *k == key).count()
}

/// The outside call, then its local record (phase 3).
async fn send(db: &mut Deferred<'_>, key: &str) -> Result<String, AppError> {
    OUTSIDE.lock().unwrap().push(key.to_owned());
    let conn = db.conn().await?;
    insert_effect(conn, &format!("out:{key}"), 1).await?;
    Ok(format!("receipt:{key}"))
}

#[idempotent(key = key, operation = "a52.send", mode = external, scope = none)]
#[retryable(max = 1, deadline_ms = 30000, commit_timeout_ms = 50)]
async fn once_50(db: &mut Deferred<'_>, key: &str) -> Result<String, AppError> {
    send(db, key).await
}

#[idempotent(key = key, operation = "a52.send", mode = external, scope = none)]
#[retryable(max = 2, deadline_ms = 30000, commit_timeout_ms = 50)]
async fn twice_50(db: &mut Deferred<'_>, key: &str) -> Result<String, AppError> {
    send(db, key).await
}

#[idempotent(key = key, operation = "a52.send", mode = external, scope = none)]
#[retryable(max = 3, deadline_ms = 30000, commit_timeout_ms = 50)]
async fn thrice_50(db: &mut Deferred<'_>, key: &str) -> Result<String, AppError> {
    send(db, key).await
}

#[idempotent(key = key, operation = "a52.send", mode = external, scope = none)]
#[retryable(max = 3, deadline_ms = 5, commit_timeout_ms = 50)]
async fn in_5ms(db: &mut Deferred<'_>, key: &str) -> Result<String, AppError> {
    send(db, key).await
}

/// A duplicate that waits for the first request, with time to spare.
#[idempotent(key = key, operation = "a52.send", mode = external, wait_ms = 8000, scope = none)]
#[retryable(max = 6, deadline_ms = 30000, commit_timeout_ms = 8000)]
async fn patient(db: &mut Deferred<'_>, key: &str) -> Result<String, AppError> {
    send(db, key).await
}

/// A deferred trigger on `idem_requests` for `key`, on `event`, running
/// `body` (plpgsql) at the claim's (or release's) `COMMIT`.
async fn slow_on(env: &Env, name: &str, event: &str, key: &str, body: &str) {
    let row = if event == "DELETE" { "OLD" } else { "NEW" };
    let sql = format!(
        "CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$
           BEGIN {body} RETURN NULL; END $$;
         CREATE CONSTRAINT TRIGGER {name} AFTER {event} ON idem_requests
           DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
           WHEN ({row}.key = '{key}') EXECUTE FUNCTION {name}()"
    );
    env.client.batch_execute(&sql).await.unwrap();
}

async fn unslow(env: &Env, name: &str) {
    let sql = format!("DROP TRIGGER {name} ON idem_requests");
    env.client.batch_execute(&sql).await.unwrap();
}

/// After a call that ended with no outside call made: the key must end
/// free (no record, or an expired completed one), within `within`.
async fn ends_free(env: &Env, key: &str, within: Duration) -> Result<(), String> {
    let free = || async {
        let live = env
            .client
            .query_one(
                "SELECT count(*) FROM idem_requests WHERE key = $1 \
                 AND NOT (state = 'completed' AND expires_at <= now())",
                &[&key],
            )
            .await
            .unwrap();
        live.get::<_, i64>(0) == 0
    };
    if eventually(within, free).await {
        Ok(())
    } else {
        Err(format!("{key} still held: {:?}", env.record(key).await))
    }
}

/// What must hold of `key` after `result`: at most one outside call; one
/// made is recorded with its effect; none made leaves the key free.
async fn judged(env: &Env, key: &str, result: &Result<Idempotent<String>, AppError>) {
    let made = outside(key);
    assert!(made <= 1, "{key}: the outside call ran {made} times");
    match result {
        Ok(_) => {
            assert_eq!(
                made, 1,
                "{key}: answered fresh or replayed with no outside call"
            );
            assert_eq!(env.effects(&format!("out:{key}")).await, 1, "{key}");
            assert_eq!(env.state(key).await.as_deref(), Some("completed"), "{key}");
        }
        Err(_) if made == 0 => ends_free(env, key, Duration::from_secs(10)).await.unwrap(),
        Err(e) => panic!("{key}: the outside call ran, and the call failed: {e:?}"),
    }
}

use idem::Idempotent;

/// A duplicate arriving while the first request's claim `COMMIT` is slow
/// (unanswered within its 50 ms, so it ends before its body ran and
/// releases): the outside call runs once, by the duplicate, and a third
/// request replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack52_a_duplicate_during_a_released_claim_runs_the_outside_call_once() {
    let env = env(4).await;
    let key = "a52-dup";
    slow_on(&env, "a52_dup", "INSERT", key, "PERFORM pg_sleep(0.3);").await;
    let pool = env.pool.clone();
    let first = tokio::spawn(async move { once_50(&pool, key).await });
    tokio::time::sleep(Duration::from_millis(20)).await;
    let second = patient(&env.pool, key).await;
    let first = first.await.unwrap();
    assert!(matches_idem(&first, "Exhausted"), "{first:?}");
    let second = second.expect("the duplicate runs once the claim is released");
    assert!(!second.replayed);
    judged(&env, key, &Ok(second)).await;
    let third = patient(&env.pool, key).await.unwrap();
    assert!(third.replayed);
    assert_eq!(outside(key), 1);
    assert_eq!(env.effects(&format!("out:{key}")).await, 1);
}

/// `max` 2 and 3 against a claim `COMMIT` of 300 ms and a
/// `commit_timeout_ms` of 50: a later attempt re-claims (behind a pooler it
/// finds its own claim, committed late, and may run the body); whatever the
/// answer, one outside call at most, recorded if made, else the key free;
/// a retry then completes the key with one outside call in all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack52_max_two_and_three_reclaim_and_settle() {
    let env = env(4).await;
    for (key, n) in [("a52-m2", 2), ("a52-m3", 3)] {
        let name = key.replace('-', "_");
        slow_on(&env, &name, "INSERT", key, "PERFORM pg_sleep(0.3);").await;
        let result = if n == 2 {
            twice_50(&env.pool, key).await
        } else {
            thrice_50(&env.pool, key).await
        };
        judged(&env, key, &result).await;
        unslow(&env, &name).await;
        let again = patient(&env.pool, key).await.unwrap();
        assert_eq!(again.replayed, result.is_ok(), "{key}: {result:?}");
        assert_eq!(outside(key), 1, "{key}");
        assert_eq!(env.effects(&format!("out:{key}")).await, 1, "{key}");
    }
}

/// A 5 ms deadline against a 300 ms claim `COMMIT`, eight keys: no call
/// makes its outside call, and every key ends free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack52_a_tiny_deadline_leaves_every_key_free() {
    let env = env(4).await;
    let body = "IF NEW.key LIKE 'a52-tiny-%' THEN PERFORM pg_sleep(0.3); END IF;";
    let sql = format!(
        "CREATE FUNCTION a52_tiny() RETURNS trigger LANGUAGE plpgsql AS $$
           BEGIN {body} RETURN NULL; END $$;
         CREATE CONSTRAINT TRIGGER a52_tiny AFTER INSERT ON idem_requests
           DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION a52_tiny()"
    );
    env.client.batch_execute(&sql).await.unwrap();
    for i in 0..8 {
        let key = format!("a52-tiny-{i}");
        let result = in_5ms(&env.pool, &key).await;
        judged(&env, &key, &result).await;
    }
}

/// An expired record of the key (an earlier request's): the call takes it
/// over, its claim `COMMIT` goes unanswered, it ends with no outside call,
/// and the key is free (the old record gone or still expired): a new
/// request runs its outside call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack52_an_expired_record_taken_over_and_released_leaves_the_key_free() {
    let env = env(4).await;
    let key = "a52-exp";
    patient(&env.pool, key).await.unwrap();
    let expire =
        "UPDATE idem_requests SET expires_at = now() - interval '1 s' WHERE key = 'a52-exp'";
    env.client.batch_execute(expire).await.unwrap();
    slow_on(
        &env,
        "a52_exp",
        "INSERT OR UPDATE",
        key,
        "PERFORM pg_sleep(0.3);",
    )
    .await;
    let result = once_50(&env.pool, key).await;
    assert!(matches_idem(&result, "Exhausted"), "{result:?}");
    assert_eq!(outside(key), 1, "no second outside call");
    ends_free(&env, key, Duration::from_secs(10)).await.unwrap();
    unslow(&env, "a52_exp").await;
    let again = patient(&env.pool, key).await.unwrap();
    assert!(!again.replayed);
    assert_eq!(outside(key), 2);
    assert_eq!(env.effects(&format!("out:{key}")).await, 2);
}

/// A claim `COMMIT` that goes on past its cancel (a deferred check that
/// ignores it: a stand-in for a `COMMIT` whose WAL flush stalls, which no
/// cancel stops) and ends 2 s later, past the release's bound
/// (`max(commit_timeout_ms, 1 s)`): the claim commits after the release
/// gave up. No body ran; the key must end free, not in progress (then
/// outcome unknown, for an operator).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_a_claim_commit_outlasting_the_release_bound_leaves_the_key_held() {
    let env = env(4).await;
    let key = "a52-late";
    let stubborn = "BEGIN PERFORM pg_sleep(2); \
                    EXCEPTION WHEN query_canceled THEN PERFORM pg_sleep(2); END;";
    slow_on(&env, "a52_late", "INSERT", key, stubborn).await;
    let result = once_50(&env.pool, key).await;
    assert!(matches_idem(&result, "Exhausted"), "{result:?}");
    assert_eq!(outside(key), 0, "the body never ran");
    unslow(&env, "a52_late").await;
    ends_free(&env, key, Duration::from_secs(12)).await.unwrap();
    let again = patient(&env.pool, key).await.unwrap();
    assert!(!again.replayed);
    assert_eq!(outside(key), 1);
}

/// The release's own `COMMIT` slow past its bound (a deferred check on the
/// delete, 1.5 s, which its cancel stops: the release rolls back), after a
/// claim `COMMIT` unanswered in 50 ms that commits at 0.3 s all the same
/// (its deferred check ignores the cancel): no body ran, and the key must
/// end free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_a_release_whose_commit_outlasts_its_bound_leaves_the_key_held() {
    let env = env(4).await;
    let key = "a52-relslow";
    let late = "BEGIN PERFORM pg_sleep(0.3); \
                EXCEPTION WHEN query_canceled THEN PERFORM pg_sleep(0.3); END;";
    slow_on(&env, "a52_rel_ins", "INSERT", key, late).await;
    slow_on(&env, "a52_rel_del", "DELETE", key, "PERFORM pg_sleep(3);").await;
    let result = once_50(&env.pool, key).await;
    assert!(matches_idem(&result, "Exhausted"), "{result:?}");
    assert_eq!(outside(key), 0, "the body never ran");
    ends_free(&env, key, Duration::from_secs(15)).await.unwrap();
    unslow(&env, "a52_rel_ins").await;
    unslow(&env, "a52_rel_del").await;
    let again = patient(&env.pool, key).await.unwrap();
    assert!(!again.replayed);
    assert_eq!(outside(key), 1);
}

/// A caller that gives up (drops the call) while the claim's `COMMIT` is
/// slow, before the body ran: the claim commits all the same (its deferred
/// check ignores the cancel; behind a pooler none is sent). No body ran;
/// the key must end free, and a retry runs the outside call once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_an_external_call_dropped_before_its_body_leaves_the_key_held() {
    let env = env(4).await;
    let key = "a52-dropped";
    let stubborn = "BEGIN PERFORM pg_sleep(0.5); \
                    EXCEPTION WHEN query_canceled THEN PERFORM pg_sleep(0.5); END;";
    slow_on(&env, "a52_dropped", "INSERT", key, stubborn).await;
    let gave_up = tokio::time::timeout(Duration::from_millis(150), patient(&env.pool, key)).await;
    assert!(gave_up.is_err(), "{gave_up:?}");
    assert_eq!(outside(key), 0, "the body never ran");
    unslow(&env, "a52_dropped").await;
    ends_free(&env, key, Duration::from_secs(10)).await.unwrap();
    let again = patient(&env.pool, key).await.unwrap();
    assert!(!again.replayed);
    assert_eq!(outside(key), 1);
    assert_eq!(env.effects(&format!("out:{key}")).await, 1);
}
