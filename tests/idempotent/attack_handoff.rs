//! A hostile pass on the hand-off of a local call's transaction after its
//! body's own `COMMIT` (docs/idempotent.md, "local"): a dropped call's
//! connection handed to a task, a lost connection's slot kept while the
//! hold goes on a connection outside the pool, the watch frozen when the
//! connection leaves. Effects, records, backends and the pool's status are
//! read from the database or the pool, never from idem's answer.

use super::*;
use std::sync::atomic::AtomicU8;
use tokio::net::{TcpListener, TcpStream};

const TEN: Duration = Duration::from_secs(10);
const HELD: Option<&str> = Some("unknown/local");
const PASS: u8 = 0;
const STALL: u8 = 1;
const REFUSE: u8 = 2;

/// `state/mode` of `key`'s record.
async fn held(env: &Env, key: &str) -> Option<String> {
    let sql = "SELECT state::text || '/' || mode::text FROM idem_requests WHERE key = $1";
    let row = env.client.query_opt(sql, &[&key]).await.unwrap();
    row.map(|r| r.get(0))
}

/// A TCP proxy in front of the server of `env`: a new connection is passed
/// on, left unanswered while the mode is `STALL`, or closed at once when
/// `REFUSE`. Connections already made are not touched.
async fn proxy(env: &Env) -> (String, Arc<AtomicU8>) {
    let (head, rest) = env.db.url().split_once('@').unwrap();
    let (addr, tail) = rest.split_once('/').unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("{head}@{}/{tail}", listener.local_addr().unwrap());
    let (mode, addr) = (Arc::new(AtomicU8::new(PASS)), addr.to_owned());
    let m = mode.clone();
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            let (m, addr) = (m.clone(), addr.clone());
            tokio::spawn(async move {
                while AtomicU8::load(&m, Ordering::SeqCst) == STALL {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                if AtomicU8::load(&m, Ordering::SeqCst) == REFUSE {
                    return;
                }
                let mut server = TcpStream::connect(addr).await.unwrap();
                let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
            });
        }
    });
    (url, mode)
}

fn direct_pool(url: &str, max_size: usize) -> Pool {
    let config = PoolConfig {
        max_size,
        wait_timeout: Duration::from_secs(60),
        pooler: Pooler::Direct,
        ..PoolConfig::default()
    };
    build_pool_with(url, &config).unwrap()
}

/// The pool gives every slot back, and no backend of the database stays in
/// a transaction; then `n` plain checkouts all work.
async fn settled(env: &Env, pool: &Pool, n: usize) {
    let free = || async {
        let s = pool.status();
        s.size == s.available
    };
    assert!(
        eventually(TEN, free).await,
        "a slot leaked: {:?}",
        pool.status()
    );
    let sql = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
               AND state LIKE 'idle in transaction%'";
    let idle = || async { env.scalar(sql).await == 0 };
    assert!(eventually(TEN, idle).await, "a backend idle in transaction");
    let gets = futures_util::future::join_all((0..n).map(|_| pool.get())).await;
    assert!(gets.iter().all(Result::is_ok), "{:?}", pool.status());
}

