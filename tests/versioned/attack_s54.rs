//! Hostile pass (session 54) on versioned updates, state machines and the
//! backstop, from README.md, docs/versioned.md and the backstop's rustdoc
//! alone, every effect counted in the database: writers racing one version at
//! each isolation level; another tenant's row; versions at the integer edges,
//! deleted or rewritten between read and update; raw UPDATEs in every shape
//! (diesel, sql_query, view, CTE, FROM, trigger, ON CONFLICT, MERGE, another
//! search_path, a second role), COPY against tombstones, the escape hatches;
//! transitions undeclared, from a wrong state, raced, repeated, to the same
//! state, across tenants, over an unknown state text. Found: the guard
//! resolved `to_jsonb` and `idem_version_tombstones` through the writing
//! role's search_path (fixed by migration 18; the two tests below).

use diesel::result::{DatabaseErrorKind, Error as DieselError};
use futures_util::SinkExt;
use idem::versioned::backstop::{install_version_guard, is_version_guard_violation};
use idem::versioned::Transitioned;
use idem::States;
use idem_testing::TestDatabase;
use tokio_postgres::Client as Raw;

type Conn = AsyncPgConnection;
type R<T> = Result<T, VersionedError>;

use super::*;

diesel::table! { d54 (tenant_id, id) { tenant_id -> Int8, id -> Int8, body -> Text, status -> Text, version -> Int8, } }
diesel::table! { n54 (tenant_id, id) { tenant_id -> Int8, id -> Int8, n -> Int4, version -> Int4, } }
diesel::table! { t54 (tenant_id, id) { tenant_id -> Int8, id -> Int8, status -> Text, version -> Int8, } }

// No CHECK (version >= 0): the edge tests write negative versions.
const TABLES: &str = "
CREATE TABLE d54 (tenant_id bigint NOT NULL, id bigint NOT NULL, body text NOT NULL,
    status text NOT NULL, version bigint NOT NULL DEFAULT 0, PRIMARY KEY (tenant_id, id));
CREATE TABLE n54 (tenant_id bigint NOT NULL, id bigint NOT NULL, n int NOT NULL,
    version int NOT NULL DEFAULT 0, PRIMARY KEY (tenant_id, id));
CREATE TABLE t54 (tenant_id bigint NOT NULL, id bigint NOT NULL, status text NOT NULL,
    version bigint NOT NULL DEFAULT 0, PRIMARY KEY (tenant_id, id));
";

#[derive(Debug, Clone, PartialEq, Queryable, Selectable, Versioned)]
#[diesel(table_name = d54)]
#[versioned(tenant = tenant_id, key = id, state = status)]
pub(super) struct Doc {
    tenant_id: i64,
    id: i64,
    body: String,
    status: String,
    pub(super) version: i64,
}

#[derive(VersionedChanges)]
#[versioned(model = Doc)]
#[diesel(table_name = d54)]
struct Body {
    body: String,
}

#[derive(Debug, Clone, PartialEq, Queryable, Selectable, Versioned)]
#[diesel(table_name = n54)]
#[versioned(tenant = tenant_id, key = id)]
struct Small {
    tenant_id: i64,
    id: i64,
    n: i32,
    version: i32,
}

#[derive(VersionedChanges)]
#[versioned(model = Small)]
#[diesel(table_name = n54)]
struct SetN {
    n: i32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, States)]
#[states(Open => [Open, Closed], Closed => [Reopened], Reopened => [Closed])]
enum St {
    Open,
    Closed,
    Reopened,
}

#[derive(Debug, Clone, PartialEq, Queryable, Selectable, Versioned)]
#[diesel(table_name = t54)]
#[versioned(tenant = tenant_id, key = id, state = status)]
struct Ticket {
    tenant_id: i64,
    id: i64,
    status: St,
    version: i64,
}

use St::{Closed, Open, Reopened};

