//! What the endpoints do, as functions over a pool: each one retryable, and
//! the money movements idempotent under the caller's key.

use diesel::prelude::*;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idem::http::{IdempotencyKey, StoredResponse};
use idem::{idempotent, retryable, Versioned, VersionedError};
use serde::{Deserialize, Serialize};

use super::errors::{check_amount, check_currency, check_metadata, declined};
pub use super::errors::{Declined, LedgerError};
use super::schema::{
    ledger_accounts, ledger_entries, ledger_transfers, Account, NewBalance, NewMetadata, CREDIT,
    DEBIT, FUNDING, USER,
};

/// `POST /transfers`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferRequest {
    pub from_account: i64,
    pub to_account: i64,
    /// Minor units (cents).
    pub amount: i64,
    pub currency: String,
}

/// `POST /accounts/{id}/top-ups`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopUpRequest {
    pub amount: i64,
    pub currency: String,
}

/// `POST /accounts`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NewAccountRequest {
    pub currency: String,
    #[serde(default = "empty_object")]
    pub metadata: serde_json::Value,
}

fn empty_object() -> serde_json::Value {
    serde_json::Value::Object(Default::default())
}

/// A movement of money as answered (and stored under the key): one DEBIT and
/// one CREDIT entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Movement {
    pub transfer_id: i64,
    pub kind: String,
    pub from_account: i64,
    pub to_account: i64,
    pub amount: i64,
    pub currency: String,
    /// The source's balance right after this movement.
    pub from_balance: i64,
    /// The destination's balance right after this movement.
    pub to_balance: i64,
}

/// The key space of a tenant's requests in `idem_requests`.
fn scope(tenant: i64) -> (&'static str, i64) {
    ("ledger", tenant)
}

/// Moves `req.amount` between two customer accounts of `tenant`.
///
/// The first statement of the attempt claims `key`; a duplicate waits for it
/// and gets this response (or this refusal) back. Both accounts are read, and
/// after a conflict locked, in id order, so two opposite transfers never
/// deadlock; both balance caches are written, as compare-and-sets, in the
/// transaction that appends the entries.
#[idempotent(key = key, scope = scope(tenant), operation = "ledger.transfer", fingerprint(req))]
#[retryable(max = 5, deadline_ms = 10000, on_conflict = lock)]
pub async fn transfer(
    conn: &mut AsyncPgConnection,
    tenant: i64,
    key: &IdempotencyKey,
    req: &TransferRequest,
) -> Result<StoredResponse<Movement>, LedgerError> {
    check_amount(req.amount)?;
    check_currency(&req.currency)?;
    if req.from_account == req.to_account {
        return Err(declined(Declined::SelfTransfer {
            account: req.from_account,
        }));
    }
    let (low, high) = if req.from_account < req.to_account {
        (req.from_account, req.to_account)
    } else {
        (req.to_account, req.from_account)
    };
    let low = customer_account(conn, tenant, low).await?;
    let high = customer_account(conn, tenant, high).await?;
    let (from, to) = if low.id == req.from_account {
        (low, high)
    } else {
        (high, low)
    };
    for account in [&from, &to] {
        same_currency(account, &req.currency)?;
    }
    if from.balance < req.amount {
        return Err(declined(Declined::InsufficientFunds {
            account: from.id,
            balance: from.balance,
            amount: req.amount,
        }));
    }
    let movement = post(conn, "transfer", key, &from, &to, req.amount).await?;
    Ok(StoredResponse::created(movement))
}

/// Puts `req.amount` into a customer account, from the tenant's funding
/// account of that currency.
#[idempotent(key = key, scope = scope(tenant), operation = "ledger.top_up", fingerprint(account, req))]
#[retryable(max = 5, deadline_ms = 10000, on_conflict = lock)]
pub async fn top_up(
    conn: &mut AsyncPgConnection,
    tenant: i64,
    key: &IdempotencyKey,
    account: i64,
    req: &TopUpRequest,
) -> Result<StoredResponse<Movement>, LedgerError> {
    // Every input is checked before the first write (the funding account's
    // insert): an invalid currency must not reach that row's CHECK.
    check_amount(req.amount)?;
    check_currency(&req.currency)?;
    target_currency(conn, tenant, account, &req.currency).await?;
    // Created here by the first top-up in a currency.
    let funding_id = funding_account(conn, tenant, &req.currency).await?;
    // Both accounts in id order, like every movement (after a conflict these
    // reads lock, and a lock order is what keeps movements from deadlocking).
    let (mut funding, mut target) = (None, None);
    for id in sorted(funding_id, account) {
        if id == funding_id {
            funding = Some(Account::find(id).tenant(tenant).load(conn).await?);
        } else {
            target = Some(customer_account(conn, tenant, id).await?);
        }
    }
    let (Some(funding), Some(target)) = (funding, target) else {
        // `account` is the funding account itself.
        return Err(declined(Declined::UnknownAccount { account }));
    };
    same_currency(&target, &req.currency)?;
    let movement = post(conn, "top_up", key, &funding, &target, req.amount).await?;
    Ok(StoredResponse::created(movement))
}

