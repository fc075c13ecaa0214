// The error type shared by the #[retryable] fail cases: `include!("../app_error.rs");`
// (a case compiles from its own path, so the include is relative to it). A case
// whose point is the error type itself keeps its own (error_not_transient).

use idem::{RetryCause, RetryError, Transient};

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
