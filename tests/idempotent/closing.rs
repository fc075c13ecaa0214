//! Local mode writes its record just before `COMMIT`. What that must never
//! do: commit the body without its record. A record of the key that appears
//! between the read and the record's write (here an external-mode claim,
//! which does not queue on local mode's advisory lock) makes the record's
//! statement fail, and the transaction is rolled back, never committed. Both
//! are shown on a fresh connection, where no statement is prepared yet, and
//! on a warm one; every effect is counted in the database. (These tests were
//! written when the record went out with `COMMIT` in one round trip; the
//! promise they pin stands.)

use super::*;

/// Writes an effect, says so on `entered`, and waits on `gate` before
/// returning (so the test can write a record of the key meanwhile).
#[idempotent(key = key, scope = none, fingerprint(n))]
#[retryable(max = 4, deadline_ms = 30000)]
async fn held(
    conn: &mut AsyncPgConnection,
    key: &str,
    n: i64,
    entered: &Semaphore,
    gate: &Semaphore,
) -> Result<i64, AppError> {
    let id = insert_effect(conn, "held", n).await?;
    entered.add_permits(1);
    gate.acquire().await.expect("the gate stays open").forget();
    Ok(id)
}

/// An external-mode claim of `key` in progress, as another operation's.
const CLAIM: &str = "INSERT INTO idem_requests (scope, key, operation, fingerprint, mode, state, \
     owner, expires_at, lease_until) VALUES ($1, $2, 'another::operation', \
     decode(repeat('ab', 32), 'hex'), 'external', 'in_progress', decode(repeat('cd', 16), 'hex'), \
     now() + interval '1 day', now() + interval '1 hour')";

/// The same claim taking over the key's expired record, as an external
/// request's claim does.
const TAKE_OVER: &str = "UPDATE idem_requests SET operation = 'another::operation', \
     fingerprint = decode(repeat('ab', 32), 'hex'), mode = 'external', state = 'in_progress', \
     outcome = NULL, response = NULL, owner = decode(repeat('cd', 16), 'hex'), \
     expires_at = now() + interval '1 day', lease_until = now() + interval '1 hour' \
     WHERE scope = $1 AND key = $2";

/// A completed record of `key` whose retention ended a minute ago.
const EXPIRED: &str = "INSERT INTO idem_requests (scope, key, operation, fingerprint, mode, state, \
     outcome, response, expires_at) VALUES ($1, $2, 'old::operation', \
     decode(repeat('ef', 32), 'hex'), 'local', 'completed', 'ok', '1', now() - interval '1 minute')";

/// Run `held` for `key` on `pool`; while its body waits, run `meanwhile`
/// (bound to scope and key) on the side connection. Returns the call's result.
async fn interleaved(
    env: &Env,
    pool: &Pool,
    key: &str,
    meanwhile: &str,
) -> Result<idem::Idempotent<i64>, AppError> {
    let entered = Arc::new(Semaphore::new(0));
    let gate = Arc::new(Semaphore::new(0));
    let call = {
        let (pool, key) = (pool.clone(), key.to_owned());
        let (entered, gate) = (Arc::clone(&entered), Arc::clone(&gate));
        tokio::spawn(async move { held(&pool, &key, 7, &entered, &gate).await })
    };
    entered.acquire().await.expect("the body runs").forget();
    let scope = idem::idempotency::scope_hash(&()).unwrap();
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&scope, &key];
    let written = tokio_postgres::Client::execute(&env.client, meanwhile, &params)
        .await
        .expect("the side write");
    assert_eq!(written, 1, "{meanwhile}");
    // Let every attempt through: the first one's record fails, the next one
    // reads the claim and is refused before its body runs.
    gate.add_permits(8);
    call.await.expect("no panic")
}

