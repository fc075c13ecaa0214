use diesel_async::AsyncPgConnection;
use idem::idempotent;

// It carries idem's errors, but does not say which of its errors are final.
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

pub struct PaymentCmd {
    pub key: String,
    pub amount: i64,
}

#[idempotent(key = cmd.key, fingerprint(cmd.amount), scope = none)]
async fn pay(conn: &mut AsyncPgConnection, cmd: &PaymentCmd) -> Result<i64, AppError> {
    let _ = conn;
    Ok(cmd.amount)
}

fn main() {}
