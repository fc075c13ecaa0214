//! An internal error is a 500 problem, logged with its cause.

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};

use diesel_async::SimpleAsyncConnection;

use crate::testkit::Ledger;
use crate::EUR;

/// A `Write` into a shared buffer: the log the test reads.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("the log").extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The process's one subscriber, writing ERROR events into a buffer.
fn captured_log() -> Captured {
    static LOG: OnceLock<Captured> = OnceLock::new();
    LOG.get_or_init(|| {
        let log = Captured::default();
        let writer = log.clone();
        tracing_subscriber::fmt()
            .with_env_filter("error")
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .init();
        log
    })
    .clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_internal_error_is_a_500_problem_logged_with_its_cause() {
    let log = captured_log();
    let mut ledger = Ledger::start().await;
    let account = ledger.client.open_account(EUR).await;
    // A constraint only this test has: every movement now fails in the
    // database, which no client can cause or fix.
    ledger
        .conn
        .batch_execute(
            "ALTER TABLE ledger_transfers \
             ADD CONSTRAINT test_refuses_every_movement CHECK (amount < 0) NOT VALID",
        )
        .await
        .expect("the constraint");

    let reply = ledger.client.top_up("broken", account, 5, EUR).await;
    assert_eq!(reply.status, 500, "{reply:?}");
    assert_eq!(reply.body["type"], "urn:idem:problem:internal");
    assert!(
        !reply.to_owned().body.to_string().contains("test_refuses"),
        "the cause is logged, not sent: {reply:?}"
    );
    let log = String::from_utf8_lossy(&log.0.lock().expect("the log")).into_owned();
    assert!(
        log.contains("ERROR") && log.contains("test_refuses_every_movement"),
        "the log names the cause: {log}"
    );
}
