use diesel::prelude::*;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idem::{
    idempotent, retryable, IdempotencyError, IdempotentError, NoFinalErrors, RetryCause,
    RetryError, Transient,
};

diesel::table! {
    payments (id) {
        id -> Int8,
        amount -> Int8,
    }
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Db(#[from] diesel::result::Error),
    #[error(transparent)]
    Idem(#[from] IdempotencyError),
    #[error(transparent)]
    Retry(#[from] RetryError),
}
impl Transient for AppError {
    fn transient(&self) -> Option<RetryCause> {
        match self {
            AppError::Db(e) => e.transient(),
            AppError::Idem(e) => e.transient(),
            AppError::Retry(_) => None,
        }
    }
}
impl IdempotentError for AppError {
    type Final = NoFinalErrors;
    fn to_final(&self) -> Option<NoFinalErrors> {
        None
    }
    fn from_final(never: NoFinalErrors) -> Self {
        match never {}
    }
}

struct Cmd {
    key: String,
    amount: i64,
}

#[idempotent(key = cmd.key, fingerprint(cmd.amount))]
#[retryable(max = 4, deadline_ms = 2000)]
async fn pay(conn: &mut AsyncPgConnection, cmd: &Cmd, id: i64) -> Result<i64, AppError> {
    diesel::insert_into(payments::table)
        .values((payments::id.eq(id), payments::amount.eq(cmd.amount)))
        .execute(conn)
        .await?;
    Ok(id)
}

#[tokio::test]
async fn smoke() {
    let db = idem_testing::TestDatabase::create().await.unwrap();
    let mut conn = AsyncPgConnection::establish(db.url()).await.unwrap();
    idem::migrate(&mut conn).await.unwrap();
    conn.batch_execute("CREATE TABLE payments (id bigint primary key, amount bigint not null)")
        .await
        .unwrap();
    let pool = idem::pool::build_pool(db.url()).unwrap();
    let cmd = Cmd {
        key: "k1".into(),
        amount: 3000,
    };
    let mut tasks = Vec::new();
    for i in 0..20 {
        let pool = pool.clone();
        let cmd = Cmd {
            key: cmd.key.clone(),
            amount: cmd.amount,
        };
        tasks.push(tokio::spawn(async move { pay(&pool, &cmd, 100 + i).await }));
    }
    let mut ids = Vec::new();
    let mut replays = 0;
    for t in tasks {
        let r = t.await.unwrap().unwrap();
        if r.replayed {
            replays += 1;
        }
        ids.push(r.value);
    }
    ids.dedup();
    assert_eq!(replays, 19);
    let n: i64 = payments::table.count().get_result(&mut conn).await.unwrap();
    assert_eq!(n, 1);
    assert!(ids.iter().all(|i| *i == ids[0]));
    let err = pay(
        &pool,
        &Cmd {
            key: "k1".into(),
            amount: 9999,
        },
        999,
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err, AppError::Idem(IdempotencyError::FingerprintMismatch)),
        "{err:?}"
    );
    let err = pay(
        &pool,
        &Cmd {
            key: "".into(),
            amount: 1,
        },
        998,
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err, AppError::Idem(IdempotencyError::InvalidKey { .. })),
        "{err:?}"
    );
}