/// Effect; on its first run waits at `gate` twice before its own
/// `COMMIT`; then writes once more (idem closes the
/// connection of a body that writes after ending its transaction).
#[idempotent(key = key, fingerprint(key), scope = none)]
#[retryable(max = 3, deadline_ms = 20000, commit_timeout_ms = 3000)]
async fn writes_after(
    conn: &mut AsyncPgConnection,
    key: &str,
    gate: &Barrier,
    runs: &AtomicU32,
) -> Result<i64, AppError> {
    let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
    insert_effect(conn, key, i64::from(run)).await?;
    if run == 1 {
        gate.wait().await;
        gate.wait().await;
    } else {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    conn.batch_execute("COMMIT").await?;
    insert_effect(conn, "audit", 1).await
}

/// A call of `key` on a pool of one through the proxy, with a duplicate
/// queued on the pool before its body's `COMMIT`; new connections stall
/// while the body writes after its `COMMIT` (the hold's connection outside
/// the pool waits), `abort` the call there or not, then pass again. The
/// duplicate's answer, runs, effects.
async fn stalled_outside(env: &Env, key: &'static str, abort: bool) -> (String, u32, i64) {
    let (url, mode) = proxy(env).await;
    let pool = direct_pool(&url, 1);
    let (runs, gate) = (Arc::new(AtomicU32::new(0)), Arc::new(Barrier::new(2)));
    let call = {
        let (pool, gate, runs) = (pool.clone(), gate.clone(), runs.clone());
        tokio::spawn(async move { writes_after(&pool, key, &gate, &runs).await })
    };
    gate.wait().await;
    let dup = {
        let (pool, runs) = (pool.clone(), runs.clone());
        let one = Barrier::new(1);
        tokio::spawn(async move { format!("{:?}", writes_after(&pool, key, &one, &runs).await) })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    mode.store(STALL, Ordering::SeqCst);
    gate.wait().await; // the body's COMMIT, and its write after it
    tokio::time::sleep(Duration::from_millis(400)).await;
    if abort {
        call.abort();
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    mode.store(PASS, Ordering::SeqCst);
    let answer = tokio::time::timeout(TEN, dup).await.expect("hung").unwrap();
    let _ = tokio::time::timeout(TEN, call)
        .await
        .expect("the call hung");
    assert!(eventually(TEN, || async { held(env, key).await.is_some() }).await);
    settled(env, &pool, 1).await;
    (answer, calls(&runs), env.effects(key).await)
}

/// The control: the hold's connection outside the pool is slow to come (a
/// server slow to accept), within `commit_timeout_ms`; the duplicate
/// queued on the pool of one waits behind it and is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_handoff_a_slow_outside_connection_still_comes_first() {
    let env = env(2).await;
    if env.db.via().is_transaction_pooling() {
        return;
    }
    let (answer, runs, effects) = stalled_outside(&env, "slow-outside", false).await;
    assert!(answer.contains("OutcomeUnknown"), "{answer}");
    assert_eq!((runs, effects), (1, 1), "{answer}");
    assert_eq!(held(&env, "slow-outside").await.as_deref(), HELD);
}

/// The same, the caller giving up while the hold's connection outside the
/// pool is being made. The docs: a call dropped "while the hold is being
/// written" has a task of its own do the same, the call's pool slot given
/// up "only then". Seen: the duplicate queued on the pool runs the body
/// again (two effects, the duplicate answered `TransactionEnded`), the key
/// held only after it. Should: one effect, the duplicate `OutcomeUnknown`.
/// Suspected: `hold::hold_unknown` calls `tx.done_after_body_commit()`
/// before `outside(..)`, so dropping the call there drops the `Tx` with no
/// hand-off: `Drop for Tx` frees the kept (`lost`) slot at once, and `Drop
/// for Call` falls back to `hold_in_background`, a checkout through the
/// pool queued behind the duplicate.
/// Fixed: the hand-off stays armed until the hold is answered, outside
/// the pool too (`hold::give_up`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn found_a_call_dropped_while_its_hold_connects_outside_frees_its_slot() {
    let env = env(2).await;
    if env.db.via().is_transaction_pooling() {
        return;
    }
    let (answer, runs, effects) = stalled_outside(&env, "dropped-outside", true).await;
    assert_eq!((runs, effects), (1, 1), "duplicate: {answer}");
}

/// A pool of two through the proxy, both connections made, then new ones
/// treated as `fault` says: a body that writes after its own `COMMIT`
/// (losing its connection) is answered within `within_ms`, its key held
/// (through the pool's idle connection), a repeat refused, one effect, and
/// no slot kept.
async fn falls_back_to_the_pool(env: &Env, fault: u8, key: &str, within_ms: u64) {
    let (url, mode) = proxy(env).await;
    let pool = direct_pool(&url, 2);
    drop(futures_util::future::join_all([pool.get(), pool.get()]).await);
    mode.store(fault, Ordering::SeqCst);
    let runs = AtomicU32::new(0);
    let started = Instant::now();
    let first = writes_after(&pool, key, &Barrier::new(1), &runs).await;
    let took = started.elapsed();
    assert!(matches_idem(&first, "TransactionEnded"), "{first:?}");
    assert!(
        took < Duration::from_millis(within_ms),
        "answered after {took:?}"
    );
    assert_eq!(held(env, key).await.as_deref(), HELD);
    let repeat = writes_after(&pool, key, &Barrier::new(1), &runs).await;
    assert!(matches_idem(&repeat, "OutcomeUnknown"), "{repeat:?}");
    assert_eq!((calls(&runs), env.effects(key).await), (1, 1));
    mode.store(PASS, Ordering::SeqCst);
    settled(env, &pool, 2).await;
}

/// The hold's connection outside the pool refused (the server takes no new
/// connection): written through the pool's idle connection instead, the
/// call answered within `commit_timeout_ms`, no slot kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_handoff_a_refused_outside_connection_falls_back_to_the_pool() {
    let env = env(2).await;
    if env.db.via().is_transaction_pooling() {
        return;
    }
    falls_back_to_the_pool(&env, REFUSE, "refused-outside", 4000).await;
}

