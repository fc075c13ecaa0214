//! A record idem cannot misread (migration 15 dropped the record's CHECK
//! constraints): a label outside `mode`, `state` or `outcome` is refused by
//! the database, and a record written by hand that says no answer (completed
//! without an outcome or a response, a state idem does not know) is read as
//! `Error::MalformedRecord`: never replayed as a success, and the body does
//! not run again.

use super::*;

#[idempotent(key = key, scope = none, fingerprint(n))]
async fn once(conn: &mut AsyncPgConnection, key: &str, n: i64) -> Result<i64, AppError> {
    insert_effect(conn, "once", n).await
}

#[idempotent(key = key, scope = none, fingerprint(n), mode = external)]
async fn once_external(db: &mut Deferred<'_>, key: &str, n: i64) -> Result<i64, AppError> {
    insert_effect(db.conn().await?, "once", n).await
}

/// Call `key` in `mode` ("local" or "external").
async fn call(env: &Env, mode: &str, key: &str) -> Result<idem::Idempotent<i64>, AppError> {
    match mode {
        "local" => once(&env.pool, key, 5).await,
        _ => once_external(&env.pool, key, 5).await,
    }
}

/// What the database says to `sql`: `Ok(rows)` or its SQLSTATE.
async fn write(env: &Env, sql: &str) -> Result<u64, String> {
    tokio_postgres::Client::execute(&env.client, sql, &[])
        .await
        .map_err(|e| {
            e.code()
                .map_or_else(|| e.to_string(), |c| c.code().to_owned())
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_database_refuses_a_label_outside_the_record_types() {
    let env = env(2).await;
    once(&env.pool, "k-labels", 5).await.expect("a record");
    for bad in [
        "UPDATE idem_requests SET state = 'done' WHERE key = 'k-labels'",
        "UPDATE idem_requests SET outcome = 'maybe' WHERE key = 'k-labels'",
        "UPDATE idem_requests SET mode = 'remote' WHERE key = 'k-labels'",
        "UPDATE idem_requests SET outcome = 'OK' WHERE key = 'k-labels'",
        "INSERT INTO idem_requests (scope, key, operation, fingerprint, mode, state, expires_at)
         VALUES ('s', 'k-new', 'op', sha256('x'), 'local', 'complete', now())",
    ] {
        // 22P02: invalid input value for the enum.
        assert_eq!(write(&env, bad).await, Err("22P02".to_owned()), "{bad}");
    }
    // Text is still written where it is assigned (as a build from before
    // migration 15 writes its labels, bound as text).
    let text = "UPDATE idem_requests SET state = 'completed'::text, outcome = 'ok'::text \
                WHERE key = 'k-labels'";
    assert_eq!(write(&env, text).await, Ok(1));
    assert_eq!(
        env.record("k-labels").await.map(|r| (r.0, r.1)),
        Some(("completed".to_owned(), Some("ok".to_owned())))
    );
    let replay = once(&env.pool, "k-labels", 5).await.expect("replayed");
    assert!(replay.replayed);
    assert_eq!(env.effects("once").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_completed_record_that_says_no_answer_is_a_typed_error() {
    let env = env(2).await;
    let damage = [
        ("no-outcome", "outcome = NULL", "without an outcome"),
        ("no-response", "response = NULL", "without a response"),
    ];
    for mode in ["local", "external"] {
        for (name, set, why) in damage {
            let key = format!("{mode}-{name}");
            call(&env, mode, &key).await.expect("a first call");
            let before = env.effects("once").await;
            let sql = format!("UPDATE idem_requests SET {set} WHERE key = '{key}'");
            assert_eq!(write(&env, &sql).await, Ok(1), "{sql}");
            for _ in 0..2 {
                let result = call(&env, mode, &key).await;
                match &result {
                    Err(AppError::Idem(e @ idem::Error::MalformedRecord { reason })) => {
                        assert!(reason.contains(why), "{key}: {reason}");
                        assert_eq!(e.http_status(), 500);
                    }
                    other => panic!("{key}: misread as {other:?}"),
                }
            }
            assert_eq!(
                env.effects("once").await,
                before,
                "{key}: the body did not run"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_state_idem_does_not_know_is_a_typed_error() {
    let env = env(2).await;
    once(&env.pool, "k-state", 5).await.expect("a record");
    // A table whose state is text again, as before migration 15 but without
    // its CHECK (restored by hand, say): the reader still refuses a state it
    // does not know rather than guessing.
    let sql = "ALTER TABLE idem_requests ALTER COLUMN state TYPE text; \
               UPDATE idem_requests SET state = 'done' WHERE key = 'k-state'";
    tokio_postgres::Client::batch_execute(&env.client, sql)
        .await
        .expect("a state of its own");
    let result = once(&env.pool, "k-state", 5).await;
    assert!(
        matches!(
            &result,
            Err(AppError::Idem(idem::Error::MalformedRecord { reason })) if reason.contains("state")
        ),
        "{result:?}"
    );
    assert_eq!(env.effects("once").await, 1, "the body did not run again");
}
