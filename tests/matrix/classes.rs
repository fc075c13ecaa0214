//! Every failure class, and the other session that brings it about.

use std::sync::Mutex;

use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idem::RetryCause;
use tokio::task::JoinHandle;

use super::{wait_for_backend, Env};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// 40001: the row changed after the attempt's snapshot (REPEATABLE READ).
    Serialization,
    /// 40P01: the attempt is the deadlock's victim.
    Deadlock,
    /// 55P03 from idem's own `lock_timeout`: a row held by another session.
    LockTimeout,
    /// 57014 from idem's own `statement_timeout`: the deadline passed.
    StatementTimeout,
    /// The backend terminated while the statement waits.
    ConnectionLost,
    /// A user's 23505.
    UniqueViolation,
    /// A user's 22012.
    DivisionByZero,
}

impl Class {
    /// Replayed, and met on the first attempt only.
    pub fn transient(self) -> bool {
        matches!(
            self,
            Class::Serialization | Class::Deadlock | Class::LockTimeout | Class::ConnectionLost
        )
    }

    /// The call runs into its deadline with this cause.
    pub fn deadline_cause(self) -> Option<RetryCause> {
        (self == Class::StatementTimeout).then_some(RetryCause::DeadlineExceeded)
    }

    /// Met by whatever writes the row (a versioned update too).
    pub fn on_the_row(self) -> bool {
        self.transient()
    }

    /// The failing expression for `row`.
    pub fn sql(self, row: i64) -> String {
        match self {
            Class::Serialization | Class::Deadlock | Class::LockTimeout | Class::ConnectionLost => {
                format!("matrix_lock({row})")
            }
            Class::StatementTimeout => "matrix_sleep(30)".to_owned(),
            Class::UniqueViolation => "matrix_dup()".to_owned(),
            Class::DivisionByZero => "matrix_div()".to_owned(),
        }
    }
}

/// The other session of one cell.
pub struct Side {
    class: Class,
    row: i64,
    /// Holds the cell's row locked (lock timeout, lost connection) until
    /// the second attempt begins.
    holder: Option<tokio_postgres::Client>,
    /// A task of the cell's (the deadlock's other party, the terminator).
    task: Mutex<Option<JoinHandle<()>>>,
    released: Mutex<bool>,
}

impl Side {
    pub async fn prepare(env: &Env, class: Class, row: i64) -> Side {
        let holder = match class {
            Class::LockTimeout | Class::ConnectionLost => Some(env.hold_row(row).await),
            _ => None,
        };
        Side {
            class,
            row,
            holder,
            task: Mutex::new(None),
            released: Mutex::new(false),
        }
    }

    /// Bring the failure about, on the first attempt; get out of the way on
    /// the next.
    pub async fn before(&self, env: &Env, conn: &mut AsyncPgConnection, attempt: u32) {
        if attempt > 1 {
            self.release().await;
            return;
        }
        let row = self.row;
        match self.class {
            // After the attempt's snapshot (its first statement took it).
            Class::Serialization => {
                env.client
                    .batch_execute(&format!("UPDATE counters SET n = n + 1 WHERE id = {row}"))
                    .await
                    .unwrap();
            }
            Class::Deadlock => {
                // This attempt holds the second row and is quick to detect the
                // deadlock; the other party holds the cell's row, waits for the
                // second, and detects late, so this attempt is the victim.
                conn.batch_execute(&format!(
                    "SET LOCAL deadlock_timeout = '50ms'; \
                     UPDATE counters SET n = n WHERE id = {}",
                    row + 1000
                ))
                .await
                .unwrap();
                let other = idem_testing::connect(env.db.url()).await.unwrap();
                let pid: i32 = other
                    .query_one("SELECT pg_backend_pid()", &[])
                    .await
                    .unwrap()
                    .get(0);
                let task = tokio::spawn(async move {
                    other
                        .batch_execute(&format!(
                            "BEGIN; SET LOCAL deadlock_timeout = '10s'; \
                             SELECT 1 FROM counters WHERE id = {row} FOR UPDATE; \
                             SELECT 1 FROM counters WHERE id = {} FOR UPDATE; COMMIT",
                            row + 1000
                        ))
                        .await
                        .unwrap();
                });
                *self.task.lock().unwrap() = Some(task);
                wait_for_backend(&env.client, pid, "wait_event_type = 'Lock'").await;
            }
            Class::ConnectionLost => {
                let pid: i32 = diesel::select(diesel::dsl::sql::<diesel::sql_types::Integer>(
                    "pg_backend_pid()",
                ))
                .get_result(conn)
                .await
                .unwrap();
                let url = env.db.url().to_owned();
                let task = tokio::spawn(async move {
                    let killer = idem_testing::connect(&url).await.unwrap();
                    wait_for_backend(&killer, pid, "wait_event_type = 'Lock'").await;
                    killer
                        .query_one("SELECT pg_terminate_backend($1)", &[&pid])
                        .await
                        .unwrap();
                });
                *self.task.lock().unwrap() = Some(task);
            }
            _ => {}
        }
    }

    async fn release(&self) {
        if std::mem::replace(&mut *self.released.lock().unwrap(), true) {
            return;
        }
        if let Some(holder) = &self.holder {
            holder.batch_execute("ROLLBACK").await.unwrap();
        }
    }

    /// After the call: the other party done, the row free.
    pub async fn finish(&self, _env: &Env) {
        self.release().await;
        let task = self.task.lock().unwrap().take();
        if let Some(task) = task {
            task.await.expect("the other session of the cell");
        }
    }
}
