//! A hostile pass on a body that swaps the connection it was lent
//! (`Error::ConnectionReplaced`) and on session state a body commits. Three
//! defects it found are fixed (each test says what happened before). Writes
//! on idem's connection are tagged with the key, on one swapped in `<key>-out`.

use super::attack_body::{next_callers, plain};
use super::attack_ext::records_of;
use super::*;
use diesel::sql_types::Integer;
use diesel_async::{AnsiTransactionManager, TransactionManager};
use idem::pool::PooledConnection;

type Pids = Arc<Mutex<Vec<i32>>>;

/// Where a swapping body gets its connections (a pool, a URL), and where
/// it notes the backends it swapped in.
#[derive(Clone)]
struct Kit {
    pool: Pool,
    url: String,
    pids: Pids,
}

/// What a body swaps in for the connection it was lent (`std::mem::swap`).
/// `Pooled`: a second checkout of the same pool, a transaction begun on it;
/// `PooledIdle`: none begun (its writes autocommit); `PooledDropped`: as
/// `Pooled`, but what the body holds at the end (idem's connection) goes
/// back to the pool the usual way (the others close it); `PooledTwice`: two
/// more checkouts swapped in in turn; `Own`: a connection the body opens on
/// the URL, a transaction begun on it; `..AndBack`: swapped in, a write
/// through idem's connection in the body's hand, then idem's swapped back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum How {
    Pooled,
    PooledIdle,
    PooledDropped,
    PooledTwice,
    Own,
    OwnAndBack,
    PooledAndBack,
}

/// How the body ends after the swap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Ok,
    Err,
    Declined,
    Panic,
}

/// A checkout (closed at the end, unless `true`: back to the pool as any
/// checkout), or a connection of the body's own.
enum Foreign {
    Pooled(PooledConnection, bool),
    Own(AsyncPgConnection),
}

impl Foreign {
    fn conn(&mut self) -> &mut AsyncPgConnection {
        match self {
            Foreign::Pooled(c, _) => c,
            Foreign::Own(c) => c,
        }
    }

    fn close(self) {
        if let Foreign::Pooled(c, false) = self {
            drop(PooledConnection::take(c));
        }
    }
}

pub(super) async fn pid(conn: &mut AsyncPgConnection) -> i32 {
    #[derive(QueryableByName)]
    struct P {
        #[diesel(sql_type = Integer)]
        p: i32,
    }
    let query = diesel::sql_query("SELECT pg_backend_pid() AS p");
    query.get_result::<P>(conn).await.expect("pid").p
}

async fn foreign(how: How, kit: &Kit) -> Foreign {
    let mut f = match how {
        How::Own | How::OwnAndBack => {
            Foreign::Own(AsyncPgConnection::establish(&kit.url).await.unwrap())
        }
        _ => Foreign::Pooled(kit.pool.get().await.unwrap(), how == How::PooledDropped),
    };
    if matches!(how, How::Pooled | How::PooledDropped | How::Own) {
        AnsiTransactionManager::begin_transaction(f.conn())
            .await
            .unwrap();
    }
    let p = pid(f.conn()).await;
    kit.pids.lock().unwrap().push(p);
    f
}

/// The swap, as `how` says; what the body's hands hold at the end (idem's
/// connection among them, unless swapped back) is dropped 300 ms later.
async fn swap_in(
    conn: &mut AsyncPgConnection,
    key: &str,
    how: How,
    kit: &Kit,
) -> Result<(), AppError> {
    let out = format!("{key}-out");
    let twice = how == How::PooledTwice;
    let mut first = foreign(if twice { How::PooledIdle } else { how }, kit).await;
    std::mem::swap(conn, first.conn());
    let mut held = vec![];
    match how {
        How::OwnAndBack | How::PooledAndBack => {
            insert_effect(first.conn(), key, 2).await?;
            std::mem::swap(conn, first.conn());
            insert_effect(conn, key, 3).await?;
        }
        How::PooledTwice => {
            let mut second = foreign(How::Pooled, kit).await;
            std::mem::swap(conn, second.conn());
            insert_effect(conn, &out, 2).await?;
            held.push(second);
        }
        _ => drop(insert_effect(conn, &out, 2).await?),
    }
    held.push(first);
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        held.into_iter().for_each(Foreign::close);
    });
    Ok(())
}

