//! The gauges the jobs worker sets (feature `metrics`): `idem_jobs_due`,
//! `idem_jobs_running`, `idem_jobs_dead` and `idem_jobs_oldest_due_seconds`,
//! read from a local recorder after one round of `Worker::run` against a
//! real database whose rows the test set up and counts itself.
#![cfg(feature = "metrics")]

use std::collections::BTreeMap;
use std::time::Duration;

use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};
use idem_runtime::jobs::{enqueue, enqueue_after, EnqueueError, Job, Ladder, Worker};
use idem_runtime::pool::{build_pool_with, PoolConfig};
use idem_runtime::retry::{retry, RetryPolicy};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use scoped_futures::ScopedFutureExt;

#[derive(serde::Serialize, serde::Deserialize)]
struct Compensate {
    key: String,
}

impl Job for Compensate {
    const KIND: &'static str = "compensate";
    fn key(&self) -> String {
        self.key.clone()
    }
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] idem_runtime::Error),
    #[error(transparent)]
    Enqueue(#[from] EnqueueError),
    #[error("refused")]
    Refused,
}

fn gauges(snapshotter: &Snapshotter) -> BTreeMap<String, f64> {
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter_map(|(key, _, _, value)| match value {
            DebugValue::Gauge(v) => Some((key.key().name().to_owned(), v.into_inner())),
            _ => None,
        })
        .collect()
}

async fn scenario(snapshotter: &Snapshotter) {
    let db = idem_testing::TestDatabase::create()
        .await
        .expect("create the test database");
    let mut conn = AsyncPgConnection::establish(db.url())
        .await
        .expect("connect");
    idem_runtime::migrate(&mut conn).await.expect("migrate");
    let pool = build_pool_with(
        db.url(),
        &PoolConfig {
            max_size: 4,
            wait_timeout: Duration::from_secs(10),
            ..Default::default()
        },
    )
    .expect("pool");
    let result: Result<(), AppError> = retry(&pool, RetryPolicy::new(), "setup", |conn| {
        async move {
            for key in ["ok", "bad"] {
                enqueue(conn, &Compensate { key: key.into() }).await?;
            }
            let later = Compensate {
                key: "later".into(),
            };
            enqueue_after(conn, &later, Duration::from_secs(3600)).await?;
            Ok(())
        }
        .scope_boxed()
    })
    .await;
    result.expect("enqueued");
    // A job of a kind this worker does not run, held by some other worker.
    conn.batch_execute(
        "INSERT INTO idem_jobs (kind, key, payload, state, attempts, locked_until)
         VALUES ('other', 'x', '{}', 'running', 1, now() + interval '1 minute')",
    )
    .await
    .expect("insert");

    let worker =
        Worker::new(pool.clone())
            .ladder(Ladder::new([]))
            .handle(|_conn, job: &Compensate| {
                let bad = job.key == "bad";
                async move {
                    if bad {
                        Err(AppError::Refused)
                    } else {
                        Ok(())
                    }
                }
                .scope_boxed()
            });
    // A shutdown that is already due: one round, then the gauges, then out.
    worker.run(async {}).await.expect("run");

    let counted: (i64, i64, i64) = {
        let client = idem_testing::connect(db.url()).await.expect("connect");
        let row = client
            .query_one(
                "SELECT count(*) FILTER (WHERE state = 'due'),
                        count(*) FILTER (WHERE state = 'running'),
                        count(*) FILTER (WHERE state = 'dead') FROM idem_jobs",
                &[],
            )
            .await
            .expect("count");
        (row.get(0), row.get(1), row.get(2))
    };
    assert_eq!(counted, (1, 1, 1), "later due, other running, bad dead");
    assert_eq!(
        gauges(snapshotter),
        BTreeMap::from([
            ("idem_jobs_dead".to_owned(), counted.2 as f64),
            ("idem_jobs_due".to_owned(), counted.0 as f64),
            ("idem_jobs_oldest_due_seconds".to_owned(), 0.0),
            ("idem_jobs_running".to_owned(), counted.1 as f64),
        ])
    );
}

#[test]
fn the_worker_sets_the_queue_gauges() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    metrics::with_local_recorder(&recorder, || runtime.block_on(scenario(&snapshotter)));
}