/// A fresh database with idem's migrations, the three tables and `seed`, a
/// diesel connection and a raw client (SQLSTATEs, SQL behind idem's back).
pub(super) async fn fresh(seed: &str) -> (TestDatabase, AsyncPgConnection, Raw) {
    let db = TestDatabase::create().await.unwrap();
    let mut c = AsyncPgConnection::establish(db.url()).await.unwrap();
    idem::migrate(&mut c).await.unwrap();
    c.batch_execute(TABLES).await.unwrap();
    c.batch_execute(seed).await.unwrap();
    let raw = idem_testing::connect(db.url()).await.unwrap();
    (db, c, raw)
}

pub(super) async fn sql(raw: &Raw, statements: &str) {
    raw.batch_execute(statements).await.unwrap();
}

/// `statements` must fail with SQLSTATE `code`.
pub(super) async fn refused(raw: &Raw, statements: &str, code: &str) {
    let err = raw.batch_execute(statements).await.expect_err(statements);
    let got = err.code().map(|c| c.code());
    assert_eq!(got, Some(code), "{statements}: {err:?}");
}

/// `(body, version)` of one document, straight from the table.
pub(super) async fn doc_row(raw: &Raw, tenant: i64, id: i64) -> Option<(String, i64)> {
    let q = "SELECT body, version FROM d54 WHERE tenant_id = $1 AND id = $2";
    let row = raw.query_opt(q, &[&tenant, &id]).await.unwrap();
    row.map(|r| (r.get(0), r.get(1)))
}

async fn small_row(raw: &Raw, id: i64) -> (i32, i32) {
    let q = "SELECT n, version FROM n54 WHERE id = $1";
    let r = raw.query_one(q, &[&id]).await.unwrap();
    (r.get(0), r.get(1))
}

/// `(status text, version, records in idem_transitions for t54)`.
async fn ticket_row(raw: &Raw, tenant: i64, id: i64) -> (String, i64, i64) {
    let q = "SELECT status, version, (SELECT count(*) FROM idem_transitions \
             WHERE table_oid = 't54'::regclass) FROM t54 WHERE tenant_id = $1 AND id = $2";
    let r = raw.query_one(q, &[&tenant, &id]).await.unwrap();
    (r.get(0), r.get(1), r.get(2))
}

async fn set_body(c: &mut Conn, key: (i64, i64), v: i64, body: &str) -> R<Doc> {
    let update = Doc::update(key.1).tenant(key.0).expect_version(v);
    update.set(&Body { body: body.into() }).execute(c).await
}

async fn set_n(c: &mut Conn, id: i64, v: i64) -> R<Small> {
    let update = Small::update(id).tenant(1).expect_version(v);
    update.set(&SetN { n: 7 }).execute(c).await
}

async fn take(c: &mut Conn, key: (i64, i64), v: i64, edge: (St, St)) -> R<Transitioned<Ticket>> {
    let update = Ticket::update(key.1).tenant(key.0).expect_version(v);
    update.transition(edge.0, edge.1).execute(c).await
}

/// `take(..)` in tenant 1, which must succeed: whether it was a duplicate.
async fn dup(c: &mut Conn, id: i64, v: i64, edge: (St, St)) -> bool {
    take(c, (1, id), v, edge).await.unwrap().is_duplicate()
}

fn err<T: std::fmt::Debug, E>(out: Result<T, E>) -> E {
    out.expect_err("must be refused")
}

fn stale<T: std::fmt::Debug>(out: R<T>, expected: i64, actual: i64) {
    assert_stale(&out.unwrap_err(), expected, actual);
}

fn stale_0_1(e: &VersionedError) -> bool {
    matches!(
        e,
        VersionedError::Stale {
            expected: 0,
            actual: 1
        }
    )
}

fn serialization_failure(e: &VersionedError) -> bool {
    use DatabaseErrorKind::SerializationFailure as Serialization;
    matches!(
        e,
        VersionedError::Database(DieselError::DatabaseError(Serialization, _))
    )
}

