#![deny(warnings)]

use diesel_async::AsyncPgConnection;
use idem::{idempotent, Idempotent, Pool};

include!("../app_error.rs");

pub struct PaymentCmd {
    pub key: String,
    pub amount: i64,
    pub currency: String,
}

pub struct Ctx {
    pub tenant_id: i64,
    pub user_id: i64,
    // Not Copy: the scope tuple borrows it (regression: `(ctx.tenant_id,
    // ctx.conversation)` tried to move the String out of `&Ctx`).
    pub conversation: String,
}

// A key space per (tenant, user); a by-value parameter used only in the scope.
#[idempotent(key = cmd.key, scope = (ctx.tenant_id, ctx.user_id, ctx.conversation, region), fingerprint(cmd.amount, cmd.currency))]
async fn pay(
    conn: &mut AsyncPgConnection,
    ctx: &Ctx,
    region: u8,
    cmd: &PaymentCmd,
) -> Result<i64, AppError> {
    let _ = conn;
    Ok(ctx.tenant_id + cmd.amount)
}

async fn caller(pool: &Pool, cmd: &PaymentCmd) -> Result<Idempotent<i64>, AppError> {
    pay(
        pool,
        &Ctx {
            tenant_id: 1,
            user_id: 2,
            conversation: "c-1".to_owned(),
        },
        3,
        cmd,
    )
    .await
}

fn main() {
    let _ = caller;
}
