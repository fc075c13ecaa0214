//! helper-52's hostile pass on migration 17's planner-based guard
//! (`idem_create_once_arbiter` plans `INSERT .. ON CONFLICT (<cols>)`).
//! Every answer is checked against the rows in the table. `attack48_*` are
//! promises that held (or, where said, documented limits pinned);
//! `found_*` failed on the code they were written against (ff319de) and
//! pass since.

use diesel::sql_types::{Nullable, Text};

use super::attack_s46::{count_sql, env46};

use super::*;

mod logging;
mod races;
mod shapes;
mod standby;

diesel::table! {
    p48_orders (tenant_id, id) {
        tenant_id -> Int8,
        id -> Int8,
        request_id -> Text,
        amount -> Int8,
        version -> Int8,
    }
}

/// A tenant-keyed model whose table each test builds in its own shape.
#[derive(Debug, Clone, PartialEq, Queryable, Selectable, Versioned)]
#[diesel(table_name = p48_orders)]
#[versioned(tenant = tenant_id, key = id,
            create_once(key = request_id, fingerprint(amount)))]
pub(super) struct P48Order {
    tenant_id: i64,
    id: i64,
    request_id: String,
    amount: i64,
    version: i64,
}

pub(super) fn p48(tenant_id: i64, id: i64, key: &str) -> P48Order {
    P48Order {
        tenant_id,
        id,
        request_id: key.into(),
        amount: 5,
        version: 0,
    }
}

/// The plain shape: `UNIQUE (tenant_id, request_id)`.
pub(super) const P48_TABLE: &str = "CREATE TABLE p48_orders (
    tenant_id bigint NOT NULL, id bigint NOT NULL, request_id text NOT NULL,
    amount bigint NOT NULL, version bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant_id, id), CONSTRAINT p48_key UNIQUE (tenant_id, request_id))";

/// A fresh database with `ddl` run in it.
pub(super) async fn env48(size: usize, ddl: &str) -> Env {
    let env = env46(size).await;
    env.conn().await.batch_execute(ddl).await.unwrap();
    env
}

/// Rows of `p48_orders` (in whatever the search_path finds) under a key.
pub(super) async fn rows48(env: &Env, tenant: i64, key: &str) -> i64 {
    count_sql(
        env,
        &format!(
            "SELECT 1 FROM public.p48_orders WHERE tenant_id = {tenant} AND request_id = '{key}'"
        ),
    )
    .await
}

#[derive(QueryableByName, Debug)]
pub(super) struct Xid {
    #[diesel(sql_type = Nullable<Text>)]
    pub(super) xid: Option<String>,
}

pub(super) async fn xid(conn: &mut AsyncPgConnection) -> Option<String> {
    diesel::sql_query("SELECT pg_current_xact_id_if_assigned()::text AS xid")
        .get_result::<Xid>(conn)
        .await
        .unwrap()
        .xid
}

#[derive(QueryableByName, Debug)]
struct Lock {
    #[diesel(sql_type = Text)]
    rel: String,
    #[diesel(sql_type = Text)]
    mode: String,
}

/// The relation locks this session holds on `p48_orders` and its indexes.
async fn my_locks(conn: &mut AsyncPgConnection) -> Vec<(String, String)> {
    diesel::sql_query(
        "SELECT relation::regclass::text AS rel, mode FROM pg_locks
         WHERE pid = pg_backend_pid() AND locktype = 'relation'
           AND relation::regclass::text LIKE 'p48%' ORDER BY 1, 2",
    )
    .load::<Lock>(conn)
    .await
    .unwrap()
    .into_iter()
    .map(|l| (l.rel, l.mode))
    .collect()
}

