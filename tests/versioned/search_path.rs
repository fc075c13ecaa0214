//! The backstop reads only what idem and PostgreSQL define, whatever the
//! writing role's search_path (migration 18): a role's own operator put
//! before `pg_catalog`, or a temporary `idem_version_tombstones`, changes
//! nothing, and the guard finds idem's tables in the schema they were
//! migrated into. (A role's own `to_jsonb` and tombstone table in its schema:
//! `attack_s54`.)

use idem::versioned::backstop::install_version_guard;

use idem_testing::TestDatabase;
use tokio_postgres::Client as Raw;

use super::attack_s54::{as_role, doc_row, drop_role, fresh, refused, second_role, sql, Doc};
use super::*;

/// A role that may UPDATE puts its own `<>` on bigints before `pg_catalog`
/// (`SET search_path`), one that always says "equal": the guard still
/// refuses an UPDATE without the bump, and nothing is written.
#[tokio::test]
async fn a_role_operator_first_on_its_path_is_not_the_guards() {
    let (db, mut c, raw) = fresh("INSERT INTO d54 VALUES (1, 1, 'a', 'draft', 3)").await;
    install_version_guard::<Doc>(&mut c).await.unwrap();
    let role = second_role(&db, &raw, "SELECT, UPDATE").await;
    let other = as_role(&db, &role).await;
    let q = format!(
        "CREATE FUNCTION \"{role}\".never(bigint, bigint) RETURNS boolean
           LANGUAGE sql AS 'SELECT false';
         CREATE OPERATOR \"{role}\".<> (LEFTARG = bigint, RIGHTARG = bigint,
           FUNCTION = \"{role}\".never);
         SET search_path = \"{role}\", pg_catalog, public;"
    );
    sql(&other, &q).await;
    // The operator is the session's: a plain query finds it first.
    let row = other
        .query_one("SELECT 1::bigint <> 2::bigint", &[])
        .await
        .unwrap();
    assert!(!row.get::<_, bool>(0), "the role's own <> is in force");
    let out = other.batch_execute("UPDATE d54 SET body = 'op'").await;
    let stored = doc_row(&raw, 1, 1).await;
    drop(other);
    drop_role(&raw, &role).await;
    assert_eq!(stored, Some(("a".into(), 3)), "written past the guard");
    let err = out.expect_err("an operator of the role's own wrote past the guard");
    assert_eq!(err.code().map(|c| c.code()), Some("IDV01"), "{err:?}");
}

/// A temporary table is first on every default search_path: a role's own
/// temporary `idem_version_tombstones` does not take the tombstone of the row
/// it deletes, and the row inserted again starts above the deleted one.
#[tokio::test]
async fn a_temporary_tombstone_table_takes_nothing() {
    let (db, mut c, raw) = fresh("INSERT INTO d54 VALUES (1, 1, 'a', 'draft', 3)").await;
    install_version_guard::<Doc>(&mut c).await.unwrap();
    let read = Doc::find(1).tenant(1).load(&mut c).await.unwrap();
    let role = second_role(&db, &raw, "SELECT, DELETE").await;
    let other = as_role(&db, &role).await;
    let q = "CREATE TEMPORARY TABLE idem_version_tombstones
               (LIKE public.idem_version_tombstones INCLUDING ALL);
             DELETE FROM d54 WHERE id = 1;";
    sql(&other, q).await;
    let row = other
        .query_one("SELECT count(*) FROM idem_version_tombstones", &[])
        .await;
    let kept = row.unwrap().get::<_, i64>(0);
    drop(other);
    drop_role(&raw, &role).await;
    assert_eq!(kept, 0, "the temporary table took the tombstone");
    assert_eq!(doc_row(&raw, 1, 1).await, None);
    assert_eq!(
        read.insert(&mut c).await.unwrap().version,
        4,
        "versions repeat"
    );
}

/// Migrated into a schema of their own (`idem`, the migrating session's
/// search_path), idem's tables are where the guard looks, from a session
/// whose search_path does not name that schema: the tombstone lands there
/// and the row inserted again starts above it.
#[tokio::test]
async fn the_guard_finds_idems_tables_in_the_schema_they_were_migrated_into() {
    let (db, raw) = idem_off_the_apps_path().await;
    let path =
        "SELECT proconfig::text FROM pg_proc WHERE oid = 'idem.idem_version_guard()'::regprocedure";
    let config: String = raw.query_one(path, &[]).await.unwrap().get(0);
    assert_eq!(config, r#"{"search_path=pg_catalog, idem, pg_temp"}"#);
    // The app's session: public only.
    let mut app = AsyncPgConnection::establish(db.url()).await.unwrap();
    let read = Doc::find(1).tenant(1).load(&mut app).await.unwrap();
    refused(&raw, "UPDATE public.d54 SET body = 'no bump'", "IDV01").await;
    sql(&raw, "DELETE FROM public.d54 WHERE id = 1").await;
    let tombstones = "SELECT count(*) FROM idem.idem_version_tombstones";
    let n: i64 = raw.query_one(tombstones, &[]).await.unwrap().get(0);
    assert_eq!(n, 1, "the tombstone is in idem's schema");
    assert_eq!(
        read.insert(&mut app).await.unwrap().version,
        4,
        "versions repeat"
    );
}

/// A fresh database with idem migrated into schema `idem` (the migrating
/// session's search_path) and `public.d54`, its row (1, 1) at version 3,
/// guarded by `idem.idem_version_guard`; a raw client on `public` only.
pub(super) async fn idem_off_the_apps_path() -> (TestDatabase, Raw) {
    let db = TestDatabase::create().await.unwrap();
    let raw = idem_testing::connect(db.url()).await.unwrap();
    sql(&raw, "CREATE SCHEMA idem").await;
    let url = format!("{}?options=-csearch_path%3Didem", db.url());
    let mut c = AsyncPgConnection::establish(&url).await.unwrap();
    idem::migrate(&mut c).await.unwrap();
    let q = "CREATE TABLE public.d54 (tenant_id bigint NOT NULL, id bigint NOT NULL,
               body text NOT NULL, status text NOT NULL, version bigint NOT NULL DEFAULT 0,
               PRIMARY KEY (tenant_id, id));
             INSERT INTO public.d54 VALUES (1, 1, 'a', 'draft', 3);
             CREATE TRIGGER idem_version_guard BEFORE INSERT OR UPDATE OR DELETE ON public.d54
               FOR EACH ROW EXECUTE FUNCTION idem.idem_version_guard('version', 'tenant_id', 'id');";
    sql(&raw, q).await;
    (db, raw)
}