fn overflow(e: &VersionedError) -> bool {
    matches!(e, VersionedError::Database(d) if d.to_string().contains("out of range"))
}

/// Six writers, each on its own connection and in its own transaction at
/// `iso`, read version 0 (taking their snapshot), meet at a barrier and
/// write. Exactly one commits; at READ COMMITTED every loser is `Stale{0,1}`,
/// above it a loser is `Stale` or a serialization failure (40001, which
/// `#[retryable]` replays). The row is the winner's, at version 1.
async fn race_one_version(iso: &'static str) {
    const N: usize = 6;
    let (db, _c, raw) = fresh("INSERT INTO d54 VALUES (1, 1, 'start', 'draft', 0)").await;
    let barrier = Arc::new(Barrier::new(N));
    let mut tasks = Vec::new();
    for i in 0..N {
        let (url, barrier) = (db.url().to_owned(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            let mut c = AsyncPgConnection::establish(&url).await.unwrap();
            let begin = format!("BEGIN ISOLATION LEVEL {iso}");
            c.batch_execute(&begin).await.unwrap();
            let read = Doc::find(1).tenant(1).load(&mut c).await.unwrap();
            barrier.wait().await;
            let body = format!("writer {i}");
            let mut out = set_body(&mut c, (1, 1), read.version, &body).await;
            if out.is_ok() {
                if let Err(e) = c.batch_execute("COMMIT").await {
                    out = Err(e.into());
                }
            } else {
                c.batch_execute("ROLLBACK").await.unwrap();
            }
            (body, out)
        }));
    }
    let mut winners = Vec::new();
    for t in tasks {
        let (body, out) = t.await.unwrap();
        match out {
            Ok(row) => {
                assert_eq!((row.body.as_str(), row.version), (body.as_str(), 1));
                winners.push(body);
            }
            Err(e) if stale_0_1(&e) => {}
            Err(e) if iso != "READ COMMITTED" && serialization_failure(&e) => {}
            Err(e) => panic!("{iso}: a loser got {e:?}"),
        }
    }
    assert_eq!(winners.len(), 1, "{iso}: {winners:?}");
    assert_eq!(doc_row(&raw, 1, 1).await, Some((winners[0].clone(), 1)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s54_racers_of_one_version_at_each_isolation_level() {
    for iso in ["READ COMMITTED", "REPEATABLE READ", "SERIALIZABLE"] {
        race_one_version(iso).await;
    }
}

/// Tenant 2 names tenant 1's row by its key, at its version, below and
/// above it, with an update, a delete, a transition and a read: `NotFound`
/// each time, nothing written, and neither the error's text nor its Debug
/// form carries anything of the row.
#[tokio::test]
async fn s54_another_tenants_row_writes_and_leaks_nothing() {
    let seed = "INSERT INTO d54 VALUES (1, 7, 'secret-body', 'secret-state', 41);
                INSERT INTO t54 VALUES (1, 7, 'open', 41);";
    let (_db, mut c, raw) = fresh(seed).await;
    let mut errors = Vec::new();
    for v in [41, 40, 0, 42] {
        errors.push(err(set_body(&mut c, (2, 7), v, "stolen").await));
        let delete = Doc::delete(7).tenant(2).expect_version(v);
        errors.push(err(delete.execute(&mut c).await));
        errors.push(err(take(&mut c, (2, 7), v, (Open, Closed)).await));
    }
    errors.push(err(Doc::find(7).tenant(2).load(&mut c).await));
    for e in &errors {
        assert_not_found(e);
        let text = format!("{e} {e:?}");
        for secret in ["secret", "41", "open"] {
            assert!(!text.contains(secret), "{secret} leaks in {text}");
        }
    }
    assert_eq!(doc_row(&raw, 1, 7).await, Some(("secret-body".into(), 41)));
    assert_eq!(ticket_row(&raw, 1, 7).await, ("open".into(), 41, 0));
}

/// A bump past the type's maximum is a database error (22003), never a
/// panic or a wrapped-around version, and writes nothing; an expected
/// version that is negative, `i64::MIN`, `i64::MAX`, or (for an `i32`
/// column) no `i32` at all, against a row at 0 is `Stale` with the numbers
/// given, never truncated onto the row; a row at a negative version updates.
#[tokio::test]
async fn s54_version_edges() {
    let (_db, mut c, raw) = fresh(&format!(
        "INSERT INTO d54 VALUES (1, 1, 'max', 'draft', {max}), (1, 2, 'zero', 'draft', 0),
             (1, 3, 'neg', 'draft', -3);
         INSERT INTO n54 VALUES (1, 1, 5, {}), (1, 2, 5, 0);
         INSERT INTO t54 VALUES (1, 1, 'open', {max}), (1, 2, 'open', 0);",
        i32::MAX,
        max = i64::MAX,
    ))
    .await;
    let e = err(set_body(&mut c, (1, 1), i64::MAX, "x").await);
    assert!(overflow(&e), "{e:?}");
    assert_eq!(doc_row(&raw, 1, 1).await, Some(("max".into(), i64::MAX)));
    assert!(overflow(&err(set_n(&mut c, 1, i32::MAX.into()).await)));
    assert_eq!(small_row(&raw, 1).await, (5, i32::MAX));
    let e = err(take(&mut c, (1, 1), i64::MAX, (Open, Closed)).await);
    assert!(overflow(&e), "{e:?}");
    assert_eq!(ticket_row(&raw, 1, 1).await, ("open".into(), i64::MAX, 0));

    // `expect_version` takes an i64 for an i32 version too.
    for v in [1_i64 << 32, -(1_i64 << 32), i64::MAX, i64::MIN] {
        match set_n(&mut c, 2, v).await {
            Err(e) if overflow(&e) => {}
            Err(e) => assert_stale(&e, v, 0),
            other => panic!("expect_version({v}) on an i32 row at 0: {other:?}"),
        }
    }
    assert_eq!(small_row(&raw, 2).await, (5, 0));
    for v in [-1, i64::MIN, i64::MAX, 1] {
        stale(set_body(&mut c, (1, 2), v, "x").await, v, 0);
        stale(take(&mut c, (1, 2), v, (Open, Closed)).await, v, 0);
    }
    assert_eq!(doc_row(&raw, 1, 2).await, Some(("zero".into(), 0)));
    assert_eq!(ticket_row(&raw, 1, 2).await, ("open".into(), 0, 0));
    let row = set_body(&mut c, (1, 3), -3, "neg2").await.unwrap();
    assert_eq!(row.version, -2);
}

/// Between the read and the update the row is deleted (`NotFound`), or its
/// version is changed by raw SQL (`Stale` with the new version); under the
/// backstop a row deleted and inserted again, by idem or by COPY, continues
/// above the old version, so the old version is `Stale`.
#[tokio::test]
async fn s54_row_changed_between_read_and_update() {
    let seed = "INSERT INTO d54 VALUES (1, 1, 'a', 'draft', 0), (1, 2, 'b', 'draft', 0)";
    let (_db, mut c, raw) = fresh(seed).await;
    let read = Doc::find(1).tenant(1).load(&mut c).await.unwrap();
    sql(&raw, "DELETE FROM d54 WHERE id = 1").await;
    assert_not_found(&err(set_body(&mut c, (1, 1), read.version, "x").await));
    assert_eq!(doc_row(&raw, 1, 1).await, None);

    let read = Doc::find(2).tenant(1).load(&mut c).await.unwrap();
    sql(&raw, "UPDATE d54 SET version = 7 WHERE id = 2").await;
    stale(set_body(&mut c, (1, 2), read.version, "x").await, 0, 7);
    assert_eq!(doc_row(&raw, 1, 2).await, Some(("b".into(), 7)));

    install_version_guard::<Doc>(&mut c).await.unwrap();
    let delete = Doc::delete(2).tenant(1).expect_version(7);
    delete.execute(&mut c).await.unwrap();
    let again = Doc { version: 0, ..read };
    assert_eq!(again.insert(&mut c).await.unwrap().version, 8);
    stale(set_body(&mut c, (1, 2), 7, "x").await, 7, 8);
    // COPY is an INSERT too: the row comes back above its tombstone.
    sql(&raw, "DELETE FROM d54 WHERE id = 2").await;
    let sink = raw.copy_in::<_, &'static [u8]>("COPY d54 FROM STDIN");
    let mut sink = Box::pin(sink.await.unwrap());
    let line: &'static [u8] = b"1\t2\tcopied\tdraft\t0\n";
    sink.send(line).await.unwrap();
    assert_eq!(sink.as_mut().finish().await.unwrap(), 1);
    assert_eq!(doc_row(&raw, 1, 2).await, Some(("copied".into(), 9)));
}

/// Raw UPDATEs that do not bump the version, in every shape: each refused
/// with IDV01 and nothing written, also what they wrote elsewhere; with the
/// bump the same shape passes; the two escape hatches pass, and are bounded.
#[tokio::test]
async fn s54_backstop_refuses_every_shape_of_raw_update() {
    let (db, mut c, raw) = fresh(
        "INSERT INTO d54 VALUES (1, 1, 'a', 'draft', 3);
         CREATE VIEW d54_v AS SELECT * FROM d54;
         CREATE TABLE s54_pokes (n int);
         CREATE FUNCTION s54_poke() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN UPDATE d54 SET body = 'poked'; RETURN NEW; END $$;
         CREATE TRIGGER s54_poke AFTER INSERT ON s54_pokes
           FOR EACH ROW EXECUTE FUNCTION s54_poke();
         CREATE SCHEMA s54_other;
         CREATE TABLE s54_other.d54 (LIKE d54);",
    )
    .await;
    install_version_guard::<Doc>(&mut c).await.unwrap();
    let update = diesel::update(d54::table.filter(d54::id.eq(1))).set(d54::body.eq("diesel"));
    let e = err(update.execute(&mut c).await);
    assert!(is_version_guard_violation(&e), "{e:?}");
    let query = diesel::sql_query("UPDATE d54 SET body = 'q'");
    let e = err(query.execute(&mut c).await);
    assert!(is_version_guard_violation(&e), "{e:?}");
    for statements in [
        "UPDATE d54_v SET body = 'view'",
        "WITH u AS (UPDATE d54 SET body = 'cte' RETURNING 1) SELECT count(*) FROM u",
        "UPDATE d54 d SET body = s.b FROM (VALUES ('from')) s(b) WHERE d.id = 1",
        "INSERT INTO s54_pokes VALUES (1)",
        "INSERT INTO d54 VALUES (1, 1, 'upsert', 'draft', 0) \
         ON CONFLICT (tenant_id, id) DO UPDATE SET body = excluded.body",
        "MERGE INTO d54 d USING (VALUES (1::bigint)) s(i) ON d.id = s.i \
         WHEN MATCHED THEN UPDATE SET body = 'merge'",
        "UPDATE d54 SET body = 'bump2', version = version + 2",
        "UPDATE d54 SET body = 'down', version = version - 1",
        "SET search_path = s54_other, pg_temp; UPDATE public.d54 SET body = 'path'",
    ] {
        refused(&raw, statements, "IDV01").await;
    }
    sql(&raw, "RESET search_path").await;
    let pokes = raw.query_one("SELECT count(*) FROM s54_pokes", &[]);
    let pokes = pokes.await.unwrap();
    assert_eq!(pokes.get::<_, i64>(0), 0);
    assert_eq!(doc_row(&raw, 1, 1).await, Some(("a".into(), 3)));
    sql(&raw, "UPDATE d54_v SET body = 'v', version = version + 1").await;
    assert_eq!(doc_row(&raw, 1, 1).await, Some(("v".into(), 4)));
    // The documented escape hatches: `session_replication_role = replica` (a
    // superuser) only in its own session, `DISABLE TRIGGER` (the owner) until
    // the trigger is enabled again.
    let replica = idem_testing::connect(db.url()).await.unwrap();
    let q = "SET session_replication_role = replica; UPDATE d54 SET body = 'r'";
    sql(&replica, q).await;
    assert_eq!(doc_row(&raw, 1, 1).await, Some(("r".into(), 4)));
    refused(&raw, "UPDATE d54 SET body = 'still'", "IDV01").await;
    let q = "ALTER TABLE d54 DISABLE TRIGGER idem_version_guard; UPDATE d54 SET body = 'fix';
             ALTER TABLE d54 ENABLE TRIGGER idem_version_guard;";
    sql(&raw, q).await;
    assert_eq!(doc_row(&raw, 1, 1).await, Some(("fix".into(), 4)));
    refused(&raw, "UPDATE d54 SET body = 'after'", "IDV01").await;
    assert_eq!(doc_row(&raw, 1, 1).await, Some(("fix".into(), 4)));
}

/// A second role named after `db`, with `grants` on `d54` and a schema of its
/// own name (first on the default search_path, `"$user", public`): its name.
pub(super) async fn second_role(db: &TestDatabase, raw: &Raw, grants: &str) -> String {
    let role = format!("{}_w", db.name());
    let q = format!(
        "CREATE ROLE \"{role}\"; GRANT {grants} ON d54 TO \"{role}\";
         GRANT SELECT, INSERT, UPDATE ON idem_version_tombstones TO \"{role}\";
         CREATE SCHEMA \"{role}\" AUTHORIZATION \"{role}\";"
    );
    sql(raw, &q).await;
    role
}

/// A new session as `role` (plpgsql keeps the guard's plans per session).
pub(super) async fn as_role(db: &TestDatabase, role: &str) -> Raw {
    let other = idem_testing::connect(db.url()).await.unwrap();
    sql(&other, &format!("SET ROLE \"{role}\"")).await;
    other
}

pub(super) async fn drop_role(raw: &Raw, role: &str) {
    let q =
        format!("DROP SCHEMA \"{role}\" CASCADE; DROP OWNED BY \"{role}\"; DROP ROLE \"{role}\"");
    sql(raw, &q).await;
}

/// A second role with UPDATE on the table cannot get around the guard by a
/// missing bump, `session_replication_role` or disabling the trigger (each
/// needs owner or superuser), nor by a `to_jsonb` of its own for the row
/// type in its own schema, first on the default search_path. Found: before
/// migration 18 the guard called `to_jsonb(NEW)` unqualified with the
/// session's search_path, so that exact match won over
/// `pg_catalog.to_jsonb(anyelement)` and the guard read the version the role
/// made up (old + 1 for the new row).
#[tokio::test]
async fn s54_second_role_cannot_get_around_the_guard() {
    let (db, mut c, raw) = fresh("INSERT INTO d54 VALUES (1, 1, 'a', 'draft', 3)").await;
    install_version_guard::<Doc>(&mut c).await.unwrap();
    let role = second_role(&db, &raw, "SELECT, UPDATE").await;
    let other = as_role(&db, &role).await;
    refused(&other, "UPDATE d54 SET body = 'role'", "IDV01").await;
    refused(&other, "SET session_replication_role = replica", "42501").await;
    let disable = "ALTER TABLE d54 DISABLE TRIGGER idem_version_guard";
    refused(&other, disable, "42501").await;
    let q = format!(
        "CREATE FUNCTION \"{role}\".to_jsonb(r public.d54) RETURNS jsonb
           LANGUAGE sql AS $$ SELECT pg_catalog.jsonb_set(pg_catalog.to_jsonb(r),
           '{{version}}', pg_catalog.to_jsonb(r.version + CASE WHEN r.body = 'forged'
           THEN 1 ELSE 0 END)) $$;"
    );
    sql(&other, &q).await;
    let next = as_role(&db, &role).await;
    let out = next.batch_execute("UPDATE d54 SET body = 'forged'").await;
    let stored = doc_row(&raw, 1, 1).await;
    drop(other);
    drop_role(&raw, &role).await;
    assert_eq!(stored, Some(("a".into(), 3)), "written past the guard");
    let err = out.expect_err("a shadowing to_jsonb wrote past the guard");
    assert_eq!(err.code().map(|c| c.code()), Some("IDV01"), "{err:?}");
}

/// Versions never repeat (backstop rustdoc, "Versions never repeat"), also
/// when a role that may DELETE rows has a table `idem_version_tombstones` of
/// its own first on its search_path. Found: before migration 18 the guard
/// wrote the tombstone there (unqualified, the session's search_path), so
/// the row inserted again started at 0 and an old ETag matched it.
#[tokio::test]
async fn s54_a_shadow_tombstone_table_does_not_make_versions_repeat() {
    let (db, mut c, raw) = fresh("INSERT INTO d54 VALUES (1, 1, 'a', 'draft', 3)").await;
    install_version_guard::<Doc>(&mut c).await.unwrap();
    let read = Doc::find(1).tenant(1).load(&mut c).await.unwrap();
    let role = second_role(&db, &raw, "SELECT, UPDATE, DELETE").await;
    let other = as_role(&db, &role).await;
    let q = format!(
        "CREATE TABLE \"{role}\".idem_version_tombstones
           (LIKE public.idem_version_tombstones INCLUDING ALL);
         DELETE FROM d54 WHERE id = 1;"
    );
    sql(&other, &q).await;
    drop(other);
    drop_role(&raw, &role).await;
    assert_eq!(doc_row(&raw, 1, 1).await, None);
    let again = Doc { version: 0, ..read };
    let version = again.insert(&mut c).await.unwrap().version;
    assert_eq!(version, 4, "the deleted row was at 3; versions repeat");
}

/// Undeclared edges (also to the same state) are refused before any SQL:
/// inside an aborted transaction, where any statement would fail with 25P02,
/// the answer is still `IllegalTransition` (409). A declared edge from the
/// wrong state at the row's version is `StateMismatch`.
#[tokio::test]
async fn s54_undeclared_and_wrong_state_transitions() {
    let (_db, mut c, raw) = fresh("INSERT INTO t54 VALUES (1, 1, 'open', 0)").await;
    c.batch_execute("BEGIN").await.unwrap();
    c.batch_execute("SELECT 1/0").await.unwrap_err();
    for (from, to) in [(Closed, Open), (Closed, Closed), (Open, Reopened)] {
        let e = err(take(&mut c, (1, 1), 0, (from, to)).await);
        let illegal = matches!(&e, VersionedError::IllegalTransition { .. });
        assert!(illegal, "{from:?} -> {to:?}: {e:?}");
        assert_eq!(e.http_status(), 409);
    }
    c.batch_execute("ROLLBACK").await.unwrap();
    assert!(!dup(&mut c, 1, 0, (Open, Closed)).await);
    for from in [Open, Reopened] {
        let e = err(take(&mut c, (1, 1), 1, (from, Closed)).await);
        let want = format!("{from:?}");
        let mismatch = matches!(&e, VersionedError::StateMismatch { expected, actual }
            if *expected == want && actual == "Closed");
        assert!(mismatch, "{e:?}");
    }
    assert_eq!(ticket_row(&raw, 1, 1).await, ("closed".into(), 1, 1));
}

/// Six racers take the same edge from the same version: one `Applied`, five
/// `Duplicate` with the same row; the version moved once, one record. A
/// repeat afterwards is a duplicate again; a declared self-loop (`Open ->
/// Open`) is applied, repeated as a duplicate, applied again from the new
/// version, and its first repeat is then `Stale`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s54_racers_and_repeats_of_one_transition() {
    const N: usize = 6;
    let seed = "INSERT INTO t54 VALUES (1, 1, 'open', 0), (1, 2, 'open', 0)";
    let (db, mut c, raw) = fresh(seed).await;
    let barrier = Arc::new(Barrier::new(N));
    let mut tasks = Vec::new();
    for _ in 0..N {
        let (url, barrier) = (db.url().to_owned(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            let mut c = AsyncPgConnection::establish(&url).await.unwrap();
            barrier.wait().await;
            take(&mut c, (1, 1), 0, (Open, Closed)).await.unwrap()
        }));
    }
    let mut applied = 0;
    for t in tasks {
        let (row, duplicate) = match t.await.unwrap() {
            Transitioned::Applied(row) => (row, false),
            Transitioned::Duplicate(row) => (row, true),
        };
        applied += usize::from(!duplicate);
        assert_eq!((row.status, row.version), (Closed, 1));
    }
    assert_eq!(applied, 1);
    assert_eq!(ticket_row(&raw, 1, 1).await, ("closed".into(), 1, 1));
    assert!(dup(&mut c, 1, 0, (Open, Closed)).await);
    assert_eq!(ticket_row(&raw, 1, 1).await, ("closed".into(), 1, 1));

    assert!(!dup(&mut c, 2, 0, (Open, Open)).await);
    assert!(dup(&mut c, 2, 0, (Open, Open)).await);
    assert!(!dup(&mut c, 2, 1, (Open, Open)).await);
    stale(take(&mut c, (1, 2), 0, (Open, Open)).await, 0, 2);
    assert_eq!(ticket_row(&raw, 1, 2).await, ("open".into(), 2, 2));
}