/// A unique constraint made DEFERRABLE (on another column) after a
/// REPEATABLE READ / SERIALIZABLE transaction took its snapshot. The guard
/// still reads pg_index for deferrable constraints through the statement's
/// snapshot (the half of migration 16 that migration 17 kept), does not see
/// it, and passes; the INSERT then meets the deferrable index as an arbiter
/// and PostgreSQL raises 55000 "ON CONFLICT does not support deferrable
/// unique constraints/exclusion constraints as arbiters": an untyped
/// `CreateOnceError::Database`, where the same create one statement later
/// answers `NoUniqueIndex` (the guard's own deferrable refusal). Nothing is
/// written either way. Expected: `NoUniqueIndex` at both levels. Failed 5 of
/// 5 runs direct, 3 of 3 through PgBouncer (both levels each time).
/// Fixed: the INSERT's 55000 on it is answered `NoUniqueIndex`.
#[tokio::test]
async fn found_a_deferrable_constraint_after_the_snapshot_is_an_untyped_error() {
    let env = env48(
        2,
        &format!("{P48_TABLE}; ALTER TABLE p48_orders ADD COLUMN other text"),
    )
    .await;
    let mut answers = Vec::new();
    for (n, level) in ["REPEATABLE READ", "SERIALIZABLE"].into_iter().enumerate() {
        let mut conn = env.pool.get().await.unwrap();
        conn.batch_execute(&format!("BEGIN ISOLATION LEVEL {level}; SELECT 1"))
            .await
            .unwrap();
        env.conn()
            .await
            .batch_execute(&format!(
                "ALTER TABLE p48_orders ADD CONSTRAINT d{n} UNIQUE (other) DEFERRABLE"
            ))
            .await
            .unwrap();
        let answer = p48(1, n as i64, "k").create_once(&mut conn).await;
        conn.batch_execute("ROLLBACK").await.unwrap();
        answers.push(format!("{level}: {answer:?}"));
        env.conn()
            .await
            .batch_execute(&format!("ALTER TABLE p48_orders DROP CONSTRAINT d{n}"))
            .await
            .unwrap();
    }
    // The same constraint seen by a fresh snapshot: the guard's own answer.
    env.conn()
        .await
        .batch_execute("ALTER TABLE p48_orders ADD CONSTRAINT d UNIQUE (other) DEFERRABLE")
        .await
        .unwrap();
    let mut conn = env.pool.get().await.unwrap();
    let fresh = p48(1, 9, "k").create_once(&mut conn).await;
    assert!(
        matches!(fresh, Err(CreateOnceError::NoUniqueIndex { .. })),
        "{fresh:?}"
    );
    assert_eq!(count_sql(&env, "SELECT 1 FROM p48_orders").await, 0);
    assert!(
        answers.iter().all(|a| a.contains("Err(NoUniqueIndex")),
        "{answers:#?}"
    );
}

/// A key column with a default that raises when computed (the "must be
/// given" idiom: `DEFAULT required('request_id')`, an IMMUTABLE function
/// that raises). The model always gives the key, so the INSERT never
/// computes the default, and a plain INSERT of the same row succeeds; but
/// the guard plans `VALUES (DEFAULT, DEFAULT)`, the planner folds the
/// IMMUTABLE default, and every create (and `check_create_once`) fails with
/// the default's own error as an untyped `CreateOnceError::Database`; a
/// `DEFAULT (1/0)` does the same with "division by zero". Expected:
/// `Created`, then `Existing`, one row. Failed 5 of 5 runs direct, 3 of 3
/// through PgBouncer.
/// Fixed: the guard plans NULLs for the key columns, never their defaults.
#[tokio::test]
async fn found_a_key_default_that_raises_refuses_every_create() {
    let env = env48(
        2,
        "CREATE FUNCTION required48(col text) RETURNS text LANGUAGE plpgsql IMMUTABLE AS
             $$ BEGIN RAISE EXCEPTION '% is required', col; END $$;
         CREATE TABLE p48_orders (
             tenant_id bigint NOT NULL DEFAULT (1/0), id bigint NOT NULL,
             request_id text NOT NULL DEFAULT required48('request_id'),
             amount bigint NOT NULL, version bigint NOT NULL DEFAULT 0,
             PRIMARY KEY (tenant_id, id), UNIQUE (tenant_id, request_id))",
    )
    .await;
    // A plain INSERT that gives the key never computes the default.
    env.conn()
        .await
        .batch_execute("INSERT INTO p48_orders VALUES (1, 1, 'plain', 5, 0)")
        .await
        .unwrap();
    let mut conn = env.pool.get().await.unwrap();
    let check = idem::versioned::check_create_once::<P48Order>(&mut conn).await;
    let first = p48(1, 2, "k").create_once(&mut conn).await;
    let again = p48(1, 3, "k").create_once(&mut conn).await;
    let rows = rows48(&env, 1, "k").await;
    assert!(
        check.is_ok()
            && matches!(first, Ok(Creation::Created(_)))
            && matches!(again, Ok(Creation::Existing(_)))
            && rows == 1,
        "check: {check:?}; first: {first:?}; again: {again:?}; rows: {rows}"
    );
}

