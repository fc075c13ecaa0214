//! A body that ends idem's transaction with `PREPARE TRANSACTION`: its
//! writes handed to a two-phase commit that someone else finishes, or not.
//! idem counts them as committed (`TransactionEnded { committed: true }`),
//! a write the body sends after it never runs, and a key is held as
//! outcome unknown whether the prepared transaction is then committed or
//! rolled back (an operator settles it). In local mode the prepared
//! transaction keeps the key's advisory lock until it is finished: a
//! duplicate waits on it up to its deadline. `max_prepared_transactions`
//! is 0 by default and only a server start changes it: each test starts a
//! server of its own.
use super::kit::*;
use super::*;

/// A database on a server of its own allowing `max` prepared
/// transactions, with the slow `COMMIT`s' tables (their deferred checks
/// fire at a `PREPARE` too).
pub(super) async fn env_max(max: &'static str) -> (idem_testing::Cluster, Env) {
    let start =
        move || idem_testing::start_throwaway_cluster_with(&[("max_prepared_transactions", max)]);
    let cluster = tokio::task::spawn_blocking(start)
        .await
        .expect("join")
        .expect("start a server allowing prepared transactions");
    let db = TestDatabase::create_on(cluster.url())
        .await
        .expect("create the test database");
    let env = env_in(db, 2).await;
    let ddl = format!("{SLOW_COMMITS}; {STUBBORN}");
    env.client.batch_execute(&ddl).await.expect("deferred");
    (cluster, env)
}

/// Transactions prepared in this database, and those under `gid`.
pub(super) async fn prepared(env: &Env, gid: &str) -> (i64, i64) {
    let q = "SELECT count(*), count(*) FILTER (WHERE gid = $1) FROM pg_prepared_xacts \
             WHERE database = current_database()";
    let row = env.client.query_one(q, &[&gid]).await.unwrap();
    (row.get(0), row.get(1))
}

pub(super) const PREPARE: &str = "PREPARE TRANSACTION 'p-{k}'";
const N3_PREPARE: &str =
    "INSERT INTO effects (tag, n) VALUES ('{k}', 3); PREPARE TRANSACTION 'p-{k}'";

/// Under local mode, external mode and a plain `#[retryable]`: the body
/// prepares its transaction (awaited, then a write behind it refused by the
/// seal; queued and left to idem; in one text with a write of its own).
/// Answered `TransactionEnded { committed: true }` at once; nothing visible
/// until the prepared transaction is finished, nothing of the write behind
/// it ever; the key held as unknown, a repeat running nothing, whether the
/// prepared transaction is then committed (the effects appear) or rolled
/// back (none).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_prepares_its_transaction_is_answered_committed_and_its_key_held() {
    let (_cluster, env) = env_max("8").await;
    let cases: [(&str, &'static [A], i64); 4] = [
        ("awaited", &[W(PREPARE)], 0),
        ("then-write", &[W(PREPARE), W(N2)], 0),
        ("queued", &[Q(PREPARE), Ms(50)], 0),
        ("in-text", &[W(N3_PREPARE)], 1),
    ];
    let mut bad = Vec::new();
    for v in [V::Rc, V::Ext, V::Plain] {
        for (i, &(name, steps, with_n3)) in cases.iter().enumerate() {
            let key = format!("prep-{v:?}-{name}");
            let s = probe(&env, &env.pool, v, &key, (steps, OK), TEN, 0).await;
            let what = format!("{key}: {} n {:?} rec {:?}", s.ans, s.ns, s.rec);
            if !s.ans.contains("TransactionEnded { committed: true }") {
                bad.push(format!("{what}: not answered committed"));
            }
            if s.ns != (0, 0, 0) || prepared(&env, &format!("p-{key}")).await.1 != 1 {
                bad.push(format!("{what}: expected nothing visible, one prepared"));
            }
            let keyed = !plain(v);
            if keyed && s.rec.as_deref() != Some("unknown") {
                bad.push(format!("{what}: the key is not held"));
            }
            // Committed for half the cases, rolled back for the others.
            let commit = i % 2 == 0;
            let finish = if commit { "COMMIT" } else { "ROLLBACK" };
            let finish = format!("{finish} PREPARED 'p-{key}'");
            env.client.batch_execute(&finish).await.expect(&finish);
            let (n1, n3) = (n_of(&env, &key, 1).await, n_of(&env, &key, 3).await);
            let expected = if commit { (1, with_n3) } else { (0, 0) };
            if (n1, n3) != expected || n_of(&env, &key, 2).await != 0 {
                bad.push(format!("{what}: after {finish}: n1 {n1} n3 {n3}"));
            }
            if keyed {
                let r = call(&env.pool, v, &key, &EMPTY, &tokio::sync::Notify::new()).await;
                let still = env.record(&key).await.map(|r| r.0);
                let ran = n_of(&env, &key, 1).await - n1;
                if !matches!(r, Err(AppError::Idem(idem::Error::OutcomeUnknown)))
                    || ran != 0
                    || still.as_deref() != Some("unknown")
                {
                    bad.push(format!("{what}: a repeat: {r:?}, ran {ran}, {still:?}"));
                }
            }
        }
    }
    bad.extend(hygiene(&env, &env.pool, "prep").await);
    verdict(&bad);
}

#[idempotent(key = key, fingerprint(key), scope = none)]
#[retryable(max = 1, deadline_ms = 1500, commit_timeout_ms = 1000)]
async fn short(conn: &mut AsyncPgConnection, key: &str, prepare: bool) -> Result<i64, AppError> {
    let id = insert_effect(conn, key, 1).await?;
    if prepare {
        conn.batch_execute(&PREPARE.replace("{k}", key)).await?;
    }
    Ok(id)
}

/// Local mode: the prepared transaction keeps the key's advisory lock (a
/// body's `COMMIT` would release it), so a duplicate waits on it for its
/// whole deadline and is answered `Exhausted` (`DeadlineExceeded`),
/// running nothing; once the prepared transaction is finished, at once
/// `OutcomeUnknown`. Another key is not held up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepared_transaction_keeps_the_keys_lock_until_it_is_finished() {
    let (_cluster, env) = env_max("8").await;
    let key = "prep-lock";
    let first = short(&env.pool, key, true).await;
    assert!(
        matches!(
            first,
            Err(AppError::Idem(idem::Error::TransactionEnded {
                committed: true
            }))
        ),
        "{first:?}"
    );
    assert_eq!(prepared(&env, &format!("p-{key}")).await.1, 1);
    assert_eq!(env.state(key).await.as_deref(), Some("unknown"));

    let started = Instant::now();
    let waited = short(&env.pool, key, false).await;
    let took = started.elapsed();
    assert!(
        matches!(
            waited,
            Err(AppError::Idem(idem::Error::Exhausted {
                last_cause: idem::RetryCause::DeadlineExceeded,
                ..
            }))
        ),
        "{waited:?}"
    );
    assert!(
        took >= Duration::from_millis(1400),
        "answered after {took:?}"
    );

    let other = short(&env.pool, "prep-lock-other", false).await;
    assert!(matches!(other, Ok(ref v) if !v.replayed), "{other:?}");

    env.client
        .batch_execute("ROLLBACK PREPARED 'p-prep-lock'")
        .await
        .expect("rollback prepared");
    let after = short(&env.pool, key, false).await;
    assert!(
        matches!(after, Err(AppError::Idem(idem::Error::OutcomeUnknown))),
        "{after:?}"
    );
    assert_eq!(
        env.effects(key).await,
        0,
        "nothing of the key ever committed"
    );
    assert_eq!(env.effects("prep-lock-other").await, 1);
}
