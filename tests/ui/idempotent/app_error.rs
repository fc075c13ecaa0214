// The error type shared by the #[idempotent] cases: `include!("../app_error.rs");`
// (a case compiles from its own path, so the include is relative to it). A case
// whose point is the error type itself keeps its own (error_not_idempotent_error).

#[derive(Debug)]
pub enum AppError {
    Db(diesel::result::Error),
    Idem(idem::Error),
}

impl From<diesel::result::Error> for AppError {
    fn from(e: diesel::result::Error) -> Self {
        AppError::Db(e)
    }
}

impl From<idem::Error> for AppError {
    fn from(e: idem::Error) -> Self {
        AppError::Idem(e)
    }
}

idem::final_errors!(AppError);
