//! What PostgreSQL itself counted for a database, read so that the reading
//! adds nothing to it.

use std::time::{Duration, Instant};

use tokio_postgres::Client;

use crate::HarnessError;

/// `xact_commit + xact_rollback` of database `name`, read through `admin`
/// (a connection to another database), once no backend of `name` is left
/// (backends flush their counters at the latest when they exit) and the
/// counters stayed put for half a second (autovacuum's visits waited out).
/// Close every pool on `name` first; waits at most 30 s for its backends.
pub async fn settled_transactions(admin: &Client, name: &str) -> Result<i64, HarnessError> {
    const CONNECTED: &str = "SELECT count(*) FROM pg_stat_activity WHERE datname = $1";
    const COUNTED: &str =
        "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = $1";
    let failed = |statement: &str| {
        let statement = statement.to_owned();
        move |source| HarnessError::Statement { statement, source }
    };
    let wait = Duration::from_secs(30);
    let until = Instant::now() + wait;
    loop {
        let connected: i64 = admin
            .query_one(CONNECTED, &[&name])
            .await
            .map_err(failed(CONNECTED))?
            .get(0);
        if connected == 0 {
            break;
        }
        if Instant::now() > until {
            return Err(HarnessError::Timeout {
                action: format!("waiting for the backends of {name} to exit"),
                after: wait,
            });
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let read = || async {
        let clear = "SELECT pg_stat_clear_snapshot()";
        admin.batch_execute(clear).await.map_err(failed(clear))?;
        let row = admin
            .query_one(COUNTED, &[&name])
            .await
            .map_err(failed(COUNTED))?;
        Ok::<i64, HarnessError>(row.get(0))
    };
    let (mut last, mut stable) = (read().await?, 0);
    while stable < 5 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = read().await?;
        if now == last {
            stable += 1;
        } else {
            (last, stable) = (now, 0);
        }
    }
    Ok(last)
}

/// How many backends of `client`'s current database sit idle inside a
/// transaction (`idle in transaction`, aborted or not): a connection handed
/// back to a pool, or dropped on the floor, with a transaction still open,
/// which keeps its row locks until something ends it.
pub async fn idle_in_transaction(client: &Client) -> Result<i64, HarnessError> {
    const IDLE: &str = "SELECT count(*) FROM pg_stat_activity \
         WHERE datname = current_database() AND state LIKE 'idle in transaction%'";
    let row = client
        .query_one(IDLE, &[])
        .await
        .map_err(|source| HarnessError::Statement {
            statement: IDLE.to_owned(),
            source,
        })?;
    Ok(row.get(0))
}

/// Waits, at most `within`, until no backend of `client`'s current database
/// is idle inside a transaction ([`idle_in_transaction`]). A connection
/// that was closed takes a moment to lose its backend; one returned to a
/// pool inside a transaction keeps it, and this times out saying how many.
///
/// ```no_run
/// # async fn check(client: &tokio_postgres::Client) {
/// use std::time::Duration;
/// idem_testing::stats::no_session_idle_in_transaction(client, Duration::from_secs(3))
///     .await
///     .expect("no connection was left inside a transaction");
/// # }
/// ```
pub async fn no_session_idle_in_transaction(
    client: &Client,
    within: Duration,
) -> Result<(), HarnessError> {
    let until = Instant::now() + within;
    loop {
        let left = idle_in_transaction(client).await?;
        if left == 0 {
            return Ok(());
        }
        if Instant::now() >= until {
            return Err(HarnessError::Timeout {
                action: format!("waiting for {left} session(s) idle in a transaction to end"),
                after: within,
            });
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