/// Refuses a top-up of an account that is not a customer account of the
/// tenant, or not in `currency`: a plain read, which takes no lock, so the
/// lock order of the reads that follow stays the id order.
async fn target_currency(
    conn: &mut AsyncPgConnection,
    tenant: i64,
    account: i64,
    currency: &str,
) -> Result<(), LedgerError> {
    use ledger_accounts::dsl as a;
    let found: Option<String> = a::ledger_accounts
        .filter(a::id.eq(account))
        .filter(a::tenant_id.eq(tenant))
        .filter(a::kind.eq(USER))
        .select(a::currency)
        .first(conn)
        .await
        .optional()?;
    match found {
        None => Err(declined(Declined::UnknownAccount { account })),
        Some(held) if held != currency => Err(declined(Declined::CurrencyMismatch {
            account,
            account_currency: held,
            requested: currency.to_owned(),
        })),
        Some(_) => Ok(()),
    }
}

/// The id of the tenant's funding account in `currency`, created with the
/// first top-up in it.
async fn funding_account(
    conn: &mut AsyncPgConnection,
    tenant: i64,
    currency: &str,
) -> Result<i64, LedgerError> {
    use ledger_accounts::dsl as a;
    let find = || {
        a::ledger_accounts
            .filter(a::tenant_id.eq(tenant))
            .filter(a::kind.eq(FUNDING))
            .filter(a::currency.eq(currency.to_owned()))
            .select(a::id)
    };
    if let Some(id) = find().first(conn).await.optional()? {
        return Ok(id);
    }
    // Two first top-ups at once: the partial unique index makes the second
    // insert wait for the first and then do nothing.
    diesel::insert_into(a::ledger_accounts)
        .values((
            a::tenant_id.eq(tenant),
            a::kind.eq(FUNDING),
            a::currency.eq(currency),
        ))
        .on_conflict_do_nothing()
        .execute(conn)
        .await?;
    Ok(find().first(conn).await?)
}

fn sorted(a: i64, b: i64) -> [i64; 2] {
    if a < b {
        [a, b]
    } else {
        [b, a]
    }
}

/// A customer account of the tenant, or the final refusal that it is unknown.
async fn customer_account(
    conn: &mut AsyncPgConnection,
    tenant: i64,
    id: i64,
) -> Result<Account, LedgerError> {
    match Account::find(id).tenant(tenant).load(conn).await {
        Ok(account) if account.kind == USER => Ok(account),
        Ok(_) | Err(VersionedError::NotFound) => {
            Err(declined(Declined::UnknownAccount { account: id }))
        }
        Err(e) => Err(e.into()),
    }
}

fn same_currency(account: &Account, requested: &str) -> Result<(), LedgerError> {
    if account.currency == requested {
        Ok(())
    } else {
        Err(declined(Declined::CurrencyMismatch {
            account: account.id,
            account_currency: account.currency.clone(),
            requested: requested.to_owned(),
        }))
    }
}

