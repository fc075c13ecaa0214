//! External mode: claims commit first, duplicates wait or are told, unknown outcomes until settled.

use super::*;

// ---------------------------------------------------------------------------
// External mode
// ---------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct SendCmd {
    key: String,
    target: String,
    amount: i64,
}

fn send_cmd(key: &str, amount: i64) -> SendCmd {
    SendCmd {
        key: key.to_owned(),
        target: "psp".to_owned(),
        amount,
    }
}

/// An outside system the body calls: it can be held mid-call.
struct Target {
    script: Script,
    /// A permit per body that reached the call.
    started: Semaphore,
    /// While set, a body waits for a permit of `release` before answering.
    hold: std::sync::atomic::AtomicBool,
    release: Semaphore,
}

impl Default for Target {
    fn default() -> Target {
        Target {
            script: Script::default(),
            started: Semaphore::new(0),
            hold: Default::default(),
            release: Semaphore::new(0),
        }
    }
}

impl Target {
    fn held() -> Target {
        let target = Target::default();
        target.hold.store(true, Ordering::SeqCst);
        target
    }

    /// The outside call (held while `hold` is set), then the local writes
    /// that commit with the outcome.
    async fn call(&self, db: &mut Deferred<'_>, cmd: &SendCmd) -> Result<String, AppError> {
        assert!(!db.is_open(), "nothing is open while the outside call runs");
        self.started.add_permits(1);
        if std::sync::atomic::AtomicBool::load(&self.hold, Ordering::SeqCst) {
            self.release.acquire().await.unwrap().forget();
        }
        let conn = db.conn().await?;
        insert_effect(conn, &format!("sent:{}", cmd.key), cmd.amount).await?;
        self.script.run(conn).await?;
        Ok(format!(
            "receipt:{}",
            current_key().expect("the body runs under its key")
        ))
    }

    async fn wait_started(&self) {
        tokio::time::timeout(Duration::from_secs(20), self.started.acquire())
            .await
            .expect("the body started")
            .unwrap()
            .forget();
    }
}

#[idempotent(key = cmd.key, operation = "ext.send", fingerprint(cmd.target, cmd.amount), mode = external, scope = none)]
#[retryable(max = 3, deadline_ms = 30000)]
async fn send(db: &mut Deferred<'_>, cmd: &SendCmd, target: &Target) -> Result<String, AppError> {
    target.call(db, cmd).await
}

/// The same operation; a duplicate waits for the first request's outcome.
#[idempotent(key = cmd.key, operation = "ext.send", fingerprint(cmd.target, cmd.amount), mode = external, wait_ms = 20000, scope = none)]
async fn send_waiting(
    db: &mut Deferred<'_>,
    cmd: &SendCmd,
    target: &Target,
) -> Result<String, AppError> {
    target.call(db, cmd).await
}

