// The error type shared by the #[retryable] pass cases, which deny warnings: it
// is `pub` and `From<diesel::result::Error>`, so every variant is constructed.
// `include!("../app_error_pub.rs");` is relative to the including case.

#[derive(Debug)]
pub enum AppError {
    Db(diesel::result::Error),
    Idem(idem::Error),
}

impl From<idem::Error> for AppError {
    fn from(e: idem::Error) -> Self {
        AppError::Idem(e)
    }
}

impl From<diesel::result::Error> for AppError {
    fn from(e: diesel::result::Error) -> Self {
        AppError::Db(e)
    }
}