/// `check_create_once` plans an INSERT (migration 17's guard asks the
/// planner), so in an open transaction (a start-up check inside `BEGIN READ
/// ONLY`, say) it leaves RowExclusiveLock on the table and its indexes until
/// the transaction ends, and a `CREATE INDEX` waits for it; it assigns no
/// xid. Found by helper-52 (8 of 8 runs) and documented in
/// docs/versioned.md rather than changed (planning is how the guard sees
/// the catalog the INSERT sees): pinned here, with the lock gone at COMMIT.
#[tokio::test]
async fn attack48_check_create_once_locks_like_an_insert_until_commit() {
    let env = env48(2, P48_TABLE).await;
    let mut conn = env.conn().await;
    conn.batch_execute("BEGIN READ ONLY").await.unwrap();
    idem::versioned::check_create_once::<P48Order>(&mut conn)
        .await
        .unwrap();
    let held = my_locks(&mut conn).await;
    assert_eq!(xid(&mut conn).await, None);
    let ddl = "SET lock_timeout = '1s'; CREATE INDEX p48_amount ON p48_orders (amount)";
    let blocked = env.conn().await.batch_execute(ddl).await;
    conn.batch_execute("COMMIT").await.unwrap();
    let after = env.conn().await.batch_execute(ddl).await;
    assert!(
        held.iter().any(|(_, mode)| mode == "RowExclusiveLock")
            && blocked.is_err()
            && after.is_ok(),
        "locks held after the check: {held:?}; CREATE INDEX: {blocked:?}, after COMMIT: {after:?}"
    );
}

/// In a `BEGIN READ ONLY` transaction and under
/// `default_transaction_read_only`, `check_create_once` answers (Ok on an
/// indexed table, `NoUniqueIndex` on an unindexed one) and assigns no xid;
/// a create that ends `Existing` at READ COMMITTED assigns none either, and
/// its transaction goes on.
#[tokio::test]
async fn attack48_the_check_works_read_only_and_consumes_no_xid() {
    let env = env48(
        2,
        &format!("{P48_TABLE}; INSERT INTO p48_orders VALUES (1, 1, 'k', 5, 0)"),
    )
    .await;
    let mut conn = env.conn().await;
    conn.batch_execute("BEGIN READ ONLY").await.unwrap();
    idem::versioned::check_create_once::<P48Order>(&mut conn)
        .await
        .unwrap();
    let loose = idem::versioned::check_create_once::<LooseOrder>(&mut conn).await;
    assert!(
        matches!(loose, Err(CreateOnceError::NoUniqueIndex { .. })),
        "{loose:?}"
    );
    conn.batch_execute("ROLLBACK; SET default_transaction_read_only = on")
        .await
        .unwrap();
    conn.batch_execute("BEGIN").await.unwrap();
    let read_only = diesel::sql_query("SELECT current_setting('transaction_read_only') AS xid")
        .get_result::<Xid>(&mut conn)
        .await
        .unwrap()
        .xid;
    assert_eq!(read_only.as_deref(), Some("on"));
    idem::versioned::check_create_once::<P48Order>(&mut conn)
        .await
        .unwrap();
    assert_eq!(xid(&mut conn).await, None);
    conn.batch_execute("COMMIT; SET default_transaction_read_only = off")
        .await
        .unwrap();
    conn.batch_execute("BEGIN").await.unwrap();
    let repeat = p48(1, 2, "k").create_once(&mut conn).await;
    assert!(matches!(repeat, Ok(Creation::Existing(_))), "{repeat:?}");
    assert_eq!(xid(&mut conn).await, None);
    conn.batch_execute("COMMIT").await.unwrap();
    assert_eq!(count_sql(&env, "SELECT 1 FROM p48_orders").await, 1);
}