/// The hold's connection outside the pool never comes (the server stops
/// accepting): after half of `commit_timeout_ms` the hold goes through the
/// pool's idle connection instead, in what is left of that time. Before,
/// the outside connection had all of it, and the hold was never written (a
/// repeat ran the body again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_outside_connection_leaves_time_for_the_pool() {
    let env = env(2).await;
    if env.db.via().is_transaction_pooling() {
        return;
    }
    falls_back_to_the_pool(&env, STALL, "stalled-outside", 4500).await;
}

/// Effect, 50 ms, then as `kind`: 0 answers (idem commits), 1 `COMMIT` by
/// hand, 2 `COMMIT` by hand and one more write.
#[idempotent(key = key, fingerprint(key), scope = none)]
#[retryable(max = 3, deadline_ms = 20000, commit_timeout_ms = 3000)]
async fn mixed(conn: &mut AsyncPgConnection, key: &str, kind: u8) -> Result<i64, AppError> {
    let id = insert_effect(conn, key, 1).await?;
    tokio::time::sleep(Duration::from_millis(50)).await;
    if kind > 0 {
        conn.batch_execute("COMMIT").await?;
    }
    if kind > 1 {
        insert_effect(conn, "audit", 1).await?;
    }
    Ok(id)
}

fn below(n: u64) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let state = std::collections::hash_map::RandomState::new();
    state.build_hasher().finish() % n
}

