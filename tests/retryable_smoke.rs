use diesel::prelude::*;
use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};
use idem::{
    retryable, RetryCause, RetryError, Transient, Versioned, VersionedChanges, VersionedError,
};

diesel::table! {
    counters (id) {
        id -> Int8,
        n -> Int8,
        version -> Int8,
    }
}

#[derive(Debug, Clone, Queryable, Selectable, Versioned)]
#[diesel(table_name = counters)]
#[versioned(tenant = none, version = version, key = id)]
struct Counter {
    id: i64,
    n: i64,
    version: i64,
}

#[derive(VersionedChanges)]
#[versioned(model = Counter)]
#[diesel(table_name = counters)]
struct SetN {
    n: i64,
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Versioned(#[from] VersionedError),
    #[error(transparent)]
    Retry(#[from] RetryError),
}

impl Transient for AppError {
    fn transient(&self) -> Option<RetryCause> {
        match self {
            AppError::Versioned(e) => e.transient(),
            AppError::Retry(_) => None,
        }
    }
}

#[retryable(max = 60, deadline_ms = 20000)]
async fn bump(conn: &mut AsyncPgConnection, id: i64) -> Result<i64, AppError> {
    let c = Counter::find(id).load(conn).await?;
    let c = Counter::update(id)
        .expect_version(c.version)
        .set(&SetN { n: c.n + 1 })
        .execute(conn)
        .await?;
    Ok(c.n)
}

#[tokio::test]
async fn smoke() {
    let db = idem_testing::TestDatabase::create().await.unwrap();
    let mut conn = AsyncPgConnection::establish(db.url()).await.unwrap();
    conn.batch_execute("CREATE TABLE counters (id bigint primary key, n bigint not null, version bigint not null default 0)").await.unwrap();
    Counter {
        id: 1,
        n: 0,
        version: 0,
    }
    .insert(&mut conn)
    .await
    .unwrap();
    let pool = idem::pool::build_pool(db.url()).unwrap();
    let mut tasks = Vec::new();
    for _ in 0..10 {
        let pool = pool.clone();
        tasks.push(tokio::spawn(async move { bump(&pool, 1).await }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let c = Counter::find(1).load(&mut conn).await.unwrap();
    assert_eq!(c.n, 10);
    assert_eq!(c.version, 10);
}
