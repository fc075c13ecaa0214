use idem::idempotent;

include!("../app_error.rs");

pub struct PaymentCmd {
    pub key: String,
    pub amount: i64,
}

// No connection parameter, and no `#[retryable]`: one error, at the first
// parameter, naming `#[idempotent]` (not one about `cmd` in the fingerprint).
#[idempotent(key = cmd.key, scope = "payments", fingerprint(cmd.amount))]
async fn pay(cmd: &PaymentCmd) -> Result<i64, AppError> {
    Ok(cmd.amount)
}

fn main() {}
