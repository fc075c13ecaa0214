//! Hostile tests of local mode's riding statements, continued: faults on
//! the wire while they travel, and a session whose client encoding would
//! change how their literals read. Effects are counted in the database.

use super::attack::{body_runs, healthy};
use super::*;
use idem_testing::proxy::{Fault, Proxy};

// ---------------------------------------------------------------------------
// Faults on the wire
// ---------------------------------------------------------------------------

pub(super) struct ProxyEnv {
    pub(super) env: Env,
    pub(super) proxy: Proxy,
    pub(super) pool: Pool,
}

pub(super) async fn proxy_env() -> ProxyEnv {
    let env = env(2).await;
    let proxy = Proxy::start(env.db.url()).await.unwrap();
    let pool = build_pool_with(
        proxy.url(),
        &PoolConfig {
            max_size: 1,
            wait_timeout: Duration::from_secs(10),
            ..PoolConfig::default()
        },
    )
    .unwrap();
    ProxyEnv { env, proxy, pool }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_faults_on_begin_and_commit_messages() {
    let p = proxy_env().await;
    let (env, pool) = (&p.env, &p.pool);
    // Cold connection: the BEGIN message (with its Parses) is lost after
    // the server ran it; the retry runs on a fresh connection.
    p.proxy.arm("encode(fingerprint, 'hex')", Fault::CutAfter);
    let r = body_runs(pool, "b1", "faults", "").await;
    assert!(matches!(&r, Ok(v) if !v.replayed), "{r:?}");
    assert_eq!(env.effects("faults").await, 1);
    // Warm connection: lost before it reaches the server.
    healthy(env, pool, "faults-warm", 1).await;
    p.proxy.arm("pg_advisory_xact_lock", Fault::CutBefore);
    let r = body_runs(pool, "b2", "faults", "").await;
    assert!(matches!(&r, Ok(v) if !v.replayed), "{r:?}");
    assert_eq!(env.effects("faults").await, 2);
    // The COMMIT message (record + COMMIT) runs, its answer is lost.
    healthy(env, pool, "faults-warm2", 1).await;
    p.proxy
        .arm("INSERT INTO idem_requests AS r", Fault::CutAfter);
    let r = body_runs(pool, "c1", "faults", "").await;
    assert!(matches_idem(&r, "CommitUnknown"), "{r:?}");
    let again = body_runs(pool, "c1", "faults", "").await;
    assert!(matches!(&again, Ok(v) if v.replayed), "{again:?}");
    assert_eq!(env.effects("faults").await, 3);
    // Cold connection's COMMIT message (with its Parse) lost before.
    p.proxy.cut_all();
    p.proxy
        .arm("INSERT INTO idem_requests AS r", Fault::CutBefore);
    let r = body_runs(pool, "c2", "faults", "").await;
    assert!(r.is_err(), "{r:?}");
    assert_eq!(env.effects("faults").await, 3);
    assert_eq!(env.state("c2").await, None);
    let again = body_runs(pool, "c2", "faults", "").await;
    assert!(matches!(&again, Ok(v) if !v.replayed), "{again:?}");
    assert_eq!(env.effects("faults").await, 4);
    assert!(p.proxy.fired() >= 4);
}

/// The backend is terminated while the COMMIT message (record + COMMIT) is
/// held on its way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_backend_terminated_while_commit_in_flight() {
    let p = proxy_env().await;
    let (env, pool) = (&p.env, &p.pool);
    healthy(env, pool, "term-warm", 1).await;
    p.proxy.arm(
        "INSERT INTO idem_requests AS r",
        Fault::HoldRequest(Duration::from_millis(800)),
    );
    let call = {
        let pool = pool.clone();
        tokio::spawn(async move { body_runs(&pool, "t1", "term", "").await })
    };
    // Once the proxy holds the record and COMMIT (not after a fixed nap,
    // which a loaded machine can outrun or fall behind).
    let started = Instant::now();
    while p.proxy.fired() == 0 {
        assert!(started.elapsed() < Duration::from_secs(10), "never held");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let killed: i64 = env
        .client
        .query_one(
            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = current_database() AND pid <> pg_backend_pid() \
             AND state LIKE 'idle in transaction%') t",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let r = call.await.unwrap();
    assert_eq!(killed, 1, "{r:?}");
    assert!(r.is_err(), "{r:?}");
    assert_eq!(env.effects("term").await, 0, "{r:?}");
    assert_eq!(env.state("t1").await, None);
    let again = body_runs(pool, "t1", "term", "").await;
    assert!(matches!(&again, Ok(v) if !v.replayed), "{again:?}");
    assert_eq!(env.effects("term").await, 1);
    healthy(env, pool, "term-after", 1).await;
}

// ---------------------------------------------------------------------------
// A client-only encoding: a literal read by the server in another encoding
// ---------------------------------------------------------------------------

/// Under a client encoding whose multibyte characters may end in a backslash
/// byte (SJIS), with `backslash_quote = on`, the server would read the UTF-8
/// bytes of `Á` (C3 81) and the first backslash of an escaped `\\` as
/// characters, and the second backslash would then escape the quote: a
/// caller's key would break out of its literal. The wire sees the session's
/// client encoding change (ParameterStatus), and nothing rides: the call is
/// refused, nothing is written, and the connection serves the next call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_key_breaks_its_literal_under_a_client_only_encoding() {
    let env = env(2).await;
    if env.db.via().is_transaction_pooling() {
        return;
    }
    let pool = pool_of(&env.db, 1);
    let key = "\u{c1}\\', $$op$$, decode($$00$$, $$hex$$), $$ok$$, $$1$$, 1); \
               INSERT INTO effects (tag, n) VALUES ($$injected$$, 1); COMMIT; --";
    assert!(key.len() <= 255);
    let sjis = "SET LOCAL client_encoding = 'SJIS'; SET LOCAL backslash_quote = on";
    for _ in 0..2 {
        let r = body_runs(&pool, key, "sjis", sjis).await;
        assert!(
            matches!(&r, Err(e) if e.to_string().contains("client_encoding is SJIS")),
            "{r:?}"
        );
    }
    assert_eq!(env.effects("injected").await, 0, "the key ran no SQL");
    assert_eq!(env.effects("sjis").await, 0, "refused calls write nothing");
    assert_eq!(env.records().await, 0);
    // The encoding was the transaction's: the connection serves the key.
    let r = body_runs(&pool, key, "sjis", "").await;
    assert!(matches!(&r, Ok(v) if !v.replayed), "{r:?}");
    assert_eq!(env.effects("sjis").await, 1);
    assert_eq!(env.state(key).await.as_deref(), Some("completed"));
}