/// The guard's EXPLAIN fires nothing: with row- and statement-level BEFORE
/// and AFTER INSERT triggers counting into a side table, a create that is
/// `Created` fires each once, an `Existing` fires the BEFORE ROW trigger
/// once (PostgreSQL's documented order) and the statement triggers once,
/// on a fresh connection (the guard planned) and on a warm one alike.
#[tokio::test]
async fn attack48_the_guards_explain_fires_no_trigger() {
    let env = env48(
        2,
        &format!(
            "{P48_TABLE};
             CREATE TABLE fired48 (what text NOT NULL);
             CREATE FUNCTION fire48() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN INSERT INTO fired48 VALUES (TG_WHEN || ' ' || TG_LEVEL);
                   RETURN CASE WHEN TG_LEVEL = 'ROW' THEN NEW END; END $$;
             CREATE TRIGGER b_row BEFORE INSERT ON p48_orders FOR EACH ROW EXECUTE FUNCTION fire48();
             CREATE TRIGGER a_row AFTER INSERT ON p48_orders FOR EACH ROW EXECUTE FUNCTION fire48();
             CREATE TRIGGER b_st BEFORE INSERT ON p48_orders FOR EACH STATEMENT EXECUTE FUNCTION fire48();
             CREATE TRIGGER a_st AFTER INSERT ON p48_orders FOR EACH STATEMENT EXECUTE FUNCTION fire48();"
        ),
    )
    .await;
    let fired = |what: &'static str| {
        let env = &env;
        async move { count_sql(env, &format!("SELECT 1 FROM fired48 WHERE what = '{what}'")).await }
    };
    let mut conn = env.pool.get().await.unwrap();
    assert!(p48(1, 1, "k")
        .create_once(&mut conn)
        .await
        .unwrap()
        .is_created());
    let counts = (
        fired("BEFORE ROW").await,
        fired("AFTER ROW").await,
        fired("BEFORE STATEMENT").await,
        fired("AFTER STATEMENT").await,
    );
    assert_eq!(counts, (1, 1, 1, 1));
    let repeat = p48(1, 2, "k").create_once(&mut conn).await;
    assert!(matches!(repeat, Ok(Creation::Existing(_))), "{repeat:?}");
    let counts = (
        fired("BEFORE ROW").await,
        fired("AFTER ROW").await,
        fired("BEFORE STATEMENT").await,
        fired("AFTER STATEMENT").await,
    );
    assert_eq!(counts, (2, 1, 2, 2));
    assert_eq!(rows48(&env, 1, "k").await, 1);
}

/// `NoUniqueIndex`'s reason carries the planner's message (the DETAIL) and
/// the fix, and nothing of the rows: with another tenant's row under the
/// same key in the table, the reason names neither that key nor the tenant.
#[tokio::test]
async fn attack48_no_unique_index_says_the_planners_word_and_no_data() {
    let env = env48(
        2,
        "CREATE TABLE p48_orders (tenant_id bigint NOT NULL, id bigint NOT NULL,
             request_id text NOT NULL, amount bigint NOT NULL, version bigint NOT NULL DEFAULT 0,
             PRIMARY KEY (tenant_id, id), UNIQUE (request_id));
         INSERT INTO p48_orders VALUES (777, 1, 'secret-key-of-777', 5, 0)",
    )
    .await;
    let mut conn = env.pool.get().await.unwrap();
    let answer = p48(1, 2, "secret-key-of-777").create_once(&mut conn).await;
    let Err(CreateOnceError::NoUniqueIndex {
        table,
        columns,
        reason,
    }) = answer
    else {
        panic!("{answer:?}");
    };
    assert_eq!(columns, ["tenant_id", "request_id"]);
    assert!(table.contains("p48_orders"), "{table}");
    assert!(
        reason.contains("no unique index") && reason.contains("CREATE UNIQUE INDEX ON"),
        "{reason}"
    );
    assert!(
        !reason.contains("secret") && !reason.contains("777"),
        "{reason}"
    );
    // The DETAIL is the planner's message.
    let detail = diesel::sql_query(
        "SELECT idem_create_once_arbiter('p48_orders'::regclass, ARRAY['tenant_id', 'request_id']) AS xid",
    )
    .get_result::<Xid>(&mut env.conn().await)
    .await
    .unwrap()
    .xid
    .unwrap_or_default();
    assert!(
        detail.contains("no unique or exclusion constraint matching the ON CONFLICT"),
        "{detail}"
    );
    assert_eq!(count_sql(&env, "SELECT 1 FROM p48_orders").await, 1);
}

