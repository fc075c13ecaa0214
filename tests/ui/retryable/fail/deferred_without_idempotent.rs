use idem::{retryable, Deferred};

include!("../app_error.rs");

// A #[retryable] body runs in its attempt's transaction.
#[retryable]
async fn transfer(db: &mut Deferred<'_>) -> Result<(), AppError> {
    let _ = db;
    Ok(())
}

fn main() {}