/// One movement: both balance caches (compare-and-set, in id order), the
/// movement row, and its DEBIT and CREDIT entries, in the caller's
/// transaction.
async fn post(
    conn: &mut AsyncPgConnection,
    kind: &str,
    key: &IdempotencyKey,
    from: &Account,
    to: &Account,
    amount: i64,
) -> Result<Movement, LedgerError> {
    // A funding account goes down by every top-up, a customer's up by
    // every credit: either can reach the end of i64, which is a decline,
    // never a wrap or a panic.
    let overflow = |account: &Account| {
        declined(Declined::BalanceOverflow {
            account: account.id,
            balance: account.balance,
            amount,
        })
    };
    let from_balance = from
        .balance
        .checked_sub(amount)
        .ok_or_else(|| overflow(from))?;
    let to_balance = to.balance.checked_add(amount).ok_or_else(|| overflow(to))?;
    for (account, balance) in sorted_pair((from, from_balance), (to, to_balance)) {
        Account::update(account.id)
            .tenant(account.tenant_id)
            .expect_version(account.version)
            .set(&NewBalance { balance })
            .execute(conn)
            .await?;
    }
    let transfer_id: i64 = diesel::insert_into(ledger_transfers::table)
        .values((
            ledger_transfers::tenant_id.eq(from.tenant_id),
            ledger_transfers::kind.eq(kind),
            ledger_transfers::from_account.eq(from.id),
            ledger_transfers::to_account.eq(to.id),
            ledger_transfers::amount.eq(amount),
            ledger_transfers::currency.eq(&from.currency),
            ledger_transfers::idempotency_key.eq(key.as_str()),
        ))
        .returning(ledger_transfers::id)
        .get_result(conn)
        .await?;
    let entry = |account: &Account, direction: &'static str| {
        (
            ledger_entries::tenant_id.eq(account.tenant_id),
            ledger_entries::transfer_id.eq(transfer_id),
            ledger_entries::account_id.eq(account.id),
            ledger_entries::direction.eq(direction),
            ledger_entries::amount.eq(amount),
            ledger_entries::currency.eq(account.currency.clone()),
        )
    };
    diesel::insert_into(ledger_entries::table)
        .values(vec![entry(from, DEBIT), entry(to, CREDIT)])
        .execute(conn)
        .await?;
    Ok(Movement {
        transfer_id,
        kind: kind.to_owned(),
        from_account: from.id,
        to_account: to.id,
        amount,
        currency: from.currency.clone(),
        from_balance,
        to_balance,
    })
}

fn sorted_pair<'a>(a: (&'a Account, i64), b: (&'a Account, i64)) -> [(&'a Account, i64); 2] {
    if a.0.id < b.0.id {
        [a, b]
    } else {
        [b, a]
    }
}

/// `POST /accounts` without a key: a customer account.
#[retryable(max = 4, deadline_ms = 5000)]
pub async fn open_account(
    conn: &mut AsyncPgConnection,
    tenant: i64,
    req: &NewAccountRequest,
) -> Result<StoredResponse<Account>, LedgerError> {
    insert_account(conn, tenant, req).await
}

/// `POST /accounts` with an `Idempotency-Key`: a retry gets the same account
/// back instead of a second one.
#[idempotent(key = key, scope = scope(tenant), operation = "ledger.open_account", fingerprint(req))]
#[retryable(max = 4, deadline_ms = 5000)]
pub async fn open_account_once(
    conn: &mut AsyncPgConnection,
    tenant: i64,
    key: &IdempotencyKey,
    req: &NewAccountRequest,
) -> Result<StoredResponse<Account>, LedgerError> {
    insert_account(conn, tenant, req).await
}

async fn insert_account(
    conn: &mut AsyncPgConnection,
    tenant: i64,
    req: &NewAccountRequest,
) -> Result<StoredResponse<Account>, LedgerError> {
    use ledger_accounts::dsl as a;
    check_currency(&req.currency)?;
    check_metadata(&req.metadata)?;
    let account = diesel::insert_into(a::ledger_accounts)
        .values((
            a::tenant_id.eq(tenant),
            a::kind.eq(USER),
            a::currency.eq(&req.currency),
            a::metadata.eq(&req.metadata),
        ))
        .returning(Account::as_returning())
        .get_result(conn)
        .await?;
    Ok(StoredResponse::created(account))
}

/// `PATCH /accounts/{id}`: replace the metadata if the account is still at
/// `expected` (from `If-Match`); `None` (`If-Match: *`) takes whatever
/// version it is at, and a race with another writer is retried.
#[retryable(max = 4, deadline_ms = 2000)]
pub async fn set_metadata(
    conn: &mut AsyncPgConnection,
    tenant: i64,
    id: i64,
    expected: Option<i64>,
    metadata: &serde_json::Value,
) -> Result<Account, LedgerError> {
    check_metadata(metadata)?;
    let version = match expected {
        Some(version) => version,
        None => Account::find(id).tenant(tenant).load(conn).await?.version,
    };
    let written = Account::update(id)
        .tenant(tenant)
        .expect_version(version)
        .set(&NewMetadata {
            metadata: metadata.clone(),
        })
        .execute(conn)
        .await;
    match written {
        // The client's version is stale: retrying cannot help, answer 412.
        Err(e @ VersionedError::Stale { .. }) if expected.is_some() => {
            Err(LedgerError::Precondition(e))
        }
        other => Ok(other?),
    }
}

/// `GET /accounts/{id}`.
pub async fn account(
    conn: &mut AsyncPgConnection,
    tenant: i64,
    id: i64,
) -> Result<Account, VersionedError> {
    Account::find(id).tenant(tenant).load(conn).await
}