/// A pool whose one connection is new: no statement prepared on it yet.
fn cold_pool(env: &Env) -> Pool {
    pool_of(&env.db, 1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_record_that_appears_after_the_read_rolls_the_body_back() {
    let env = env(2).await;
    // Warm: the record's and COMMIT's statements are prepared already.
    let warm = env.pool.clone();
    let (entered, gate) = (Semaphore::new(0), Semaphore::new(8));
    held(&warm, "warm-up", 7, &entered, &gate)
        .await
        .expect("a first call prepares them");
    let before = env.effects("held").await;
    for (pool, key) in [(cold_pool(&env), "cold"), (warm, "warm")] {
        let result = interleaved(&env, &pool, key, CLAIM).await;
        assert!(
            matches!(
                result,
                Err(AppError::Idem(idem::Error::FingerprintMismatch))
            ),
            "{key}: refused as the claim's key, {result:?}"
        );
        assert_eq!(
            env.effects("held").await,
            before,
            "{key}: the body's write rolled back with its failed record"
        );
        assert_eq!(
            env.state(key).await.as_deref(),
            Some("in_progress"),
            "{key}: the claim is untouched"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_takeover_whose_expired_record_was_taken_meanwhile_rolls_back() {
    let env = env(2).await;
    let scope = idem::idempotency::scope_hash(&()).unwrap();
    for key in ["expired-cold", "expired-warm", "expired-free"] {
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&scope, &key];
        tokio_postgres::Client::execute(&env.client, EXPIRED, &params)
            .await
            .expect("an expired record");
    }
    // Undisturbed, a takeover is one row, completed by this request.
    let (entered, gate) = (Semaphore::new(0), Semaphore::new(8));
    let free = held(&env.pool, "expired-free", 7, &entered, &gate)
        .await
        .expect("the expired key is new");
    assert!(!free.replayed);
    assert_eq!(env.effects("held").await, 1);
    let (state, outcome, _) = env.record("expired-free").await.expect("its record");
    assert_eq!(
        (state.as_str(), outcome.as_deref()),
        ("completed", Some("ok"))
    );

    // Taken by an external claim between the read and the record's write:
    // the takeover raises (IDR01) instead of writing nothing.
    for (pool, key) in [
        (cold_pool(&env), "expired-cold"),
        (env.pool.clone(), "expired-warm"),
    ] {
        let result = interleaved(&env, &pool, key, TAKE_OVER).await;
        assert!(
            matches!(
                result,
                Err(AppError::Idem(idem::Error::FingerprintMismatch))
            ),
            "{key}: {result:?}"
        );
        assert_eq!(env.effects("held").await, 1, "{key}: nothing committed");
        assert_eq!(
            env.state(key).await.as_deref(),
            Some("in_progress"),
            "{key}"
        );
    }
    assert_eq!(
        env.records().await,
        3,
        "one row per key, whatever happened to it"
    );
}

/// Writes an effect: the plainest local call.
#[idempotent(key = key, scope = none, fingerprint(n))]
async fn plain(conn: &mut AsyncPgConnection, key: &str, n: i64) -> Result<i64, AppError> {
    insert_effect(conn, "plain", n).await
}

/// Behind a transaction pooler (`IDEM_TEST_VIA=pgbouncer`) each statement is
/// prepared and closed around its run; a close sent after `COMMIT` reaches
/// whichever server connection the pooler picks next, and the statement it
/// meant stays on the first one, where another client's statement of the
/// same name then fails (`prepared statement "s12" already exists`; names
/// repeat across processes only, so this test looks for the statements left
/// behind instead). A PgBouncer of this test's own, with two server
/// connections for sixteen clients, makes that pick land elsewhere; then two
/// transactions held open at once, one on each server connection, list what
/// is prepared there. (Directly, a plain concurrency check.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_local_calls_leave_no_statement_behind_their_commit() {
    use idem_testing::pgbouncer::{PgBouncer, PgBouncerSettings};
    let env = env(2).await;
    let mut bouncer = None;
    let pool = if env.db.via().is_transaction_pooling() {
        let url = env.db.url().to_owned();
        let settings = PgBouncerSettings {
            pool_size: 2,
            ..PgBouncerSettings::default()
        };
        let started = tokio::task::spawn_blocking(move || PgBouncer::start_with(&url, &settings))
            .await
            .expect("no panic")
            .expect("a PgBouncer of the test's own");
        let url = started.url_for(env.db.url()).expect("its url");
        bouncer = Some(started);
        build_pool_with(
            &url,
            &PoolConfig {
                max_size: 16,
                wait_timeout: Duration::from_secs(60),
                pooler: Pooler::TransactionPooling,
                ..PoolConfig::default()
            },
        )
        .expect("a pool through it")
    } else {
        pool_of(&env.db, 16)
    };
    let tasks: Vec<_> = (0..16)
        .map(|caller| {
            let pool = pool.clone();
            tokio::spawn(async move {
                let mut failures = Vec::new();
                for i in 0..50 {
                    let key = format!("plain-{caller}-{i}");
                    if let Err(e) = plain(&pool, &key, i).await {
                        failures.push(format!("{key}: {e}"));
                    }
                }
                failures
            })
        })
        .collect();
    let mut failures = Vec::new();
    for task in tasks {
        failures.extend(task.await.expect("no panic"));
    }
    assert!(
        failures.is_empty(),
        "{} failed: {failures:?}",
        failures.len()
    );
    assert_eq!(env.effects("plain").await, 800);
    drop(pool);
    let Some(bouncer) = bouncer else { return };
    let url = bouncer.url_for(env.db.url()).expect("its url");
    let mut left = Vec::new();
    let mut probes = Vec::new();
    for _ in 0..2 {
        let client = side_connection(&url).await;
        client.batch_execute("BEGIN").await.expect("a transaction");
        let rows = client
            .query(
                "SELECT statement FROM pg_prepared_statements \
                 WHERE statement NOT LIKE '%pg_prepared_statements%'",
                &[],
            )
            .await
            .expect("list what is prepared");
        left.extend(rows.iter().map(|row| row.get::<_, String>(0)));
        // Held open, so the next probe gets the other server connection.
        probes.push(client);
    }
    assert!(
        left.is_empty(),
        "{} statements outlived their transaction: {left:?}",
        left.len()
    );
    drop(probes);
    drop(bouncer);
}

/// Writes an effect, then swallows the error of a statement that failed.
#[idempotent(key = key, scope = none, fingerprint(n))]
async fn swallowing(conn: &mut AsyncPgConnection, key: &str, n: i64) -> Result<i64, AppError> {
    let id = insert_effect(conn, "swallowing", n).await?;
    let failed = diesel::sql_query("SELECT 1 / 0").execute(conn).await;
    assert!(failed.is_err(), "division by zero fails");
    Ok(id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_swallowed_failure_sends_no_record_and_commits_nothing() {
    let env = env(2).await;
    let result = swallowing(&env.pool, "swallowed", 1).await;
    assert!(
        matches!(result, Err(AppError::Idem(idem::Error::RolledBack))),
        "{result:?}"
    );
    assert_eq!(env.effects("swallowing").await, 0, "rolled back");
    assert_eq!(env.record("swallowed").await, None, "no record was sent");
}
