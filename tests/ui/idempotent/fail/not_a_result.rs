use diesel_async::AsyncPgConnection;
use idem::idempotent;

include!("../app_error.rs");

pub struct PaymentCmd {
    pub key: String,
    pub amount: i64,
    pub currency: String,
}

// The stored response is the `T` of a `Result<T, E>`.
#[idempotent(key = cmd.key, fingerprint(cmd.amount), scope = none)]
async fn pay(conn: &mut AsyncPgConnection, cmd: &PaymentCmd) -> Option<i64> {
    let _ = conn;
    Some(cmd.amount)
}

#[idempotent(key = cmd.key, fingerprint(cmd.amount), scope = none)]
async fn pay_plain(conn: &mut AsyncPgConnection, cmd: &PaymentCmd) -> i64 {
    let _ = conn;
    cmd.amount
}

// An alias that is no `Result` is caught by the type check.
type Amount = i64;

#[idempotent(key = cmd.key, fingerprint(cmd.amount), scope = none)]
async fn pay_alias(conn: &mut AsyncPgConnection, cmd: &PaymentCmd) -> Amount {
    let _ = conn;
    cmd.amount
}

#[idempotent(key = cmd.key, fingerprint(cmd.amount), scope = none)]
async fn pay_nothing(conn: &mut AsyncPgConnection, cmd: &PaymentCmd) {
    let _ = (conn, cmd);
}

fn main() {}
