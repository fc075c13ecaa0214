//! Local mode, a body that ends idem's transaction itself: its record rides
//! on idem's own `COMMIT`, which never runs. After a `COMMIT` of the body's
//! (answered `TransactionEnded { committed: true }`) the key is held as
//! outcome unknown, as external mode holds it, so a repeat never runs the
//! body again; after a `ROLLBACK` of its own nothing committed and the key
//! stays free. Effects and records are counted on a side connection.

use super::*;

/// What the body does after its effect, on its first run only.
#[derive(Clone, Copy, Debug)]
enum Then {
    /// `COMMIT` by hand, then return `Ok`.
    CommitOk,
    /// `COMMIT` by hand, then return an error that is not final.
    CommitErr,
    /// `COMMIT` by hand, then return a final error (a decline).
    CommitDecline,
    /// `ROLLBACK` by hand, then return `Ok`.
    RollbackOk,
}

#[idempotent(key = key, fingerprint(key), scope = none)]
#[retryable(max = 3, deadline_ms = 8000)]
async fn local_hand_end(
    conn: &mut AsyncPgConnection,
    key: &str,
    then: Then,
    runs: &AtomicU32,
) -> Result<i64, AppError> {
    let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
    insert_effect(conn, key, i64::from(run)).await?;
    if run > 1 {
        return Ok(i64::from(run));
    }
    match then {
        Then::CommitOk | Then::CommitErr | Then::CommitDecline => {
            conn.batch_execute("COMMIT").await?
        }
        Then::RollbackOk => conn.batch_execute("ROLLBACK").await?,
    }
    match then {
        Then::CommitErr => Err(AppError::Timeout),
        Then::CommitDecline => Err(AppError::Declined(Declined::InsufficientFunds {
            needed: 1,
        })),
        Then::CommitOk | Then::RollbackOk => Ok(i64::from(run)),
    }
}

fn ended(result: &Result<impl std::fmt::Debug, AppError>, committed: bool) -> bool {
    matches!(
        result,
        Err(AppError::Idem(idem::Error::TransactionEnded { committed: c })) if *c == committed
    )
}

/// Each way a body can end with its own `COMMIT`: one effect, the record
/// held as `unknown` (never a stored decline), and a repeat answered
/// `OutcomeUnknown` without running the body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_commit_holds_the_key_as_outcome_unknown() {
    let env = env(2).await;
    for (key, then) in [
        ("hand-commit-ok", Then::CommitOk),
        ("hand-commit-err", Then::CommitErr),
        ("hand-commit-decline", Then::CommitDecline),
    ] {
        let runs = AtomicU32::new(0);
        let first = local_hand_end(&env.pool, key, then, &runs).await;
        assert!(ended(&first, true), "{then:?}: {first:?}");
        assert_eq!(
            env.effects(key).await,
            1,
            "{then:?}: the hand COMMIT committed"
        );
        assert_eq!(
            env.record(key).await,
            Some(("unknown".to_owned(), None, None)),
            "{then:?}"
        );
        let repeat = local_hand_end(&env.pool, key, then, &runs).await;
        assert!(
            matches_idem(&repeat, "OutcomeUnknown"),
            "{then:?}: {repeat:?}"
        );
        assert_eq!(calls(&runs), 1, "{then:?}: a repeat never runs the body");
        assert_eq!(env.effects(key).await, 1, "{then:?}");
        // A different request under the key learns nothing of it.
        let other = other_request(&env.pool, key, 1).await;
        assert!(
            matches_idem(&other, "FingerprintMismatch"),
            "{then:?}: {other:?}"
        );
    }
}

/// The same key with another fingerprint.
#[idempotent(key = key, fingerprint(key, n), scope = none)]
#[retryable(max = 3, deadline_ms = 8000)]
async fn other_request(conn: &mut AsyncPgConnection, key: &str, n: i64) -> Result<i64, AppError> {
    insert_effect(conn, "other", n).await
}

/// A body's own `ROLLBACK` committed nothing: the key stays free, and a
/// repeat runs the body and records it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_rollback_leaves_the_key_free() {
    let env = env(2).await;
    let runs = AtomicU32::new(0);
    let key = "hand-rollback";
    let first = local_hand_end(&env.pool, key, Then::RollbackOk, &runs).await;
    assert!(ended(&first, false), "{first:?}");
    assert_eq!(env.effects(key).await, 0);
    assert_eq!(env.record(key).await, None);
    let repeat = local_hand_end(&env.pool, key, Then::RollbackOk, &runs)
        .await
        .unwrap();
    assert!(!repeat.replayed);
    assert_eq!(repeat.value, 2);
    assert_eq!(env.effects(key).await, 1);
    assert_eq!(env.state(key).await.as_deref(), Some("completed"));
}

/// A held key is settled by an operator as for external mode: released, a
/// repeat runs again; completed, a repeat gets the settled response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_key_is_settled_by_hand() {
    let env = env(2).await;
    let (released, completed) = (AtomicU32::new(0), AtomicU32::new(0));
    for (key, runs) in [("hand-released", &released), ("hand-completed", &completed)] {
        let first = local_hand_end(&env.pool, key, Then::CommitOk, runs).await;
        assert!(ended(&first, true), "{key}: {first:?}");
    }
    assert!(
        settle(&env.pool, &(), "hand-released", Settlement::Released)
            .await
            .unwrap()
    );
    // Its second run commits through idem, with its record.
    let again = local_hand_end(&env.pool, "hand-released", Then::CommitOk, &released)
        .await
        .unwrap();
    assert!(!again.replayed);
    assert_eq!(again.value, 2);
    assert_eq!(
        env.effects("hand-released").await,
        2,
        "settled as not done: ran again"
    );
    assert_eq!(
        env.state("hand-released").await.as_deref(),
        Some("completed")
    );

    assert!(settle(
        &env.pool,
        &(),
        "hand-completed",
        Settlement::Completed(serde_json::json!(41))
    )
    .await
    .unwrap());
    let replay = local_hand_end(&env.pool, "hand-completed", Then::CommitOk, &completed)
        .await
        .unwrap();
    assert!(replay.replayed);
    assert_eq!(replay.value, 41);
    assert_eq!(calls(&completed), 1);
    assert_eq!(env.effects("hand-completed").await, 1);
}