/// Tenant 1's record of `Open -> Closed` at version 1 is not tenant 2's:
/// tenant 2's row with the same key, moved to `closed` at version 1 by SQL,
/// answers the same transition `Stale`, not `Duplicate`.
#[tokio::test]
async fn s54_a_record_is_not_shared_across_tenants() {
    let (_db, mut c, raw) =
        fresh("INSERT INTO t54 VALUES (1, 1, 'open', 0), (2, 1, 'open', 0)").await;
    assert!(!dup(&mut c, 1, 0, (Open, Closed)).await);
    let q = "UPDATE t54 SET status = 'closed', version = version + 1 WHERE tenant_id = 2";
    sql(&raw, q).await;
    stale(take(&mut c, (2, 1), 0, (Open, Closed)).await, 0, 1);
}

/// A state text the enum does not know (written by SQL: another spelling, a
/// new state of another build, empty) fails the read and the transition with
/// an error, never a panic, and the transition writes nothing.
#[tokio::test]
async fn s54_unknown_state_text_is_an_error_and_writes_nothing() {
    let seed = "INSERT INTO t54 VALUES (1, 1, 'Open', 0), (1, 2, 'archived', 0), (1, 3, '', 0)";
    let (_db, mut c, raw) = fresh(seed).await;
    for id in 1..=3 {
        let e = err(Ticket::find(id).tenant(1).load(&mut c).await);
        assert!(matches!(e, VersionedError::Database(_)), "{e:?}");
        for v in [0, 1] {
            let e = err(take(&mut c, (1, id), v, (Open, Closed)).await);
            use VersionedError::{Database, Stale, StateMismatch};
            let refused = matches!(e, Database(_) | StateMismatch { .. } | Stale { .. });
            assert!(refused, "{e:?}");
        }
        let (_, version, records) = ticket_row(&raw, 1, id).await;
        assert_eq!((version, records), (0, 0));
    }
}
