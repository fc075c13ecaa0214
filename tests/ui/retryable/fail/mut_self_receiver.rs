use diesel_async::AsyncPgConnection;
use idem::retryable;

include!("../app_error.rs");

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