#[idempotent(key = key, fingerprint(key), ttl_s = 1, scope = none)]
#[retryable(max = 3, deadline_ms = 8000)]
async fn short_hand_commit(
    conn: &mut AsyncPgConnection,
    key: &str,
    commit: bool,
) -> Result<i64, AppError> {
    let id = insert_effect(conn, key, 1).await?;
    if commit {
        conn.batch_execute("COMMIT").await?;
    }
    Ok(id)
}

/// A hand `COMMIT` under a key whose completed record expired takes the
/// record over: it is held as unknown, not left to replay nor to run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_commit_takes_over_an_expired_record() {
    let env = env(2).await;
    let key = "hand-expired";
    short_hand_commit(&env.pool, key, false).await.unwrap();
    assert_eq!(env.state(key).await.as_deref(), Some("completed"));
    let until = Instant::now() + Duration::from_secs(20);
    while env
        .scalar(
            "SELECT count(*) FROM idem_requests WHERE key = 'hand-expired' AND expires_at <= now()",
        )
        .await
        == 0
    {
        assert!(Instant::now() < until, "never expired");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let first = short_hand_commit(&env.pool, key, true).await;
    assert!(ended(&first, true), "{first:?}");
    assert_eq!(
        env.record(key).await,
        Some(("unknown".to_owned(), None, None))
    );
    let repeat = short_hand_commit(&env.pool, key, false).await;
    assert!(matches_idem(&repeat, "OutcomeUnknown"), "{repeat:?}");
    assert_eq!(env.effects(key).await, 2);
}

/// A call dropped while [`Call::end`](idem) writes its hold: here through
/// the pool (the body's backend was killed after its `COMMIT`), blocked on
/// `idem_requests` locked by someone else, when the caller gives up. The
/// hold's statement goes with the call, so the drop writes it again from a
/// task of its own, once the table is free. (Before, nothing did: a repeat
/// ran the body again.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_dropped_while_its_key_is_held_is_held_again() {
    use super::attack_hold::commits_at_gate;
    let env = env(2).await;
    let locker = side_connection(env.db.url()).await;
    let key = "dropped-in-hold";
    let runs = Arc::new(AtomicU32::new(0));
    let gate = Arc::new(tokio::sync::Barrier::new(2));
    let call = {
        let (pool, gate, runs) = (env.pool.clone(), gate.clone(), runs.clone());
        tokio::spawn(async move { commits_at_gate(&pool, key, &gate, &runs).await })
    };
    gate.wait().await;
    locker
        .batch_execute(
            "BEGIN; LOCK TABLE idem_requests IN ACCESS EXCLUSIVE MODE; \
             SELECT pg_terminate_backend(n::int) FROM effects WHERE tag = 'dropped-in-hold'",
        )
        .await
        .unwrap();
    gate.wait().await;
    // The hold's INSERT waits on the lock (commit_timeout_ms = 1500).
    let waiting = "SELECT count(*) FROM pg_locks WHERE relation = 'idem_requests'::regclass \
                   AND NOT granted";
    let until = Instant::now() + Duration::from_secs(10);
    while env.scalar(waiting).await == 0 {
        assert!(Instant::now() < until, "the hold never waited on the lock");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());
    locker.batch_execute("ROLLBACK").await.unwrap();
    let until = Instant::now() + Duration::from_secs(10);
    while env.state(key).await.is_none() {
        assert!(Instant::now() < until, "the key was never held");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        env.record(key).await,
        Some(("unknown".to_owned(), None, None))
    );
    let repeat = commits_at_gate(&env.pool, key, &tokio::sync::Barrier::new(1), &runs).await;
    assert!(matches_idem(&repeat, "OutcomeUnknown"), "{repeat:?}");
    assert_eq!((calls(&runs), env.effects(key).await), (1, 1));
}

#[idempotent(key = key, fingerprint(key), scope = none)]
#[retryable(max = 3, deadline_ms = 8000)]
async fn commits_then_read_only(conn: &mut AsyncPgConnection, key: &str) -> Result<i64, AppError> {
    let id = insert_effect(conn, key, 1).await?;
    conn.batch_execute("COMMIT; SET default_transaction_read_only = on")
        .await?;
    Ok(id)
}

/// A hold its own connection refuses (the body committed, then made its
/// session read-only): written through the pool instead, on a connection
/// of its own. (Before, the refusal was only logged: a repeat ran again.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_refused_on_the_calls_connection_goes_through_the_pool() {
    let env = env(2).await;
    // Behind a transaction pooler the body's session setting lands on a
    // server connection every client shares: the pool's next connection
    // may be that one (refused as well), so the case is the direct one.
    if env.db.via().is_transaction_pooling() {
        return;
    }
    let key = "hand-read-only";
    let first = commits_then_read_only(&env.pool, key).await;
    assert!(ended(&first, true), "{first:?}");
    assert_eq!(
        env.record(key).await,
        Some(("unknown".to_owned(), None, None))
    );
    let repeat = commits_then_read_only(&env.pool, key).await;
    assert!(matches_idem(&repeat, "OutcomeUnknown"), "{repeat:?}");
    assert_eq!(env.effects(key).await, 1);
}
