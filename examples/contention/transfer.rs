//! One transfer, as each strategy writes it.

use super::schema::{contention_accounts, contention_entries, Account, NewEntry, SetBalance};
use super::*;

#[derive(Debug, Clone, Copy)]
pub(crate) struct Transfer {
    pub(crate) id: i64,
    pub(crate) from: i64,
    pub(crate) to: i64,
    pub(crate) amount: i64,
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum TransferError {
    #[error(transparent)]
    Versioned(#[from] VersionedError),
    #[error(transparent)]
    Db(#[from] diesel::result::Error),
    #[error(transparent)]
    Idem(#[from] idem::Error),
    #[error("insufficient funds in account {0}")]
    InsufficientFunds(i64),
}

/// The attempt this body runs in: the last one is the writer's attempt count.
fn attempt_number() -> u32 {
    idem::attempt::current_attempt().unwrap_or(1)
}

/// The debit and the credit of a transfer: the truth behind both caches.
async fn append_entries(conn: &mut AsyncPgConnection, t: Transfer) -> Result<(), TransferError> {
    diesel::insert_into(contention_entries::table)
        .values(&[
            NewEntry {
                transfer_id: t.id,
                account_id: t.from,
                amount: -t.amount,
            },
            NewEntry {
                transfer_id: t.id,
                account_id: t.to,
                amount: t.amount,
            },
        ])
        .execute(conn)
        .await?;
    Ok(())
}

/// The optimistic and adaptive body: read both accounts (in id order), write
/// both back with the version each was read at, append the entries. Under
/// `on_conflict = lock` the same two loads become `SELECT .. FOR UPDATE` after a
/// conflict, without a change here.
async fn transfer_versioned(
    conn: &mut AsyncPgConnection,
    t: Transfer,
) -> Result<u32, TransferError> {
    let (lo, hi) = (t.from.min(t.to), t.from.max(t.to));
    let lo = Account::find(lo).load(conn).await?;
    let hi = Account::find(hi).load(conn).await?;
    let delta = |account: &Account| {
        if account.id == t.from {
            -t.amount
        } else {
            t.amount
        }
    };
    for account in [&lo, &hi] {
        let balance = account.balance + delta(account);
        if balance < 0 {
            return Err(TransferError::InsufficientFunds(account.id));
        }
        Account::update(account.id)
            .expect_version(account.version)
            .set(&SetBalance { balance })
            .execute(conn)
            .await?;
    }
    append_entries(conn, t).await?;
    Ok(attempt_number())
}

#[retryable(max = 200, deadline_ms = 60000)]
pub(crate) async fn optimistic(
    conn: &mut AsyncPgConnection,
    t: Transfer,
) -> Result<u32, TransferError> {
    transfer_versioned(conn, t).await
}

#[retryable(max = 200, deadline_ms = 60000, on_conflict = lock)]
pub(crate) async fn adaptive(
    conn: &mut AsyncPgConnection,
    t: Transfer,
) -> Result<u32, TransferError> {
    transfer_versioned(conn, t).await
}

/// `adaptive` without the memory of hot rows: every burst starts optimistic,
/// so this is what the first burst on a row costs.
#[retryable(max = 200, deadline_ms = 60000, on_conflict = lock, hot_row_memory_ms = 0)]
pub(crate) async fn adaptive_cold(
    conn: &mut AsyncPgConnection,
    t: Transfer,
) -> Result<u32, TransferError> {
    transfer_versioned(conn, t).await
}

/// Lock both rows in id order (so two transfers cannot deadlock), then write
/// them with plain updates: no other writer can have changed them.
#[retryable(max = 200, deadline_ms = 60000)]
pub(crate) async fn pessimistic(
    conn: &mut AsyncPgConnection,
    t: Transfer,
) -> Result<u32, TransferError> {
    use contention_accounts::dsl::{balance, contention_accounts as accounts, version};
    let (lo, hi) = (t.from.min(t.to), t.from.max(t.to));
    let mut locked = Vec::with_capacity(2);
    for id in [lo, hi] {
        let account: Account = accounts
            .find(id)
            .select(Account::as_select())
            .for_update()
            .get_result(conn)
            .await?;
        locked.push(account);
    }
    for account in locked {
        let delta = if account.id == t.from {
            -t.amount
        } else {
            t.amount
        };
        let new_balance = account.balance + delta;
        if new_balance < 0 {
            return Err(TransferError::InsufficientFunds(account.id));
        }
        diesel::update(accounts.find(account.id))
            .set((balance.eq(new_balance), version.eq(version + 1)))
            .execute(conn)
            .await?;
    }
    append_entries(conn, t).await?;
    Ok(attempt_number())
}