/// The same operation with a lease shorter than the call.
#[idempotent(key = cmd.key, operation = "ext.send", fingerprint(cmd.target, cmd.amount), mode = external, lease_ms = 300, scope = none)]
async fn send_leased(
    db: &mut Deferred<'_>,
    cmd: &SendCmd,
    target: &Target,
) -> Result<String, AppError> {
    target.call(db, cmd).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn external_claims_commit_before_the_body_and_duplicates_wait_or_are_told() {
    let env = Arc::new(env(6).await);
    let target = Arc::new(Target::held());
    let first = {
        let (env, target) = (env.clone(), target.clone());
        tokio::spawn(async move { send(&env.pool, &send_cmd("x-1", 30), &target).await })
    };
    target.wait_started().await;
    // Phase 2: while the outside call runs, no transaction is open and every
    // pooled connection is back in the pool.
    let status = env.pool.status();
    assert_eq!(
        status.available, status.size,
        "the pool has its connections back during the outside call: {status:?}"
    );
    let open = env
        .scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND xact_start IS NOT NULL AND pid <> pg_backend_pid()",
        )
        .await;
    assert_eq!(open, 0, "no transaction is open during the outside call");
    // The claim is committed while the body runs: another connection sees it.
    let row = env
        .client
        .query_one(
            "SELECT state::text, mode::text, lease_until > now() FROM idem_requests WHERE key = 'x-1'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        (
            row.get::<_, String>(0),
            row.get::<_, String>(1),
            row.get::<_, bool>(2)
        ),
        ("in_progress".to_owned(), "external".to_owned(), true)
    );
    // A duplicate is told at once.
    let result = send(&env.pool, &send_cmd("x-1", 30), &target).await;
    match &result {
        Err(AppError::Idem(e @ idem::Error::InProgress)) => assert_eq!(e.http_status(), 409),
        other => panic!("expected in progress, got {other:?}"),
    }
    // A different request under the key is refused even while it runs.
    let result = send(&env.pool, &send_cmd("x-1", 31), &target).await;
    assert!(matches_idem(&result, "FingerprintMismatch"), "{result:?}");
    // A duplicate that may wait gets the first request's result.
    let waiting = {
        let (env, target) = (env.clone(), target.clone());
        tokio::spawn(async move { send_waiting(&env.pool, &send_cmd("x-1", 30), &target).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiting.is_finished(),
        "the duplicate waits while the first runs"
    );
    target.release.add_permits(1);
    let first = first.await.unwrap().unwrap();
    assert!(!first.replayed);
    assert_eq!(first.value, "receipt:x-1", "the body read its key");
    let waited = waiting.await.unwrap().unwrap();
    assert!(waited.replayed);
    assert_eq!(waited.value, first.value);
    assert_eq!(
        target.script.calls(),
        1,
        "the outside system was called once"
    );
    assert_eq!(env.effects("sent:x-1").await, 1);
    let (state, outcome, response) = env.record("x-1").await.unwrap();
    assert_eq!(
        (state.as_str(), outcome.as_deref(), response.as_deref()),
        ("completed", Some("ok"), Some("\"receipt:x-1\""))
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM idem_requests WHERE lease_until IS NOT NULL")
            .await,
        0
    );
    assert_eq!(
        *target.script.keys.lock().unwrap(),
        [Some("x-1".to_owned())],
        "current_key() in the body"
    );
    assert_eq!(current_key(), None, "outside a body there is no key");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_external_duplicates_call_the_target_once() {
    let env = Arc::new(env(10).await);
    let target = Arc::new(Target::held());
    let barrier = Arc::new(Barrier::new(20));
    let tasks: Vec<_> = (0..20)
        .map(|_| {
            let (env, target, barrier) = (env.clone(), target.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                send_waiting(&env.pool, &send_cmd("x-crowd", 5), &target).await
            })
        })
        .collect();
    target.wait_started().await;
    // Let the others find the claim while the call is out.
    tokio::time::sleep(Duration::from_millis(200)).await;
    target.release.add_permits(1);
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(
            task.await
                .unwrap()
                .expect("every duplicate gets the answer"),
        );
    }
    assert_eq!(answers.iter().filter(|a| !a.replayed).count(), 1);
    assert!(answers.iter().all(|a| a.value == "receipt:x-crowd"));
    assert_eq!(target.script.calls(), 1, "the target was called once");
    assert_eq!(
        target.started.available_permits(),
        0,
        "no second call started"
    );
    assert_eq!(env.effects("sent:x-crowd").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn external_failures_release_or_keep_the_key_until_settled() {
    let env = env(4).await;
    let target = Target::default();

    // Nothing was sent: the key is released and a retry runs.
    target.script.push(Step::Invalid);
    let result = send(&env.pool, &send_cmd("x-released", 1), &target).await;
    assert!(matches!(result, Err(AppError::Invalid)), "{result:?}");
    assert_eq!(env.record("x-released").await, None);
    let retried = send(&env.pool, &send_cmd("x-released", 1), &target)
        .await
        .unwrap();
    assert!(!retried.replayed);
    assert_eq!(target.script.calls(), 2);

    // The outcome is unknown: the key is kept, and nobody runs it again.
    target.script.push(Step::Timeout);
    let result = send(&env.pool, &send_cmd("x-unknown", 2), &target).await;
    assert!(matches!(result, Err(AppError::Timeout)), "{result:?}");
    assert_eq!(target.script.calls(), 3);
    assert_eq!(env.state("x-unknown").await.as_deref(), Some("unknown"));
    for _ in 0..3 {
        let result = send(&env.pool, &send_cmd("x-unknown", 2), &target).await;
        match &result {
            Err(AppError::Idem(e @ idem::Error::OutcomeUnknown)) => assert_eq!(
                e.to_string(),
                "the first request with this key may have taken effect and its outcome is not known \
                 here; not run again until the key is settled"
            ),
            other => panic!("expected outcome unknown, got {other:?}"),
        }
    }
    assert_eq!(
        OUTCOME_UNKNOWN_MESSAGE,
        "the first request with this key may have taken effect and its outcome is not known \
                 here; not run again until the key is settled"
    );
    assert_eq!(target.script.calls(), 3, "never re-run");
    // The body's own writes of the failed attempt were rolled back.
    assert_eq!(env.effects("sent:x-unknown").await, 0);

    // Reconciled as done: later callers get the settled response.
    let settled = settle(
        &env.pool,
        &(),
        "x-unknown",
        Settlement::Completed(serde_json::json!("receipt:from-the-psp")),
    )
    .await
    .unwrap();
    assert!(settled);
    let replay = send(&env.pool, &send_cmd("x-unknown", 2), &target)
        .await
        .unwrap();
    assert!(replay.replayed);
    assert_eq!(replay.value, "receipt:from-the-psp");
    assert_eq!(target.script.calls(), 3);
    // A completed record is not settled again.
    assert!(!settle(&env.pool, &(), "x-unknown", Settlement::Released)
        .await
        .unwrap());

    // Reconciled as not done: the key is released and a retry runs.
    target.script.push(Step::Timeout);
    let result = send(&env.pool, &send_cmd("x-lost", 3), &target).await;
    assert!(matches!(result, Err(AppError::Timeout)), "{result:?}");
    assert!(matches_idem(
        &send(&env.pool, &send_cmd("x-lost", 3), &target).await,
        "OutcomeUnknown"
    ));
    assert!(settle(&env.pool, &(), "x-lost", Settlement::Released)
        .await
        .unwrap());
    let rerun = send(&env.pool, &send_cmd("x-lost", 3), &target)
        .await
        .unwrap();
    assert!(!rerun.replayed);
    assert_eq!(rerun.value, "receipt:x-lost");
    assert_eq!(target.script.calls(), 5);

    // A final error is stored and replayed, as in local mode.
    target.script.push(Step::Declined);
    for _ in 0..2 {
        let result = send(&env.pool, &send_cmd("x-declined", 4), &target).await;
        assert!(matches!(result, Err(AppError::Declined(_))), "{result:?}");
    }
    assert_eq!(target.script.calls(), 6);
    let (state, outcome, _) = env.record("x-declined").await.unwrap();
    assert_eq!(
        (state.as_str(), outcome.as_deref()),
        ("completed", Some("error"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_expired_lease_is_outcome_unknown_never_a_rerun() {
    let env = Arc::new(env(6).await);
    let target = Arc::new(Target::held());
    let first = {
        let (env, target) = (env.clone(), target.clone());
        tokio::spawn(async move { send_leased(&env.pool, &send_cmd("x-lease", 9), &target).await })
    };
    target.wait_started().await;
    // Once the lease ran out the outcome is unknown: the body may still be
    // talking to the target.
    let until = Instant::now() + Duration::from_secs(20);
    while env
        .scalar("SELECT count(*) FROM idem_requests WHERE key = 'x-lease' AND lease_until < now()")
        .await
        == 0
    {
        assert!(Instant::now() < until, "the lease never ran out");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for duplicate in 0..3 {
        let result = match duplicate {
            0 => send(&env.pool, &send_cmd("x-lease", 9), &target).await,
            1 => send_leased(&env.pool, &send_cmd("x-lease", 9), &target).await,
            // Even one that may wait is told at once.
            _ => send_waiting(&env.pool, &send_cmd("x-lease", 9), &target).await,
        };
        assert!(matches_idem(&result, "OutcomeUnknown"), "{result:?}");
    }
    assert_eq!(target.script.calls(), 0, "the first body has not answered");
    assert_eq!(
        target.started.available_permits(),
        0,
        "no second body started"
    );
    // The purge records it as unknown; it does not drop it.
    let mut conn = AsyncPgConnection::establish(env.db.url()).await.unwrap();
    let report = purge_expired(&mut conn, 10).await.unwrap();
    assert_eq!(
        (report.deleted, report.marked_unknown, report.unknown),
        (0, 1, 1)
    );
    assert_eq!(env.state("x-lease").await.as_deref(), Some("unknown"));
    let result = send(&env.pool, &send_cmd("x-lease", 9), &target).await;
    assert!(matches_idem(&result, "OutcomeUnknown"), "{result:?}");
    // When the first request does learn its outcome, it is recorded.
    target.release.add_permits(1);
    let first = first.await.unwrap().unwrap();
    assert!(!first.replayed);
    let replay = send(&env.pool, &send_cmd("x-lease", 9), &target)
        .await
        .unwrap();
    assert!(replay.replayed);
    assert_eq!(replay.value, first.value);
    assert_eq!(target.script.calls(), 1);
    assert_eq!(env.effects("sent:x-lease").await, 1);
}

/// Phase 3's transaction left with a savepoint open: its `COMMIT` would be a
/// `RELEASE SAVEPOINT`. Nothing of it commits, the call says why, and the
/// key stays held, as after any phase 3 that did not commit (the outside
/// call may have happened).
#[idempotent(key = cmd.key, operation = "ext.send", fingerprint(cmd.target, cmd.amount), mode = external, scope = none)]
#[retryable(max = 3, deadline_ms = 30000)]
async fn send_leaving_a_savepoint(
    db: &mut Deferred<'_>,
    cmd: &SendCmd,
) -> Result<String, AppError> {
    let conn = db.conn().await?;
    insert_effect(conn, &format!("sent:{}", cmd.key), cmd.amount).await?;
    <diesel_async::AnsiTransactionManager as diesel_async::TransactionManager<_>>::begin_transaction(conn).await?;
    Ok("receipt".to_owned())
}

#[tokio::test]
async fn external_phase_3_with_a_savepoint_open_commits_nothing_and_holds_the_key() {
    let env = env(2).await;
    let result = send_leaving_a_savepoint(&env.pool, &send_cmd("x-savepoint", 5)).await;
    assert!(matches_idem(&result, "SavepointOpen"), "{result:?}");
    assert_eq!(env.effects("sent:x-savepoint").await, 0);
    // Held as an outcome nobody knows, until an operator settles it.
    assert_eq!(env.state("x-savepoint").await.as_deref(), Some("unknown"));
    let again = send_leaving_a_savepoint(&env.pool, &send_cmd("x-savepoint", 5)).await;
    assert!(matches_idem(&again, "OutcomeUnknown"), "{again:?}");
    assert_eq!(env.effects("sent:x-savepoint").await, 0);
}

/// One attempt, and a `commit_timeout_ms` the claim's `COMMIT` outlasts.
#[idempotent(key = cmd.key, operation = "ext.send", fingerprint(cmd.target, cmd.amount), mode = external, scope = none)]
#[retryable(max = 1, deadline_ms = 30000, commit_timeout_ms = 50)]
async fn send_once_in_50ms(
    db: &mut Deferred<'_>,
    cmd: &SendCmd,
    target: &Target,
) -> Result<String, AppError> {
    target.call(db, cmd).await
}

/// The claim's `COMMIT` unanswered within `commit_timeout_ms` (a 300 ms
/// deferred check on the record, against 50): the one attempt is spent on
/// the claim, the call ends `Exhausted` before its body runs, and the claim
/// is released, not held as outcome unknown: nothing was sent. A retry runs
/// the body once. (CI's session-51 run met this at 1 ms under load.)
/// Found behind PgBouncer, which gets no cancel: the claim committed after
/// its release, and the retry was answered `InProgress` (the key then
/// outcome unknown) with no body ever run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_external_claim_unanswered_in_time_is_released_with_no_body_run() {
    let env = env(2).await;
    let slow = "CREATE FUNCTION slow_claim() RETURNS trigger LANGUAGE plpgsql AS $$
          BEGIN PERFORM pg_sleep(0.3); RETURN NULL; END $$;
        CREATE CONSTRAINT TRIGGER slow_claim AFTER INSERT ON idem_requests
          DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (NEW.key = 'x-slow-claim')
          EXECUTE FUNCTION slow_claim()";
    env.client.batch_execute(slow).await.unwrap();
    let target = Target::default();
    let cmd = send_cmd("x-slow-claim", 1);
    let result = send_once_in_50ms(&env.pool, &cmd, &target).await;
    assert!(
        matches!(
            result,
            Err(AppError::Idem(idem::Error::Exhausted { attempts: 1, .. }))
        ),
        "{result:?}"
    );
    assert_eq!(target.started.available_permits(), 0, "the body never ran");
    let free = || async { env.record("x-slow-claim").await.is_none() };
    assert!(
        eventually(Duration::from_secs(10), free).await,
        "the claim is released"
    );
    env.client
        .batch_execute("DROP TRIGGER slow_claim ON idem_requests")
        .await
        .unwrap();
    let again = send_once_in_50ms(&env.pool, &cmd, &target).await.unwrap();
    assert!(!again.replayed);
    assert_eq!(env.effects("sent:x-slow-claim").await, 1);
    assert_eq!(target.started.available_permits(), 1);
}
