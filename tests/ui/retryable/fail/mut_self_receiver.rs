use diesel_async::AsyncPgConnection;
use idem::{retryable, RetryCause, RetryError, Transient};

#[derive(Debug)]
enum AppError {
    Db(diesel::result::Error),
    Retry(RetryError),
}

impl From<RetryError> for AppError {
    fn from(e: RetryError) -> Self {
        AppError::Retry(e)
    }
}

impl Transient for AppError {
    fn transient(&self) -> Option<RetryCause> {
        match self {
            AppError::Db(e) => e.transient(),
            AppError::Retry(_) => None,
        }
    }
}

struct Ledger {
    entries: u32,
}

impl Ledger {
    // The body is replayed: it cannot mutate `self` once per attempt.
    #[retryable]
    async fn record(&mut self, conn: &mut AsyncPgConnection) -> Result<(), AppError> {
        let _ = conn;
        self.entries += 1;
        Ok(())
    }
}

fn main() {}
