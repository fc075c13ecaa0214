// The error type shared by the #[idempotent] cases: `include!("../app_error.rs");`
// (a case compiles from its own path, so the include is relative to it). A case
// whose point is the error type itself keeps its own (error_not_idempotent_error).

use idem::{IdempotencyError, IdempotentError, NoFinalErrors, RetryCause, RetryError, Transient};

#[derive(Debug)]
pub enum AppError {
    Db(diesel::result::Error),
    Idem(IdempotencyError),
    Retry(RetryError),
}

impl From<diesel::result::Error> for AppError {
    fn from(e: diesel::result::Error) -> Self {
        AppError::Db(e)
    }
}

impl From<IdempotencyError> for AppError {
    fn from(e: IdempotencyError) -> Self {
        AppError::Idem(e)
    }
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
