//! What the hostile passes share (`attack_session40` to `45`): a
//! body built from steps, the ways it ends, the call shapes it runs under,
//! one call given up at a point (duplicates queued behind it), what is
//! wrong with a key afterwards, and the report of what each case found.
use super::*;
use futures_util::future::{join_all, BoxFuture};
use futures_util::FutureExt;
use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use tokio::sync::Notify;

pub(super) const TEN: Duration = Duration::from_secs(10);
pub(super) type Res = Result<i64, AppError>;

/// Polls `f` once, whether or not it is ready.
async fn poll_once<F: std::future::Future + Unpin>(f: &mut F) -> std::task::Poll<F::Output> {
    std::future::poll_fn(|cx| std::task::Poll::Ready(std::pin::Pin::new(&mut *f).poll(cx))).await
}

/// One step of a body (`{k}`: the key). `Q`: `batch_execute` polled once,
/// then dropped (queued in tokio-postgres); `W`: awaited, its error ignored;
/// `E`: awaited, its error returned; `D`: `sql_query(..).execute` awaited
/// (extended protocol); `X`: `sql_query(..).execute` polled until its
/// `Parse` is answered, polled once more (its `Bind`/`Execute` by the
/// statement's name queued), dropped; `Ms`: a sleep (the driver writes what
/// is queued); `Nest`: `conn.transaction(..)` inserting n = 3, then the
/// statement (polled once when `true`, else awaited), then `Err` (the
/// savepoint rolled back); `J`: the requests pipelined through
/// `&AsyncPgConnection` with `join_all`, awaited (an `x:` prefix: through
/// `diesel::sql_query`, the extended protocol); `Jq`: the same polled once
/// and dropped; `Y`: that many yields to the scheduler.
#[rustfmt::skip]
#[derive(Clone, Copy, Debug)]
pub(super) enum A { Q(&'static str), W(&'static str), E(&'static str), D(&'static str), X(&'static str),
    Ms(u64), Nest(&'static str, bool), J(&'static [&'static str]), Jq(&'static [&'static str]), Y(u32) }
pub(super) use A::*;

/// How the body ends (`HANG`: waits, the caller gives up once it is
/// reached; `INVALID`: `nothing_sent`).
#[rustfmt::skip]
pub(super) mod ends { pub const OK: u8 = 0; pub const FINAL: u8 = 1; pub const PLAIN: u8 = 2;
    pub const PANIC: u8 = 3; pub const HANG: u8 = 4; pub const INVALID: u8 = 5; }
pub(super) use ends::*;
pub(super) const N2: &str = "INSERT INTO effects (tag, n) VALUES ('{k}', 2)";
pub(super) const N3: &str = "INSERT INTO effects (tag, n) VALUES ('{k}', 3)";

/// A `COMMIT` that takes `ms` and then succeeds or fails (`slowc`), or
/// fails as a serialization failure (`serc`): deferred triggers.
pub(super) const SLOW_COMMITS: &str =
    "CREATE TABLE slowc (tag text NOT NULL, ms int NOT NULL, fail bool NOT NULL);
    CREATE FUNCTION slowc_f() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
      PERFORM pg_sleep(NEW.ms / 1000.0);
      IF NEW.fail THEN RAISE EXCEPTION 'slowc: the deferred check fails'; END IF;
      RETURN NULL; END $$;
    CREATE CONSTRAINT TRIGGER slowc_t AFTER INSERT ON slowc DEFERRABLE INITIALLY DEFERRED
      FOR EACH ROW EXECUTE FUNCTION slowc_f();
    CREATE TABLE serc (tag text NOT NULL, ms int NOT NULL);
    CREATE FUNCTION serc_f() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
      PERFORM pg_sleep(NEW.ms / 1000.0);
      RAISE EXCEPTION 'serc: could not serialize' USING ERRCODE = '40001'; END $$;
    CREATE CONSTRAINT TRIGGER serc_t AFTER INSERT ON serc DEFERRABLE INITIALLY DEFERRED
      FOR EACH ROW EXECUTE FUNCTION serc_f();";
pub(super) const OK0: &str = "INSERT INTO slowc VALUES ('{k}', 0, false)";
pub(super) const BAD0: &str = "INSERT INTO slowc VALUES ('{k}', 0, true)";
pub(super) const OK3: &str = "INSERT INTO slowc VALUES ('{k}', 300, false)";
pub(super) const BAD3: &str = "INSERT INTO slowc VALUES ('{k}', 300, true)";
pub(super) const OK15: &str = "INSERT INTO slowc VALUES ('{k}', 1500, false)";
pub(super) const BAD15: &str = "INSERT INTO slowc VALUES ('{k}', 1500, true)";
pub(super) const SER0: &str = "INSERT INTO serc VALUES ('{k}', 0)";
pub(super) const SER3: &str = "INSERT INTO serc VALUES ('{k}', 300)";

/// A deferred check that ignores cancels: it sleeps in 50 ms slices, each
/// one's `query_canceled` caught, until `ms` have passed, then fails or not.
pub(super) const STUBBORN: &str =
    "CREATE TABLE stubc (tag text NOT NULL, ms int NOT NULL, fail bool NOT NULL);
    CREATE FUNCTION stubc_f() RETURNS trigger LANGUAGE plpgsql AS $$
    DECLARE t0 timestamptz := clock_timestamp(); BEGIN
      WHILE clock_timestamp() < t0 + make_interval(secs => NEW.ms / 1000.0) LOOP
        BEGIN PERFORM pg_sleep(0.05); EXCEPTION WHEN query_canceled THEN NULL; END;
      END LOOP;
      IF NEW.fail THEN RAISE EXCEPTION 'stubc: the deferred check fails'; END IF;
      RETURN NULL; END $$;
    CREATE CONSTRAINT TRIGGER stubc_t AFTER INSERT ON stubc DEFERRABLE INITIALLY DEFERRED
      FOR EACH ROW EXECUTE FUNCTION stubc_f();";

/// A `COMMIT` taking `ms` through `table`'s deferred trigger.
pub(super) fn slow(table: &str, ms: u64, fail: bool) -> &'static str {
    let s = format!("INSERT INTO {table} VALUES ('{{k}}', {ms}, {fail})");
    Box::leak(s.into_boxed_str())
}

/// [`env`] with the slow `COMMIT`s' tables.
pub(super) async fn env_slow(size: usize) -> Env {
    let env = env(size).await;
    env.client
        .batch_execute(SLOW_COMMITS)
        .await
        .expect("slow commits");
    env
}

/// A body: its steps after the effect (n = 1), then its end.
pub(super) struct Q {
    pub(super) steps: &'static [A],
    pub(super) end: u8,
}
#[rustfmt::skip]
pub(super) const EMPTY: Q = Q { steps: &[], end: OK };

fn pipe<'a>(c: &'a AsyncPgConnection, key: &str, parts: &[&str]) -> Vec<BoxFuture<'a, ()>> {
    let f = |s: &&str| {
        let s = s.replace("{k}", key);
        async move {
            let mut c = c;
            match s.strip_prefix("x:") {
                Some(x) => drop(diesel::sql_query(x).execute(&mut c).await),
                None => drop(c.batch_execute(&s).await),
            }
        }
        .boxed()
    };
    parts.iter().map(f).collect()
}

#[rustfmt::skip]
async fn body(conn: &mut AsyncPgConnection, key: &str, q: &Q, reached: &Notify) -> Res {
    let id = insert_effect(conn, key, 1).await?;
    for step in q.steps {
        match *step {
            Q(s) => drop(conn.batch_execute(&s.replace("{k}", key)).now_or_never()),
            W(s) => drop(conn.batch_execute(&s.replace("{k}", key)).await),
            D(s) => drop(diesel::sql_query(s.replace("{k}", key)).execute(conn).await),
            X(s) => {
                let mut f = Box::pin(diesel::sql_query(s.replace("{k}", key)).execute(conn));
                if poll_once(&mut f).await.is_pending() {
                    tokio::time::sleep(Duration::from_millis(30)).await;
                    let _ = poll_once(&mut f).await;
                }
            }
            E(s) => conn.batch_execute(&s.replace("{k}", key)).await?,
            Ms(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
            Nest(s, queued) => {
                let (s, key) = (s.replace("{k}", key), key.to_owned());
                let _ = conn.transaction::<(), AppError, _>(async |c| {
                    insert_effect(c, &key, 3).await?;
                    match queued {
                        true => drop(c.batch_execute(&s).now_or_never()),
                        false => drop(c.batch_execute(&s).await),
                    }
                    Err(AppError::Timeout)
                }).await;
            }
            J(parts) => drop(join_all(pipe(conn, key, parts)).await),
            Jq(parts) => drop(join_all(pipe(conn, key, parts)).now_or_never()),
            Y(n) => for _ in 0..n { tokio::task::yield_now().await },
        }
    }
    reached.notify_one();
    match q.end {
        OK => Ok(id),
        FINAL => Err(AppError::Declined(Declined::InsufficientFunds { needed: 1 })),
        PLAIN => Err(AppError::Timeout),
        INVALID => Err(AppError::Invalid),
        PANIC => panic!("kit: the body panics"),
        _ => { tokio::time::sleep(Duration::from_secs(60)).await; Ok(id) }
    }
}

macro_rules! local {
    ($name:ident, $iso:ident, $max:tt) => {
        #[idempotent(key = key, fingerprint(key), scope = none)]
        #[retryable(max = $max, deadline_ms = 20000, commit_timeout_ms = 3000, isolation = $iso)]
        async fn $name(conn: &mut AsyncPgConnection, key: &str, q: &Q, r: &Notify) -> Res {
            body(conn, key, q, r).await
        }
    };
}
local!(s_rc, read_committed, 1);
local!(s_rr, repeatable_read, 1);
local!(s_sr, serializable, 1);
local!(s_rc4, read_committed, 4);

macro_rules! plain {
    ($name:ident, $max:tt) => {
        #[retryable(max = $max, deadline_ms = 20000, commit_timeout_ms = 3000)]
        async fn $name(conn: &mut AsyncPgConnection, key: &str, q: &Q, r: &Notify) -> Res {
            body(conn, key, q, r).await
        }
    };
}
plain!(s_plain, 1);
plain!(s_pl4, 4);

#[idempotent(key = key, fingerprint(key), scope = none, mode = external)]
#[retryable(max = 1, deadline_ms = 20000, commit_timeout_ms = 3000)]
async fn s_ext(db: &mut Deferred<'_>, key: &str, q: &Q, r: &Notify) -> Res {
    body(db.conn().await?, key, q, r).await
}

/// The call shape: local mode at an isolation level (`Rc4`: `max = 4`),
/// external mode, or a plain `#[retryable]` (`Pl4`: `max = 4`).
#[rustfmt::skip]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum V { Rc, Rr, Sr, Ext, Plain, Rc4, Pl4 }

/// The call's answer; a replay's value negated.
pub(super) async fn call(pool: &Pool, v: V, key: &str, q: &Q, r: &Notify) -> Res {
    let answer = match v {
        V::Rc => s_rc(pool, key, q, r).await,
        V::Rr => s_rr(pool, key, q, r).await,
        V::Sr => s_sr(pool, key, q, r).await,
        V::Ext => s_ext(pool, key, q, r).await,
        V::Rc4 => s_rc4(pool, key, q, r).await,
        V::Plain => return s_plain(pool, key, q, r).await,
        V::Pl4 => return s_pl4(pool, key, q, r).await,
    };
    answer.map(|v| if v.replayed { -v.value } else { v.value })
}

/// Whether `v` is a plain `#[retryable]` call (no key, no record).
#[rustfmt::skip]
pub(super) fn plain(v: V) -> bool { matches!(v, V::Plain | V::Pl4) }

/// One call; `HANG` is given up once the body reached its end, or after
/// `drop_us` µs from the start when that is set.
pub(super) async fn one(pool: &Pool, v: V, key: &str, q: &Q, drop_us: Option<u64>) -> String {
    let reached = Notify::new();
    let call = AssertUnwindSafe(call(pool, v, key, q, &reached)).catch_unwind();
    let out = |r: Result<Res, _>| r.map_or("panicked".to_owned(), |r| format!("{r:?}"));
    if let Some(us) = drop_us {
        let r = tokio::time::timeout(Duration::from_micros(us), call).await;
        return r.map_or("dropped".to_owned(), out);
    }
    tokio::select! {
        r = call => out(r),
        () = reached.notified(), if q.end == HANG => "dropped".to_owned(),
    }
}

/// The rows of effect `n` under `key`.
pub(super) async fn n_of(env: &Env, key: &str, n: i64) -> i64 {
    let sql = "SELECT count(*) FROM effects WHERE tag = $1 AND n = $2";
    env.client.query_one(sql, &[&key, &n]).await.unwrap().get(0)
}

/// A case: `(prefix, V, steps, ends, trials, flags)`.
pub(super) struct C(
    pub(super) &'static str,
    pub(super) V,
    pub(super) &'static [A],
    pub(super) &'static [u8],
    pub(super) usize,
    pub(super) u8,
);

/// Each case's summary and its first problems printed; fails on any.
pub(super) fn report(results: Vec<(Vec<String>, String)>) {
    let mut all = Vec::new();
    for (problems, summary) in results {
        eprintln!("{summary}");
        problems.iter().take(8).for_each(|p| eprintln!("  {p}"));
        all.extend(problems);
    }
    let first = <[_]>::first(&all);
    assert!(all.is_empty(), "{} problems: {first:?}", all.len());
}

pub(super) const ALL_ENDS: &[u8] = &[OK, FINAL, PLAIN, PANIC, HANG];

/// Each call of case `c`, one after another, each in a task of its own:
/// `(key, end, answer)`, and how many gave each answer.
pub(super) async fn each(
    pool: &Pool,
    c: &C,
) -> (Vec<(String, u8, String)>, BTreeMap<String, usize>) {
    let &C(prefix, v, steps, ends, trials, _) = c;
    let (mut keys, mut answers) = (Vec::new(), BTreeMap::<String, usize>::new());
    for &end in ends {
        for t in 0..trials {
            let key = format!("{prefix}-{end}-{t}");
            let (pool, k) = (pool.clone(), key.clone());
            let task =
                tokio::spawn(async move { one(&pool, v, &k, &Q { steps, end }, None).await });
            let answer = task.await.unwrap_or_else(|_| "task panicked".to_owned());
            let short: String = answer.chars().take(60).collect();
            *answers.entry(format!("[end {end}] {short}")).or_default() += 1;
            keys.push((key, end, answer));
        }
    }
    (keys, answers)
}

/// No backend idle in a transaction or still sleeping; the pool still
/// serves.
pub(super) async fn hygiene(env: &Env, pool: &Pool, prefix: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let idle = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                AND pid <> pg_backend_pid() AND (state LIKE 'idle in transaction%' \
                OR (state = 'active' AND query ~ 'pg_sleep|slowc|serc'))";
    if !eventually(TEN, || async { env.scalar(idle).await == 0 }).await {
        problems.push(format!(
            "{prefix}: backends left idle in a transaction or sleeping"
        ));
    }
    for i in 0..2 {
        let key = format!("{prefix}-health-{i}");
        let r = tokio::time::timeout(TEN, call(pool, V::Rc, &key, &EMPTY, &Notify::new())).await;
        if !matches!(r, Ok(Ok(_))) || env.effects(&key).await != 1 {
            problems.push(format!("{prefix}: a later call on the pool: {r:?}"));
        }
    }
    problems
}

/// Waits `ms` (past the slowest statement a body queued), then until every
/// key under `prefix` with an effect has a record (background holds land).
pub(super) async fn settle_holds(env: &Env, prefix: &str, ms: u64) {
    tokio::time::sleep(Duration::from_millis(ms)).await;
    let like = format!("{prefix}-%");
    let unheld = "SELECT count(DISTINCT tag) FROM effects e WHERE e.tag LIKE $1 AND NOT EXISTS \
                  (SELECT 1 FROM idem_requests r WHERE r.key = e.tag)";
    let none_unheld = || async {
        let n: i64 = env.client.query_one(unheld, &[&like]).await.unwrap().get(0);
        n == 0
    };
    if !eventually(TEN, none_unheld).await {
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// The key's call repeated once (`EMPTY`): over a key left free it runs
/// again, over a record or a hold it must not (`effects`: before it).
pub(super) async fn repeats(
    env: &Env,
    pool: &Pool,
    v: V,
    key: &str,
    what: &str,
    recorded: bool,
    effects: i64,
) -> Option<String> {
    let again = tokio::time::timeout(TEN / 2, call(pool, v, key, &EMPTY, &Notify::new())).await;
    let after = env.effects(key).await;
    match recorded {
        false if after != effects + 1 => Some(format!(
            "{what}: key free, repeat {again:?}, effects then {after}"
        )),
        true if after != effects => Some(format!("{what}: held or done, repeat ran: {again:?}")),
        _ => None,
    }
}

/// One key: the call (dropped after `us` µs, else run to its end or given
/// up at `HANG`), `dups` duplicates started 5 ms after it (queued on the
/// pool): the call's answer, how long it took, and the duplicates' answers.
#[rustfmt::skip]
pub(super) async fn with_dups(pool: &Pool, v: V, key: &str, steps: &'static [A], end: u8,
    us: Option<u64>, dups: usize) -> (String, Duration, Vec<String>) {
    let (p, k) = (pool.clone(), key.to_owned());
    let first = tokio::spawn(async move {
        let started = Instant::now();
        let ans = one(&p, v, &k, &Q { steps, end }, us).await;
        (ans, started.elapsed())
    });
    tokio::time::sleep(Duration::from_millis(5)).await;
    let mut tasks = Vec::new();
    for _ in 0..dups {
        let (p, k) = (pool.clone(), key.to_owned());
        tasks.push(tokio::spawn(async move {
            let r = tokio::time::timeout(TEN * 2, call(&p, v, &k, &EMPTY, &Notify::new())).await;
            format!("{r:?}").chars().take(50).collect::<String>()
        }));
    }
    let (ans, took) = first.await.unwrap_or_else(|_| ("task panicked".into(), Duration::ZERO));
    let mut answers = Vec::new();
    for t in tasks {
        answers.push(t.await.unwrap_or_else(|_| "task panicked".into()));
    }
    (ans.chars().take(70).collect(), took, answers)
}

/// What is wrong with `key` (settled): more than `most` effects (on a pool
/// of two, a duplicate waiting on the advisory lock may run again, as
/// documented), a write behind the body's `COMMIT` that ran, an effect with
/// its key free, a hold over nothing (unless `lax`: a `COMMIT` whose answer
/// never came).
#[rustfmt::skip]
pub(super) async fn wrong(env: &Env, v: V, key: &str, what: &str, most: i64, lax: bool)
    -> Option<String> {
    let (n1, n2) = (n_of(env, key, 1).await, n_of(env, key, 2).await);
    let state = env.record(key).await.map(|r| r.0);
    let what = format!("{key} [{what}]: n1 {n1} n2 {n2} rec {state:?}");
    eprintln!("  {what}");
    if n2 > 0 { return Some(format!("{what}: a write behind the body's COMMIT ran")); }
    if plain(v) { return None; }
    if n1 > most { return Some(format!("{what}: the effect committed more than {most}")); }
    if n1 > 0 && state.is_none() { return Some(format!("{what}: effect committed, key free")); }
    let over_nothing = n1 == 0 && state.as_deref() == Some("unknown");
    if v != V::Ext && over_nothing && !lax { return Some(format!("{what}: held over nothing")); }
    None
}

/// After [`hygiene`], `n` later calls on `pool`, local ones (one opening a
/// savepoint of its own: a broken transaction manager handed on would
/// refuse it) and plain ones.
pub(super) async fn later(env: &Env, pool: &Pool, p: &str, n: usize) -> Vec<String> {
    let mut bad = hygiene(env, pool, p).await;
    for i in 0..n {
        let key = format!("{p}-later-{i}");
        let steps: &'static [A] = [&[][..], &[Nest(N2, false)][..]][i % 2];
        let v = [V::Rc, V::Plain, V::Sr][i % 3];
        let q = Q { steps, end: OK };
        let r = tokio::time::timeout(TEN, call(pool, v, &key, &q, &Notify::new())).await;
        let (n1, n3) = (n_of(env, &key, 1).await, n_of(env, &key, 3).await);
        if !matches!(r, Ok(Ok(x)) if x > 0) || n1 != 1 || n3 != 0 {
            bad.push(format!(
                "{key} {v:?} {steps:?}: later call {r:?}, n1 {n1} n3 {n3}"
            ));
        }
    }
    bad
}

/// `first`, a queued `COMMIT`, `N2` queued behind it when `behind`, and a
/// 50 ms sleep when `on_wire` (the driver writes the `COMMIT` before the
/// body returns).
pub(super) fn commit_after(first: A, behind: bool, on_wire: bool) -> &'static [A] {
    let mut v = vec![first, Q("COMMIT")];
    if behind {
        v.push(Q(N2));
    }
    if on_wire {
        v.push(Ms(50));
    }
    Box::leak(v.into_boxed_slice())
}

/// One case of a [`sweep`]: the call shape, the body, its end, when the
/// call is dropped (µs; `None`: run to its end), and whether a hold over
/// nothing is allowed (`lax`: a `COMMIT` whose answer may never come).
pub(super) type Case = (V, &'static [A], u8, Option<u64>, bool);

/// Each case on `pool` with `dups` duplicates, settled `ms`; every key
/// checked ([`wrong`], and no `ok` record over an effect that never
/// committed), each call's time against `limit_ms` when given, then later
/// calls on the pool ([`later`]).
#[rustfmt::skip]
pub(super) async fn sweep(env: &Env, pool: &Pool, p: &str, cases: &[Case], dups: usize, ms: u64,
    limit_ms: Option<u128>) -> Vec<String> {
    let most = pool.status().max_size as i64;
    let (mut done, mut bad) = (Vec::new(), Vec::new());
    for (t, &(v, steps, end, us, lax)) in cases.iter().enumerate() {
        let key = format!("{p}-{t}");
        let (ans, took, dups) = with_dups(pool, v, &key, steps, end, us, dups).await;
        let what = format!("{v:?} {steps:?} end {end} drop {us:?} in {took:?}: {ans}; dups {dups:?}");
        if let Some(limit) = limit_ms.filter(|&limit| took.as_millis() > limit) {
            bad.push(format!("{key} [{what}]: answered after {took:?}, over {limit} ms"));
        }
        done.push((key, v, what, lax));
    }
    settle_holds(env, p, ms).await;
    for (key, v, what, lax) in &done {
        bad.extend(wrong(env, *v, key, what, most, *lax).await);
        let rec = env.record(key).await;
        let ok = rec.as_ref().is_some_and(|r| r.0 == "completed" && r.1.as_deref() == Some("ok"));
        if ok && n_of(env, key, 1).await == 0 {
            bad.push(format!("{key} [{what}]: recorded ok, no effect committed"));
        }
    }
    eprintln!("{p}: {} problems over {} keys", bad.len(), done.len());
    bad.extend(later(env, pool, p, 4).await);
    bad
}

/// The first problems printed; fails on any.
pub(super) fn verdict(bad: &[String]) {
    bad.iter().take(12).for_each(|b| eprintln!("  {b}"));
    assert!(bad.is_empty(), "{} problems: {:?}", bad.len(), bad.first());
}

/// Each case of `cases` (steps, end) called `trials` times in local mode,
/// each in a task of its own, keys `<p>-<case>-<end>-<trial>`: `(key, what
/// it answered, how long it took)`, once background holds had time to land.
pub(super) async fn spawned_calls(
    env: &Env,
    p: &str,
    cases: &[(&'static [A], u8)],
    trials: usize,
) -> Vec<(String, String, Duration)> {
    let mut out = Vec::new();
    for t in 0..trials {
        for (i, &(steps, end)) in cases.iter().enumerate() {
            let (pool, key) = (env.pool.clone(), format!("{p}-{i}-{end}-{t}"));
            let k = key.clone();
            let t0 = Instant::now();
            let task =
                tokio::spawn(async move { one(&pool, V::Rc, &k, &Q { steps, end }, None).await });
            let ans = task.await.unwrap_or_else(|_| "task panicked".into());
            out.push((key, format!("{steps:?} end {end}: {ans}"), t0.elapsed()));
        }
    }
    settle_holds(env, p, 2000).await;
    out
}

/// What one call did: its answer, how long it took, n1/n2/n3 and the
/// record's state.
pub(super) struct Seen {
    pub(super) ans: String,
    pub(super) took: Duration,
    pub(super) ns: (i64, i64, i64),
    pub(super) rec: Option<String>,
}

/// One call in a task of its own, given up after `cap` (answer `HUNG`),
/// then `settle_ms` for background holds to land.
#[rustfmt::skip]
pub(super) async fn probe(env: &Env, pool: &Pool, v: V, key: &str, q: (&'static [A], u8), cap: Duration,
    settle_ms: u64) -> Seen {
    let ((p, k), (steps, end)) = ((pool.clone(), key.to_owned()), q);
    let t0 = Instant::now();
    let task = tokio::spawn(async move {
        tokio::time::timeout(cap, one(&p, v, &k, &Q { steps, end }, None)).await
            .unwrap_or_else(|_| "HUNG".to_owned())
    });
    let ans = task.await.unwrap_or_else(|_| "task panicked".into());
    let took = t0.elapsed();
    tokio::time::sleep(Duration::from_millis(settle_ms)).await;
    let ns = (n_of(env, key, 1).await, n_of(env, key, 2).await, n_of(env, key, 3).await);
    let rec = env.record(key).await.map(|r| r.0);
    let ans: String = ans.chars().take(90).collect();
    eprintln!("  {key} {v:?} {steps:?} end {end}: {ans} in {took:?}; n {ns:?} rec {rec:?}");
    Seen { ans, took, ns, rec }
}

/// The key repeated once (`EMPTY`, local mode): the effects it added.
pub(super) async fn repeat_adds(env: &Env, key: &str) -> i64 {
    let before = env.effects(key).await;
    let r = Notify::new();
    let _ = tokio::time::timeout(TEN, call(&env.pool, V::Rc, key, &EMPTY, &r)).await;
    env.effects(key).await - before
}
