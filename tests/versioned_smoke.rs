use diesel::prelude::*;
use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};
use idem::{Versioned, VersionedChanges, VersionedError};

diesel::table! {
    documents (tenant_id, document_id) {
        tenant_id -> Int8,
        document_id -> Int8,
        body -> Jsonb,
        status -> Text,
        version -> Int8,
    }
}

#[derive(Debug, Clone, Queryable, Selectable, Versioned)]
#[diesel(table_name = documents)]
#[versioned(tenant = tenant_id, version = version, key = document_id, state = status)]
struct Document {
    tenant_id: i64,
    document_id: i64,
    body: serde_json::Value,
    status: String,
    version: i64,
}

#[derive(VersionedChanges)]
#[versioned(model = Document)]
#[diesel(table_name = documents)]
struct Edit {
    body: serde_json::Value,
}

#[tokio::test]
async fn smoke() {
    let db = idem_testing::TestDatabase::create().await.unwrap();
    let mut conn = AsyncPgConnection::establish(db.url()).await.unwrap();
    conn.batch_execute("CREATE TABLE documents (tenant_id bigint, document_id bigint, body jsonb NOT NULL, status text NOT NULL, version bigint NOT NULL DEFAULT 0 CHECK (version >= 0), PRIMARY KEY (tenant_id, document_id))").await.unwrap();
    let doc = Document {
        tenant_id: 1,
        document_id: 7,
        body: serde_json::json!({"a": 1}),
        status: "draft".into(),
        version: 42,
    };
    let stored = doc.insert(&mut conn).await.unwrap();
    assert_eq!(stored.version, 0);
    let loaded = Document::find(7).tenant(1).load(&mut conn).await.unwrap();
    assert_eq!(loaded.version, 0);
    let edit = Edit {
        body: serde_json::json!({"a": 2}),
    };
    let updated = Document::update(7)
        .tenant(1)
        .expect_version(0)
        .set(&edit)
        .execute(&mut conn)
        .await
        .unwrap();
    assert_eq!(updated.version, 1);
    let err = Document::update(7)
        .tenant(1)
        .expect_version(0)
        .set(&edit)
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            VersionedError::Stale {
                expected: 0,
                actual: 1
            }
        ),
        "{err:?}"
    );
    let err = Document::update(7)
        .tenant(2)
        .expect_version(1)
        .set(&edit)
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert!(matches!(err, VersionedError::NotFound), "{err:?}");
    let err = Document::update(7)
        .tenant(1)
        .expect_version(1)
        .expect_state("published".into())
        .set(&edit)
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert!(
        matches!(err, VersionedError::StateMismatch { .. }),
        "{err:?}"
    );
    Document::delete(7)
        .tenant(1)
        .expect_version(1)
        .execute(&mut conn)
        .await
        .unwrap();
}
