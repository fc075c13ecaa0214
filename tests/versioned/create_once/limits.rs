//! What `create_once` answers where the table does not behave as the key
//! alone would: the row it met deleted before its read, and `BEFORE
//! INSERT` triggers that drop the row or rewrite a fingerprint field (the
//! limits docs/versioned.md names). Found by a hostile pass.

use diesel::sql_types::{BigInt, Integer};

use super::*;

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

async fn count_where(env: &Env, condition: &str) -> i64 {
    diesel::sql_query(format!(
        "SELECT count(*) AS n FROM shop_orders WHERE {condition}"
    ))
    .get_result::<Count>(&mut env.conn().await)
    .await
    .unwrap()
    .n
}

async fn backend_pid(conn: &mut AsyncPgConnection) -> i32 {
    #[derive(QueryableByName)]
    struct Pid {
        #[diesel(sql_type = Integer)]
        pid: i32,
    }
    diesel::sql_query("SELECT pg_backend_pid() AS pid")
        .get_result::<Pid>(conn)
        .await
        .unwrap()
        .pid
}

/// Until the backend `pid` waits on a lock: its statement really blocked.
async fn until_blocked(env: &Env, pid: i32) {
    let mut observer = env.conn().await;
    for _ in 0..1000 {
        let waiting = diesel::sql_query(format!(
            "SELECT count(*) AS n FROM pg_stat_activity WHERE pid = {pid} AND wait_event_type = 'Lock'"
        ))
        .get_result::<Count>(&mut observer)
        .await
        .unwrap();
        if waiting.n == 1 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("backend {pid} never blocked");
}

/// At READ COMMITTED a loser's INSERT waits for the winner's row and writes
/// nothing; if the row is deleted before the loser's read, the key is free
/// again. The loser must then create (or, if its read came first, get the
/// row), never answer `Conflict` (409: another row holds a unique value),
/// which `#[retryable]` does not replay. A deleter queued behind the
/// winner (an advisory lock the winner holds) runs its DELETE as the
/// winner commits, in the window between the loser's INSERT and its read;
/// before the second try, 7 of 20 rounds answered `Conflict` with no row
/// in the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_row_deleted_before_the_read_leaves_the_key_free() {
    let env = env(2).await;
    let mut answers = Vec::new();
    for i in 0..20i64 {
        let key = format!("gone-{i}");
        let mut winner = env.conn().await;
        winner
            .batch_execute("BEGIN; SELECT pg_advisory_xact_lock(7)")
            .await
            .unwrap();
        let created = order(1, i, &key, 1).create_once(&mut winner).await;
        assert!(matches!(created, Ok(Creation::Created(_))), "{created:?}");

        let mut loser = env.conn().await;
        let loser_pid = backend_pid(&mut loser).await;
        let row = order(1, i, &key, 1);
        let lose = tokio::spawn(async move { row.create_once(&mut loser).await });
        until_blocked(&env, loser_pid).await;

        let mut deleter = env.conn().await;
        let deleter_pid = backend_pid(&mut deleter).await;
        let delete = format!(
            "SELECT pg_advisory_xact_lock(7); DELETE FROM shop_orders WHERE request_id = '{key}'"
        );
        let deleted = tokio::spawn(async move { deleter.batch_execute(&delete).await });
        until_blocked(&env, deleter_pid).await;

        winner.batch_execute("COMMIT").await.unwrap();
        let answer = lose.await.unwrap();
        deleted.await.unwrap().unwrap();
        let rows = count_where(&env, &format!("request_id = '{key}' OR id = {i}")).await;
        match &answer {
            // Created after the delete: its row is the one left.
            Ok(Creation::Created(row)) => {
                assert_eq!((row.id, rows), (i, 1), "round {i}");
            }
            // Read before the delete, which then removed it.
            Ok(Creation::Existing(row)) => {
                assert_eq!((row.id, rows), (i, 0), "round {i}");
            }
            other => panic!("round {i}: {other:?} with {rows} rows under the key"),
        }
        answers.push(answer.unwrap().is_created());
    }
    eprintln!(
        "created after the delete: {} of 20",
        answers.iter().filter(|c| **c).count()
    );
}

/// A trigger that drops the row is answered as a conflict (PostgreSQL
/// reports it as one: no row), one that raises as a database error;
/// nothing is written either way.
#[tokio::test]
async fn a_trigger_that_drops_the_row_is_a_conflict_and_one_that_raises_an_error() {
    let env = env(2).await;
    let mut conn = env.conn().await;
    conn.batch_execute(
        "CREATE FUNCTION screen() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
             IF NEW.amount > 1000 THEN RAISE EXCEPTION 'too much'; END IF;
             IF NEW.amount < 0 THEN RETURN NULL; END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER screen BEFORE INSERT ON shop_orders
             FOR EACH ROW EXECUTE FUNCTION screen();",
    )
    .await
    .unwrap();
    let dropped = order(1, 1, "dropped", -1).create_once(&mut conn).await;
    assert!(
        matches!(dropped, Err(CreateOnceError::Conflict)),
        "{dropped:?}"
    );
    let raised = order(1, 2, "raised", 5000).create_once(&mut conn).await;
    assert!(
        matches!(raised, Err(CreateOnceError::Database(_))),
        "{raised:?}"
    );
    assert_eq!(count_where(&env, "true").await, 0);
}

/// A trigger that rewrites a fingerprint field: `Created` returns the row
/// as stored, and a repeat that sends the field as before is a `Mismatch`
/// (the fingerprint compares what is stored with what is sent).
#[tokio::test]
async fn a_trigger_that_rewrites_a_fingerprint_field_makes_the_repeat_a_mismatch() {
    let env = env(2).await;
    let mut conn = env.conn().await;
    conn.batch_execute(
        "CREATE FUNCTION lower_note() RETURNS trigger LANGUAGE plpgsql AS
             $$ BEGIN NEW.note := lower(NEW.note); RETURN NEW; END $$;
         CREATE TRIGGER lower_note BEFORE INSERT ON shop_orders
             FOR EACH ROW EXECUTE FUNCTION lower_note();",
    )
    .await
    .unwrap();
    let mut row = order(1, 1, "gift", 10);
    row.note = Some("Gift".into());
    match row.create_once(&mut conn).await {
        Ok(Creation::Created(stored)) => assert_eq!(stored.note.as_deref(), Some("gift")),
        other => panic!("{other:?}"),
    }
    let repeat = row.create_once(&mut conn).await;
    assert!(
        matches!(&repeat, Err(CreateOnceError::Mismatch { fields }) if fields == &["note"]),
        "{repeat:?}"
    );
    row.note = Some("gift".into());
    assert!(matches!(
        row.create_once(&mut conn).await,
        Ok(Creation::Existing(_))
    ));
    assert_eq!(count_where(&env, "true").await, 1);
}