/// Local mode: writes effect 1 on idem's connection, swaps, ends as `end`.
#[idempotent(key = key, scope = none, fingerprint(key))]
#[retryable(max = 1, deadline_ms = 10000)]
async fn swapper(
    conn: &mut AsyncPgConnection,
    key: &str,
    how: How,
    end: End,
    kit: &Kit,
) -> Result<i64, AppError> {
    insert_effect(conn, key, 1).await?;
    swap_in(conn, key, how, kit).await?;
    match end {
        End::Ok => Ok(1),
        End::Err => Err(AppError::Timeout),
        End::Declined => Err(AppError::Declined(Declined::Rejected { input: 1.into() })),
        End::Panic => panic!("the body panics after its swap"),
    }
}

/// The same under a plain `#[retryable]`.
#[retryable(max = 1, deadline_ms = 10000)]
async fn plain_swapper(
    conn: &mut AsyncPgConnection,
    key: &str,
    how: How,
    kit: &Kit,
) -> Result<i64, AppError> {
    insert_effect(conn, key, 1).await?;
    swap_in(conn, key, how, kit).await?;
    Ok(1)
}

/// External mode, phase 3: the outcome's transaction begun by `db.conn()`,
/// effect 1 written on it, then the swap.
#[idempotent(key = key, operation = "swap.ext", fingerprint(key), mode = external, scope = none)]
#[retryable(max = 1, deadline_ms = 10000)]
async fn ext_swapper(
    db: &mut Deferred<'_>,
    key: &str,
    how: How,
    kit: &Kit,
) -> Result<String, AppError> {
    let conn = db.conn().await?;
    insert_effect(conn, key, 1).await?;
    swap_in(conn, key, how, kit).await?;
    Ok("receipt".to_owned())
}

fn kit(pool: &Pool, url: &str) -> Kit {
    let (pool, url, pids) = (pool.clone(), url.to_owned(), Pids::default());
    Kit { pool, url, pids }
}