/// One long-lived connection, a schema per tenant: `t1.p48_orders` has the
/// key's index, `t2.p48_orders` does not. Alternating `SET search_path`
/// between creates (the prepared INSERT kept across), a `pg_temp` table of
/// the same name without the index shadowing both, and `DISCARD TEMP`: each
/// create is answered for the table the name resolves to then.
#[tokio::test]
async fn attack48_search_path_and_temp_shadowing_follow_the_name() {
    let env = env48(
        1,
        &format!(
            "CREATE SCHEMA t1; CREATE SCHEMA t2; SET search_path = t1; {P48_TABLE};
             SET search_path = t2; CREATE TABLE p48_orders (tenant_id bigint NOT NULL,
                 id bigint NOT NULL, request_id text NOT NULL, amount bigint NOT NULL,
                 version bigint NOT NULL DEFAULT 0, PRIMARY KEY (tenant_id, id))"
        ),
    )
    .await;
    let mut conn = env.conn().await;
    let count = |schema: &'static str| {
        let env = &env;
        async move {
            count_sql(
                env,
                &format!("SELECT 1 FROM {schema}.p48_orders WHERE request_id = 'k'"),
            )
            .await
        }
    };
    for round in 0..3_i64 {
        conn.batch_execute("SET search_path = t1, public")
            .await
            .unwrap();
        let one = p48(1, 10 + round, "k").create_once(&mut conn).await;
        assert!(
            matches!(
                (round, &one),
                (0, Ok(Creation::Created(_))) | (1.., Ok(Creation::Existing(_)))
            ),
            "round {round} t1: {one:?}"
        );
        conn.batch_execute("SET search_path = t2, public")
            .await
            .unwrap();
        let two = p48(1, 20 + round, "k").create_once(&mut conn).await;
        assert!(
            matches!(two, Err(CreateOnceError::NoUniqueIndex { .. })),
            "round {round} t2: {two:?}"
        );
        conn.batch_execute(
            "SET search_path = t1, public;
             CREATE TEMP TABLE p48_orders (tenant_id bigint NOT NULL, id bigint NOT NULL,
                 request_id text NOT NULL, amount bigint NOT NULL, version bigint NOT NULL DEFAULT 0)",
        )
        .await
        .unwrap();
        let temp = p48(1, 30 + round, "k").create_once(&mut conn).await;
        assert!(
            matches!(temp, Err(CreateOnceError::NoUniqueIndex { .. })),
            "round {round} temp: {temp:?}"
        );
        if round == 1 {
            // DISCARD ALL would also drop diesel's prepared statements
            // ("prepared statement .. does not exist", any diesel query).
            conn.batch_execute("DISCARD TEMP").await.unwrap();
        } else {
            conn.batch_execute("DROP TABLE pg_temp.p48_orders")
                .await
                .unwrap();
        }
    }
    assert_eq!((count("t1").await, count("t2").await), (1, 0));
}

/// The reverse of the above: the table had a DEFERRABLE unique constraint
/// (on another column), dropped by a migration after a REPEATABLE READ
/// transaction took its snapshot. The guard's pg_index read still sees it
/// and refuses: `NoUniqueIndex`, which is not transient, so the retry loop
/// does not replay it, and the request fails although the table now
/// qualifies (the planner, asked under the INSERT's lock, would say so).
/// The refusal names the dropped index by a bare OID ("the deferrable
/// unique or exclusion constraint 514306"): the catalog no longer has it.
/// Expected: `Created`, one row. Failed 3 of 3 runs direct, 1 of 1
/// through PgBouncer.
/// Fixed: the deferrable check skips an index gone from the system cache.
#[tokio::test]
async fn found_a_deferrable_constraint_dropped_after_the_snapshot_still_refuses() {
    let env = env48(
        2,
        &format!(
            "{P48_TABLE}; ALTER TABLE p48_orders ADD COLUMN other text;
             ALTER TABLE p48_orders ADD CONSTRAINT d UNIQUE (other) DEFERRABLE"
        ),
    )
    .await;
    let mut conn = env.pool.get().await.unwrap();
    conn.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1")
        .await
        .unwrap();
    env.conn()
        .await
        .batch_execute("ALTER TABLE p48_orders DROP CONSTRAINT d")
        .await
        .unwrap();
    let answer = p48(1, 1, "k").create_once(&mut conn).await;
    let end = if answer.is_ok() { "COMMIT" } else { "ROLLBACK" };
    conn.batch_execute(end).await.unwrap();
    let rows = rows48(&env, 1, "k").await;
    assert!(
        matches!(answer, Ok(Creation::Created(_))) && rows == 1,
        "{answer:?}; rows: {rows}"
    );
}
