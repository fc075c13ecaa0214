//! `commit_timeout_ms` bounds the wait for COMMIT's answer in every mode:
//! a COMMIT the server holds (a deferred trigger that sleeps 3 s, as a
//! synchronous standby that stopped answering would) is answered
//! `CommitUnknown` (a final error stored alone: the decline itself; an
//! external claim: claimed again) well under a second; and the key then
//! replays or runs once, never twice. Runs
//! direct and through PgBouncer (`IDEM_TEST_VIA=pgbouncer`).

use super::*;

/// The first COMMIT of a transaction that writes a record under a key that
/// starts with `held-` is held 3 s on the server (a sequence, which no
/// rollback takes back, makes it the first only).
const HOLD_FIRST_COMMIT: &str = "
    CREATE SEQUENCE held_commits;
    CREATE FUNCTION hold_commit() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF nextval('held_commits') = 1 THEN PERFORM pg_sleep(3); END IF;
        RETURN NULL;
    END $$;
    CREATE CONSTRAINT TRIGGER hold_commit AFTER INSERT OR UPDATE ON idem_requests
        DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
        WHEN (NEW.key LIKE 'held-%') EXECUTE FUNCTION hold_commit();
";

#[idempotent(key = key, fingerprint(tag), scope = none)]
#[retryable(max = 3, deadline_ms = 10000, commit_timeout_ms = 200)]
async fn local_write(conn: &mut AsyncPgConnection, key: &str, tag: &str) -> Result<i64, AppError> {
    add_effect(conn, tag).await
}

#[idempotent(key = key, fingerprint(tag), scope = none)]
#[retryable(max = 3, deadline_ms = 10000, commit_timeout_ms = 200)]
async fn local_decline(
    conn: &mut AsyncPgConnection,
    key: &str,
    tag: &str,
) -> Result<i64, AppError> {
    add_effect(conn, tag).await?;
    Err(AppError::Declined(Declined::InsufficientFunds {
        needed: 1,
    }))
}

#[idempotent(key = key, fingerprint(tag), mode = external, scope = none)]
#[retryable(max = 3, deadline_ms = 10000, commit_timeout_ms = 200)]
async fn external_write(
    db: &mut Deferred<'_>,
    key: &str,
    tag: &str,
    calls: &AtomicU32,
) -> Result<i64, AppError> {
    calls.fetch_add(1, Ordering::SeqCst);
    add_effect(db.conn().await?, tag).await
}

async fn add_effect(conn: &mut AsyncPgConnection, tag: &str) -> Result<i64, AppError> {
    Ok(
        diesel::sql_query("INSERT INTO effects (tag, n) VALUES ($1, 1) RETURNING id")
            .bind::<Text, _>(tag)
            .get_result::<Id>(conn)
            .await?
            .id,
    )
}