/// Backends (of the test database) `cond` counts, once none, or after 5 s.
async fn backends_where(env: &Env, cond: &str) -> i64 {
    let db = env.db.name();
    let query = format!("SELECT count(*) FROM pg_stat_activity WHERE datname = '{db}' AND {cond}");
    for _ in 0..50 {
        if env.scalar(&query).await == 0 {
            return 0;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    env.scalar(&query).await
}

const IDLE_IN_TRANSACTION: &str = "state LIKE 'idle in transaction%'";

/// The pool serves three fresh keys (each called twice) as it should.
async fn pool_works(env: &Env, pool: &Pool, tag: &str) -> Option<String> {
    let (next, written) = next_callers(env, pool, tag).await;
    let like = format!("SELECT count(*) FROM idem_requests WHERE key LIKE '{tag}-next-%'");
    let recs = env.scalar(&like).await;
    let fine = written == 6 && recs == 3 && next.iter().all(|s| s == "Ok(false)/Ok(true)");
    (!fine).then(|| format!("next callers {next:?} +{written}, {recs} records"))
}

/// Every shape of swap, every end, in local mode and (`plain`) under a
/// plain `#[retryable]`. Undone before the body returns, a swap commits as
/// usual (effects 1, 2, 3, with the record; a repeat replays). Otherwise:
/// `ConnectionReplaced` whatever the body returned (a panic aside), no
/// record (a decline is not stored either), nothing written on idem's connection
/// or in the transaction begun on the one swapped in commits, the one the
/// slot held at the end is closed, nothing is left idle in a transaction,
/// and the pool serves later calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_swap_local_every_shape_and_end() {
    let env = env(2).await;
    let direct = !env.db.via().is_transaction_pooling();
    let other = TestDatabase::create().await.expect("a second database");
    let side = side_connection(other.url()).await;
    side.batch_execute(SCHEMA).await.unwrap();
    let mut cases = vec![];
    for how in [How::Pooled, How::PooledTwice, How::Own] {
        for end in [End::Ok, End::Err, End::Declined, End::Panic] {
            cases.push((how, end, env.db.url(), false));
        }
    }
    cases.push((How::Own, End::Ok, other.url(), false));
    for how in [How::OwnAndBack, How::PooledAndBack] {
        cases.push((how, End::Ok, env.db.url(), false));
    }
    for how in [How::Pooled, How::PooledTwice, How::Own, How::OwnAndBack] {
        cases.push((how, End::Ok, env.db.url(), true));
    }
    let mut bad = vec![];
    for (i, (how, end, url, plain)) in cases.into_iter().enumerate() {
        let pool = pool_of(&env.db, 3);
        let key = format!("sw-{i}");
        let kit = kit(&pool, url);
        let call = |kit: Kit| {
            let key = key.clone();
            let task = tokio::spawn(async move {
                let (pool, shown) = (&kit.pool, |e: AppError| format!("{e:?}"));
                match plain {
                    true => plain_swapper(pool, &key, how, &kit).await.map(|_| false),
                    false => swapper(pool, &key, how, end, &kit)
                        .await
                        .map(|v| v.replayed),
                }
                .map_err(shown)
            });
            async move { task.await.unwrap_or_else(|_| Err("panic".to_owned())) }
        };
        let r = call(kit.clone()).await;
        let (effects, records) = (env.effects(&key).await, records_of(&env, &key).await);
        let back = matches!(how, How::OwnAndBack | How::PooledAndBack);
        let mut again = None;
        let fine = if back {
            if !plain {
                again = Some(call(kit.clone()).await);
            }
            let replayed = again.as_ref().is_none_or(|a| a == &Ok(true));
            r == Ok(false) && replayed && effects == 3 && records == i64::from(!plain)
        } else {
            // Whatever the body returned: neither its error nor a decline
            // (which is not stored) is the answer.
            let said = match end {
                End::Panic => "panic",
                _ => "Idem(ConnectionReplaced",
            };
            let outcome = r.as_ref().is_err_and(|e| e.starts_with(said));
            outcome && records == 0 && effects == 0
        };
        let outs = env.effects(&format!("{key}-out")).await;
        let last = kit.pids.lock().unwrap().last().copied().unwrap_or(0);
        let alive = (direct && !back).then(|| format!("pid = {last}"));
        let left = backends_where(&env, alive.as_deref().unwrap_or("false")).await;
        let open = backends_where(&env, IDLE_IN_TRANSACTION).await;
        let after = pool_works(&env, &pool, &key).await;
        if !fine || outs != 0 || left != 0 || open != 0 || after.is_some() {
            bad.push(format!(
                "{how:?}/{end:?} (plain {plain}) on {url}: {r:?} {again:?} -> effects {effects} \
                 (out {outs}) records {records}; slot's still alive {left}, idle in \
                 transaction {open}; {after:?}"
            ));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// The body swaps with a second checkout of the same pool and, done, drops
/// that checkout as any code would: back to the pool. It holds idem's
/// connection now, with idem's transaction open (its advisory lock on the
/// key, the body's effect 1). The docs: idem's transaction "rolls back when
/// that one closes". Nothing was committed for the key, so the same key,
/// called again, must run at once.
// Found by this pass: idem's connection went back to the idle queue idle
// in transaction (recycle checks run at checkout only, and deadpool hands
// out the oldest idle connection first), and the same key's next call
// waited on the advisory lock for its whole 10 s deadline. The connection
// taken away is now severed (`Wire::sever`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_swap_pooled_checkout_returns_idems_transaction_to_the_pool() {
    let env = env(2).await;
    let pool = pool_of(&env.db, 3);
    let (a, b) = (pool.get().await.unwrap(), pool.get().await.unwrap());
    drop((a, b, pool.get().await.unwrap())); // three idle, oldest first
    let kit = kit(&pool, env.db.url());
    let r = swapper(&pool, "ret", How::PooledDropped, End::Ok, &kit).await;
    let open = backends_where(&env, IDLE_IN_TRANSACTION).await;
    let started = Instant::now();
    let again = swapper(&pool, "ret", How::OwnAndBack, End::Ok, &kit).await;
    let took = started.elapsed();
    let (effects, records) = (env.effects("ret").await, records_of(&env, "ret").await);
    assert!(matches_idem(&r, "ConnectionReplaced"), "{r:?}");
    assert!(
        open == 0 && matches!(&again, Ok(v) if !v.replayed) && (effects, records) == (3, 1),
        "idle in transaction after the call: {open}; the same key again: {again:?} after \
         {took:?}, effects {effects} records {records}"
    );
}

/// External mode, phase 3: the body swaps the outcome's connection. The
/// docs: phase 3 is "the one transaction that records the outcome together
/// with the body's local writes", and a swap commits nothing. So the call
/// must not answer `Ok`, the key must not say `completed` without the
/// body's effect 1, and a retry must not replay a success whose local
/// writes are gone.
// Found by this pass (`PooledIdle`, direct and through PgBouncer): the
// outcome's `UPDATE .. SET state = 'completed'` went to the connection in
// the slot before any check of the session key, and committed at once on
// one with no transaction open: `ConnectionReplaced`, effect 1 rolled back,
// the key `completed`, and a retry replayed `Ok("receipt")`. The key is now
// checked before the record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_swap_external_phase_three_records_on_the_swapped_in_connection() {
    let env = env(2).await;
    let mut seen = vec![];
    let shapes = [How::Pooled, How::PooledIdle, How::OwnAndBack];
    for (i, how) in shapes.into_iter().enumerate() {
        let pool = pool_of(&env.db, 3);
        let (key, kit) = (format!("xsw-{i}"), kit(&pool, env.db.url()));
        let r = ext_swapper(&pool, &key, how, &kit).await;
        let (effects, state) = (env.effects(&key).await, env.state(&key).await);
        let again = ext_swapper(&pool, &key, how, &kit).await;
        let effects2 = env.effects(&key).await;
        seen.push(format!(
            "{how:?}: {r:?} -> effects {effects} record {state:?}; again {again:?} -> effects {effects2}"
        ));
        let fine = if how == How::OwnAndBack {
            r.is_ok() && effects == 3 && state.as_deref() == Some("completed")
        } else {
            // Phase 3 did not commit: the outcome is not known.
            let replayed_ok = matches!(&again, Ok(v) if v.replayed);
            let unknown = state.as_deref() == Some("unknown");
            matches_idem(&r, "ConnectionReplaced") && effects == 0 && unknown && !replayed_ok
        };
        if !fine || effects2 != effects {
            seen.push("^^^ BAD".to_owned());
        }
    }
    assert!(!seen.iter().any(|s| s == "^^^ BAD"), "{}", seen.join("\n"));
}

// ---------------------------------------------------------------------------
// Session state
// ---------------------------------------------------------------------------

/// Notes its backend's pid in `pids`, runs `sql`, writes an effect.
#[idempotent(key = key, scope = none, fingerprint(key))]
#[retryable(max = 1, deadline_ms = 5000)]
async fn pid_after(
    conn: &mut AsyncPgConnection,
    key: &str,
    sql: &str,
    pids: &Pids,
) -> Result<i32, AppError> {
    let p = pid(conn).await;
    pids.lock().unwrap().push(p);
    if !sql.is_empty() {
        conn.batch_execute(sql).await?;
    }
    insert_effect(conn, key, 1).await?;
    Ok(p)
}

#[retryable(max = 1, deadline_ms = 5000)]
async fn plain_pid(conn: &mut AsyncPgConnection) -> Result<i32, AppError> {
    Ok(pid(conn).await)
}

fn backends(pids: &Pids) -> usize {
    let mut all = pids.lock().unwrap().clone();
    all.sort_unstable();
    all.dedup();
    all.len()
}

/// A role of the cluster, named for this process; created with `then`.
async fn role(env: &Env, name: &str, then: &str) -> String {
    let role = format!("idem_swap_{name}_{}", std::process::id());
    let sql = format!("CREATE ROLE {role}; {}", then.replace("{r}", &role));
    env.client.batch_execute(&sql).await.unwrap();
    role
}

async fn drop_role(env: &Env, role: &str) {
    tokio::time::sleep(Duration::from_millis(200)).await;
    let sql = format!("DROP OWNED BY {role}; DROP ROLE {role}");
    env.client.batch_execute(&sql).await.unwrap();
}

/// Transaction-local changes, session changes undone before the body
/// returns, and resets to start-up values leave nothing to see: on a pool
/// of one, each call (and its replay) works, and all run on one backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_swap_local_or_undone_session_changes_keep_the_connection() {
    let env = env(2).await;
    let nobody = role(&env, "nobody", "").await;
    let statements = [
        "SET LOCAL default_transaction_read_only = on",
        "SELECT set_config('default_transaction_read_only', 'on', true)",
        "DO $$ BEGIN PERFORM set_config('default_transaction_read_only', 'on', true); END $$",
        "SET default_transaction_read_only = on; SET default_transaction_read_only = off",
        "SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY; RESET default_transaction_read_only",
        "SET SESSION AUTHORIZATION DEFAULT",
        "SET SESSION AUTHORIZATION {n}; RESET SESSION AUTHORIZATION",
        "SET SESSION AUTHORIZATION {n}; SET SESSION AUTHORIZATION DEFAULT",
        "SET ROLE {n}; RESET ROLE",
        "SET LOCAL ROLE {n}; RESET ROLE",
        "RESET ALL",
        "SAVEPOINT s; SET default_transaction_read_only = on; ROLLBACK TO SAVEPOINT s",
    ]
    .map(|sql| sql.replace("{n}", &nobody));
    let (pool, pids) = (pool_of(&env.db, 1), Pids::default());
    let mut bad = vec![];
    for (i, sql) in statements.iter().enumerate() {
        for j in 0..2 {
            let key = format!("keep-{i}-{j}");
            let r = pid_after(&pool, &key, sql, &pids).await;
            let again = pid_after(&pool, &key, sql, &pids).await;
            let n = (env.effects(&key).await, records_of(&env, &key).await);
            let fine = matches!((&r, &again), (Ok(a), Ok(b)) if !a.replayed && b.replayed);
            if !fine || n != (1, 1) {
                bad.push(format!("{sql}: {r:?} / {again:?}, effects, records {n:?}"));
            }
        }
    }
    drop_role(&env, &nobody).await;
    // Behind PgBouncer the pids are its server connections'.
    if !env.db.via().is_transaction_pooling() && backends(&pids) != 1 {
        bad.push(format!("backends used: {}", backends(&pids)));
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// Committed forms the server reports however they are made (a function,
/// a DO block, `set_config`), by a plain `#[retryable]` transaction: the
/// connection goes, the next calls on the pool of one work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_swap_session_state_set_from_functions_and_blocks() {
    let env = env(2).await;
    let nobody = role(&env, "fnobody", "").await;
    env.client
        .batch_execute(
            "CREATE FUNCTION go_read_only() RETURNS void LANGUAGE plpgsql AS
               $$ BEGIN EXECUTE 'SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY'; END $$",
        )
        .await
        .unwrap();
    let statements = [
        "SELECT set_config('default_transaction_read_only', 'on', false)",
        "DO $$ BEGIN PERFORM set_config('default_transaction_read_only', 'on', false); END $$",
        "SELECT go_read_only()",
        "DO $$ BEGIN SET SESSION AUTHORIZATION {n}; END $$",
        "SELECT set_config('session_authorization', '{n}', false)",
        "SELECT set_config('role', '{n}', false)",
    ]
    .map(|sql| sql.replace("{n}", &nobody));
    let mut bad = vec![];
    for (i, sql) in statements.iter().enumerate() {
        let pool = pool_of(&env.db, 1);
        let r = plain(&pool, sql).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        let after = pool_works(&env, &pool, &format!("fn-{i}")).await;
        // Behind PgBouncer the state stays on its server connection (documented).
        if r.is_err() || (after.is_some() && !env.db.via().is_transaction_pooling()) {
            bad.push(format!("{sql}: {r:?}; {after:?}"));
        }
    }
    drop_role(&env, &nobody).await;
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// An operator made the role read-only by default (`ALTER ROLE .. SET
/// default_transaction_read_only = on`): connections start so, which is no
/// drift, and reads keep their one connection. (Idempotent calls cannot
/// write their record there: each is refused with 25006 and, as documented,
/// closes its connection; counted, not asserted: 5 calls, 5 backends.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_swap_role_read_only_by_default_is_not_drift() {
    let env = env(2).await;
    let grants = "ALTER ROLE {r} LOGIN; ALTER ROLE {r} SET default_transaction_read_only = on;
         GRANT ALL ON ALL TABLES IN SCHEMA public TO {r};
         GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {r}";
    let app = role(&env, "ro", grants).await;
    let url = env
        .db
        .url()
        .replacen("://postgres@", &format!("://{app}@"), 1);
    let (max_size, pooler) = (1, Pooler::Direct);
    let config = PoolConfig {
        max_size,
        pooler,
        ..PoolConfig::default()
    };
    let pool = build_pool_with(&url, &config).unwrap();
    let (mut reads, writes) = (vec![], Pids::default());
    for _ in 0..5 {
        reads.push(plain_pid(&pool).await.unwrap());
    }
    let mut refused = vec![];
    for i in 0..5 {
        let r = pid_after(&pool, &format!("ro-{i}"), "", &writes).await;
        refused.push(r.is_err_and(|e| e.to_string().contains("read-only transaction")));
    }
    drop(pool);
    drop_role(&env, &app).await;
    eprintln!(
        "read-only role: 5 idempotent calls, {} backends",
        backends(&writes)
    );
    assert_eq!(refused, [true; 5]);
    assert_eq!(records_of(&env, "ro-0").await, 0);
    assert!(reads.iter().all(|p| *p == reads[0]), "{reads:?}");
}

/// Writes an effect after an application check that raises 42501 inside a
/// savepoint (`conn.transaction`) and is caught there (an authorization
/// check in a function, a row-level security refusal handled by the app).
#[idempotent(key = key, scope = none, fingerprint(key))]
#[retryable(max = 1, deadline_ms = 5000)]
async fn refused_then_fine(conn: &mut AsyncPgConnection, key: &str) -> Result<i32, AppError> {
    let check = conn
        .transaction::<_, diesel::result::Error, _>(async |c| {
            c.batch_execute("DO $$ BEGIN RAISE EXCEPTION 'no' USING ERRCODE = '42501'; END $$")
                .await
        })
        .await;
    assert!(check.is_err(), "the check refuses");
    insert_effect(conn, key, 1).await?;
    Ok(pid(conn).await)
}

/// A refusal for rights that the body caught in a savepoint, in a call that
/// committed with its record: the session is fine (idem's own record was
/// written on it, last), so the connection should stay pooled.
// Found by this pass: 10 committed calls, 10 backends on a pool of one
// (every 42501 of the transaction counted, one a savepoint undid too). Only
// a refusal that failed the transaction counts now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_swap_caught_refusal_churns_a_connection_per_call() {
    let env = env(2).await;
    if env.db.via().is_transaction_pooling() {
        // Through a transaction pooler the backends are the pooler's server
        // connections, which say nothing of idem's own to the pooler; the
        // recycle check under test is the same code either way.
        return;
    }
    let pool = pool_of(&env.db, 1);
    let (calm_pids, started) = (Pids::default(), Instant::now());
    for i in 0..10 {
        let r = pid_after(&pool, &format!("calm-{i}"), "", &calm_pids).await;
        assert!(matches!(&r, Ok(v) if !v.replayed), "{r:?}");
    }
    let calm = started.elapsed();
    let (pids, started) = (Pids::default(), Instant::now());
    for i in 0..10 {
        let r = refused_then_fine(&pool, &format!("churn-{i}")).await;
        assert!(matches!(&r, Ok(v) if !v.replayed), "{r:?}");
        pids.lock().unwrap().push(r.unwrap().value);
    }
    let churned = started.elapsed();
    let like = "SELECT count(*) FROM idem_requests WHERE key LIKE 'churn-%'";
    assert_eq!(
        (env.effects("churn-0").await, env.scalar(like).await),
        (1, 10)
    );
    let (n, calm_n) = (backends(&pids), backends(&calm_pids));
    let line = format!("10 committed calls: {n} backends in {churned:?} (without the caught refusal: {calm_n} in {calm:?})");
    eprintln!("{line}");
    assert_eq!(n, 1, "{line}");
}