/// Keys of each kind, `dups` calls of each at once on a pool of one, each
/// dropped at a random moment when `drops`; then, per key: no effect, no
/// record and a repeat runs once; else a record (held for a hand
/// `COMMIT`, completed otherwise), at most two effects, a repeat that does
/// not run. The bad keys, and the answers.
async fn storm(env: &Env, dups: usize, drops: bool) -> (Vec<String>, Vec<String>) {
    let pool = pool_of(&env.db, 1);
    let keys: Vec<(String, u8)> = (0..9).map(|i| (format!("mix-{i}"), i % 3)).collect();
    let calls = keys.iter().flat_map(|(key, kind)| {
        let limit = Duration::from_millis(if drops && below(2) == 0 {
            below(800)
        } else {
            30_000
        });
        let (pool, key, kind) = (pool.clone(), key.clone(), *kind);
        (0..dups).map(move |_| {
            let (pool, key) = (pool.clone(), key.clone());
            async move {
                let r = tokio::time::timeout(limit, mixed(&pool, &key, kind)).await;
                format!("{key}/{kind}: {:?}", r.map(|r| r.map(|v| v.replayed)))
            }
        })
    });
    let seen = futures_util::future::join_all(calls).await;
    let sql = "SELECT count(*) FROM effects e WHERE tag LIKE 'mix-%' AND NOT EXISTS \
               (SELECT 1 FROM idem_requests r WHERE r.key = e.tag)";
    eventually(TEN, || async { env.scalar(sql).await == 0 }).await;
    settled(env, &pool, 1).await;
    let mut bad = Vec::new();
    for (key, kind) in &keys {
        let (effects, record) = (env.effects(key).await, held(env, key).await);
        let repeat = mixed(&pool, key, 0).await;
        let after = env.effects(key).await;
        let fine = match (effects, *kind) {
            (0, _) => record.is_none() && matches!(&repeat, Ok(v) if !v.replayed) && after == 1,
            (1, 0) => {
                record.as_deref() == Some("completed/local")
                    && matches!(&repeat, Ok(v) if v.replayed)
                    && after == 1
            }
            (1 | 2, 1 | 2) => {
                record.as_deref() == HELD
                    && matches_idem(&repeat, "OutcomeUnknown")
                    && after == effects
            }
            _ => false,
        };
        if !fine {
            bad.push(format!(
                "{key}/{kind}: effects {effects}, {record:?}, {repeat:?}, after {after}"
            ));
        }
    }
    (bad, seen)
}

/// Normal calls between hand-`COMMIT` ones (plain, and writing after it)
/// on a pool of one, three duplicates each: a normal key is never held
/// nor lost, a hand-committed key is held, at most one duplicate runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_handoff_normal_calls_among_hand_commits_on_a_pool_of_one() {
    let env = env(2).await;
    let (bad, seen) = storm(&env, 3, false).await;
    assert!(bad.is_empty(), "{bad:#?}\n{seen:#?}");
    for answer in seen.iter().filter(|s| s.contains("/0: ")) {
        assert!(answer.contains("Ok(Ok("), "{answer}");
    }
}

/// The same under `#[retryable(max = 3)]`, callers dropped at random: no
/// slot leaked, no backend left in a transaction, no key held without an
/// effect, none run more than twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_handoff_random_drops_among_hand_commits_on_a_pool_of_one() {
    let env = env(2).await;
    let (bad, seen) = storm(&env, 3, true).await;
    assert!(bad.is_empty(), "{bad:#?}\n{seen:#?}");
}

/// As above on a pool of one, no connection to be had anywhere: the call
/// is still answered within `commit_timeout_ms` (and a little), the key
/// not held (logged, as documented: a repeat runs again), the slot given
/// back, and the pool works once the server accepts again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_handoff_no_connection_anywhere_is_bounded_and_frees_the_slot() {
    let env = env(2).await;
    if env.db.via().is_transaction_pooling() {
        return;
    }
    let (url, mode) = proxy(&env).await;
    let pool = direct_pool(&url, 1);
    drop(pool.get().await.unwrap());
    mode.store(REFUSE, Ordering::SeqCst);
    let (key, runs) = ("refused-everywhere", AtomicU32::new(0));
    let started = Instant::now();
    let first = writes_after(&pool, key, &Barrier::new(1), &runs).await;
    let took = started.elapsed();
    assert!(matches_idem(&first, "TransactionEnded"), "{first:?}");
    assert!(
        took < Duration::from_millis(4500),
        "answered after {took:?}"
    );
    assert_eq!(held(&env, key).await, None);
    mode.store(PASS, Ordering::SeqCst);
    settled(&env, &pool, 1).await;
    let again = mixed(&pool, key, 0).await;
    assert!(matches!(&again, Ok(v) if !v.replayed), "{again:?}");
    assert_eq!((calls(&runs), env.effects(key).await), (1, 2));
}