#[derive(QueryableByName)]
struct Id {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

/// How long a call that must find out what a held COMMIT did may take. The
/// COMMIT's answer is bounded by `commit_timeout_ms = 200`; the next attempt
/// then waits for the held transaction's row lock to go. Direct, idem's
/// cancel ends it at once; behind PgBouncer the cancel of a closed client is
/// dropped, and the server ends it when `client_connection_check_interval`
/// (1 s in the harness's PgBouncer) finds its client gone.
fn finding_out(env: &Env) -> Duration {
    if env.db.via().is_transaction_pooling() {
        Duration::from_millis(2500)
    } else {
        Duration::from_secs(1)
    }
}

async fn held_env() -> Env {
    let env = env(4).await;
    env.client.batch_execute(HOLD_FIRST_COMMIT).await.unwrap();
    env
}

/// What the held COMMIT left, once it is over either way: the key replays
/// (it committed) or runs (the cancel rolled it back), and one effect stands.
async fn settles_once(env: &Env, tag: &str, again: Result<idem::Idempotent<i64>, AppError>) {
    let again = again.expect("the key replays or runs");
    let effects = env.effects(tag).await;
    assert_eq!(
        effects, 1,
        "{tag}: one effect, replayed: {}",
        again.replayed
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_local_commit_is_commit_unknown_within_the_commit_timeout() {
    let env = held_env().await;
    let started = Instant::now();
    let result = local_write(&env.pool, "held-local", "local").await;
    let elapsed = started.elapsed();
    assert!(
        matches!(
            result,
            Err(AppError::Idem(idem::Error::CommitUnknown { .. }))
        ),
        "{result:?}"
    );
    assert!(
        // Well under the 3 s hold, with room for a loaded machine.
        elapsed < Duration::from_secs(2),
        "bounded by 200 ms: {elapsed:?}"
    );
    // Past the held COMMIT, whatever it did.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let again = local_write(&env.pool, "held-local", "local").await;
    settles_once(&env, "local", again).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_final_error_store_is_answered_within_the_commit_timeout() {
    let env = held_env().await;
    let started = Instant::now();
    let result = local_decline(&env.pool, "held-decline", "decline").await;
    let elapsed = started.elapsed();
    // Only the record was in the held transaction: the decline is the
    // answer whether it was stored or not.
    assert!(matches!(result, Err(AppError::Declined(_))), "{result:?}");
    assert!(elapsed < finding_out(&env), "{elapsed:?}");
    tokio::time::sleep(Duration::from_secs(4)).await;
    let again = local_decline(&env.pool, "held-decline", "decline").await;
    assert!(matches!(again, Err(AppError::Declined(_))), "{again:?}");
    assert_eq!(env.effects("decline").await, 0, "a decline writes nothing");
    assert_eq!(
        env.state("held-decline").await.as_deref(),
        Some("completed"),
        "the decline is stored, once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_external_claim_commit_is_claimed_again_within_the_commit_timeout() {
    let env = held_env().await;
    let calls = AtomicU32::new(0);
    let started = Instant::now();
    let result = external_write(&env.pool, "held-external", "external", &calls).await;
    let elapsed = started.elapsed();
    // The claim's COMMIT was the one held, and cancelled: the next attempt
    // claims again (it would find this call's own claim, had it committed),
    // then runs the body, once.
    assert!(elapsed < finding_out(&env), "{elapsed:?}");
    let first = result.expect("claimed again, then ran");
    assert!(!first.replayed);
    tokio::time::sleep(Duration::from_secs(4)).await;
    let again = external_write(&env.pool, "held-external", "external", &calls)
        .await
        .expect("a replay");
    assert!(again.replayed);
    assert_eq!(
        AtomicU32::load(&calls, Ordering::SeqCst),
        1,
        "the outside call ran once"
    );
    assert_eq!(env.effects("external").await, 1);
}

/// A local call dropped while idem's own `COMMIT` (its record riding with
/// the body's writes) is held: the record and the body commit or roll back
/// together, so nothing is held as outcome unknown for it. Here the drop's
/// cancel (or, behind PgBouncer, the server's check of the closed client)
/// rolls the held `COMMIT` back: the key is free, and a repeat runs once.
/// Before, the drop held the key `unknown` with no effect behind it, for an
/// operator to settle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_dropped_during_its_own_commit_holds_nothing() {
    let env = held_env().await;
    let call = local_write(&env.pool, "held-dropped", "dropped");
    // Long enough for the body, well before the 200 ms commit timeout.
    let dropped = tokio::time::timeout(Duration::from_millis(120), call).await;
    assert!(dropped.is_err(), "still waiting for COMMIT: {dropped:?}");
    let begun: bool = env
        .client
        .query_one("SELECT is_called FROM held_commits", &[])
        .await
        .unwrap()
        .get(0);
    assert!(begun, "the drop came while the held COMMIT ran");
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(
        env.effects("dropped").await,
        0,
        "rolled back with its record"
    );
    assert_eq!(env.record("held-dropped").await, None, "the key is free");
    let again = local_write(&env.pool, "held-dropped", "dropped")
        .await
        .expect("runs");
    assert!(!again.replayed);
    assert_eq!(env.effects("dropped").await, 1);
    assert_eq!(
        env.state("held-dropped").await.as_deref(),
        Some("completed")
    );
}
