// The error type shared by the #[retryable] fail cases: `include!("../app_error.rs");`
// (a case compiles from its own path, so the include is relative to it). A case
// whose point is the error type itself keeps its own (error_not_from_idem_error).

#[derive(Debug)]
enum AppError {
    Db(diesel::result::Error),
    Idem(idem::Error),
}

impl From<idem::Error> for AppError {
    fn from(e: idem::Error) -> Self {
        AppError::Idem(e)
    }
}
