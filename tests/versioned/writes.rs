//! The tenanted `Document`: concurrent writers, tenants, stale / not found / state, delete, insert.

use super::*;

const WRITERS: usize = 50;
/// Connections of the concurrency test, well below the server's
/// `max_connections` even with the other tests of this binary running.
const POOL_SIZE: usize = 20;

#[tokio::test]
async fn fifty_concurrent_writers_of_one_version_one_wins() {
    let (db, mut conn) = setup().await;
    doc(1, 7, "draft").insert(&mut conn).await.unwrap();

    let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new(db.url());
    let pool = Pool::builder(manager).max_size(POOL_SIZE).build().unwrap();
    let barrier = Arc::new(Barrier::new(WRITERS));
    let mut tasks = Vec::new();
    for writer in 0..WRITERS {
        let pool = pool.clone();
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            let read = {
                let mut conn = pool.get().await.unwrap();
                Document::find(7).tenant(1).load(&mut conn).await.unwrap()
            };
            // Nobody writes before everybody has read version 0.
            barrier.wait().await;
            let mut conn = pool.get().await.unwrap();
            let outcome = Document::update(7)
                .tenant(1)
                .expect_version(read.version)
                .set(&Edit {
                    body: json!({ "writer": writer }),
                })
                .execute(&mut conn)
                .await;
            (writer, read.version, outcome)
        }));
    }

    let mut winners = Vec::new();
    let mut stale = 0;
    for task in tasks {
        let (writer, read_version, outcome) = task.await.unwrap();
        assert_eq!(read_version, 0);
        match outcome {
            Ok(row) => {
                assert_eq!(row.version, 1);
                winners.push(writer);
            }
            Err(err) => {
                assert_stale(&err, 0, 1);
                stale += 1;
            }
        }
    }
    assert_eq!(winners.len(), 1, "winners: {winners:?}");
    assert_eq!(stale, WRITERS - 1);

    let stored = all_documents(&mut conn).await;
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].version, 1);
    assert_eq!(stored[0].body, json!({ "writer": winners[0] }));
}

#[tokio::test]
async fn right_key_and_version_under_another_tenant_is_not_found() {
    let (_db, mut conn) = setup().await;
    let original = doc(1, 7, "draft").insert(&mut conn).await.unwrap();
    let edit = Edit {
        body: json!("hijacked"),
    };

    let err = Document::update(7)
        .tenant(2)
        .expect_version(0)
        .set(&edit)
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert_not_found(&err);
    let err = Document::delete(7)
        .tenant(2)
        .expect_version(0)
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert_not_found(&err);
    let err = Document::find(7)
        .tenant(2)
        .load(&mut conn)
        .await
        .unwrap_err();
    assert_not_found(&err);
    assert_eq!(all_documents(&mut conn).await, vec![original.clone()]);

    // The same key in tenant 2 is another row: writing it leaves tenant 1's alone,
    // and its conflicts are reported against its own version.
    doc(2, 7, "draft").insert(&mut conn).await.unwrap();
    let theirs = Document::update(7)
        .tenant(2)
        .expect_version(0)
        .set(&edit)
        .execute(&mut conn)
        .await
        .unwrap();
    assert_eq!((theirs.version, theirs.body), (1, json!("hijacked")));
    let err = Document::update(7)
        .tenant(2)
        .expect_version(0)
        .set(&edit)
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert_stale(&err, 0, 1);
    let mine = Document::find(7).tenant(1).load(&mut conn).await.unwrap();
    assert_eq!(mine, original);
    assert_eq!(mine.body, json!({"doc": 7, "tenant": 1}));
    assert_eq!(mine.version, 0);
}

#[tokio::test]
async fn stale_not_found_and_state_mismatch_are_told_apart() {
    let (_db, mut conn) = setup().await;
    doc(1, 1, "draft").insert(&mut conn).await.unwrap();
    doc(1, 2, "draft").insert(&mut conn).await.unwrap();
    let publish = SetStatus {
        status: "published".into(),
    };
    let archive = SetStatus {
        status: "archived".into(),
    };

    // draft -> published, guarded.
    let published = Document::update(1)
        .tenant(1)
        .expect_version(0)
        .expect_state("draft".into())
        .set(&publish)
        .execute(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        (published.status.as_str(), published.version),
        ("published", 1)
    );

    // The same transition again, from the current version: the state refuses it.
    let err = Document::update(1)
        .tenant(1)
        .expect_version(1)
        .expect_state("draft".into())
        .set(&publish)
        .execute(&mut conn)
        .await
        .unwrap_err();
    match &err {
        VersionedError::StateMismatch { expected, actual } => {
            assert_eq!(expected, "\"draft\"");
            assert_eq!(actual, "\"published\"");
        }
        other => panic!("expected StateMismatch, got {other:?}"),
    }
    assert_eq!(err.http_status(), 409);

    // The same transition again, replayed with the version it was first sent with: stale.
    let err = Document::update(1)
        .tenant(1)
        .expect_version(0)
        .expect_state("draft".into())
        .set(&publish)
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert_stale(&err, 0, 1);

    // Out of order: published -> archived on a row that is still a draft.
    let err = Document::update(2)
        .tenant(1)
        .expect_version(0)
        .expect_state("published".into())
        .set(&archive)
        .execute(&mut conn)
        .await
        .unwrap_err();
    match &err {
        VersionedError::StateMismatch { expected, actual } => {
            assert_eq!(expected, "\"published\"");
            assert_eq!(actual, "\"draft\"");
        }
        other => panic!("expected StateMismatch, got {other:?}"),
    }

    // No such row, with or without a state precondition.
    let err = Document::update(99)
        .tenant(1)
        .expect_version(0)
        .expect_state("draft".into())
        .set(&publish)
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert_not_found(&err);

    // None of the refused writes changed anything.
    let stored = all_documents(&mut conn).await;
    assert_eq!(
        stored
            .iter()
            .map(|d| (d.document_id, d.status.as_str(), d.version))
            .collect::<Vec<_>>(),
        vec![(1, "published", 1), (2, "draft", 0)]
    );
}

#[tokio::test]
async fn delete_with_a_stale_version_is_stale_and_the_row_stays() {
    let (_db, mut conn) = setup().await;
    doc(1, 1, "draft").insert(&mut conn).await.unwrap();
    let edited = Document::update(1)
        .tenant(1)
        .expect_version(0)
        .set(&Edit { body: json!(2) })
        .execute(&mut conn)
        .await
        .unwrap();

    let err = Document::delete(1)
        .tenant(1)
        .expect_version(0)
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert_stale(&err, 0, 1);
    assert_eq!(all_documents(&mut conn).await, vec![edited]);

    Document::delete(1)
        .tenant(1)
        .expect_version(1)
        .execute(&mut conn)
        .await
        .unwrap();
    assert!(all_documents(&mut conn).await.is_empty());
    let err = Document::delete(1)
        .tenant(1)
        .expect_version(1)
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert_not_found(&err);
}

#[tokio::test]
async fn insert_starts_at_version_zero_whatever_the_field_holds() {
    let (_db, mut conn) = setup().await;
    for (id, claimed) in [(1, 42), (2, -5), (3, i64::MAX)] {
        let mut row = doc(1, id, "draft");
        row.version = claimed;
        let stored = row.insert(&mut conn).await.unwrap();
        assert_eq!(stored, Document { version: 0, ..row });
    }
    let versions: Vec<i64> = documents::table
        .select(documents::version)
        .load(&mut conn)
        .await
        .unwrap();
    assert_eq!(versions, vec![0, 0, 0]);
}
