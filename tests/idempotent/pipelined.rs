//! Local mode sends its lock and read with `BEGIN` and its record with
//! `COMMIT`, one round trip each. What that must never do: commit the body
//! without its record. A record of the key that appears between the read and
//! the record's write (here an external-mode claim, which does not queue on
//! local mode's advisory lock) makes the record's statement fail, and the
//! `COMMIT` sent behind it then rolls the body back. Both are shown on a
//! fresh connection, where neither statement is prepared yet (the record's
//! preparation comes between the two sends), and on a warm one; every effect
//! is counted in the database.

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
