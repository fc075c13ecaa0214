//! What the endpoints do, as functions over a pool: each one retryable, and
//! the money movements idempotent under the caller's key.

use axum::http::StatusCode;
use diesel::prelude::*;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idem::http::{IdempotencyKey, Problem, StoredResponse};
use idem::{idempotent, retryable, IdempotentError, Versioned, VersionedError};
use serde::{Deserialize, Serialize};

use super::schema::{
    ledger_accounts, ledger_entries, ledger_transfers, Account, NewBalance, NewMetadata, CREDIT,
    DEBIT, FUNDING, USER,
};

/// Why a request was refused. Final: stored under the idempotency key and
/// replayed to every later request with it, and never writes an entry (the
/// attempt's transaction is rolled back).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "code", rename_all = "snake_case")]
pub enum Declined {
    /// The source account holds less than the amount.
    InsufficientFunds {
        account: i64,
        balance: i64,
        amount: i64,
    },
    /// Source and destination are the same account.
    SelfTransfer { account: i64 },
    /// An account's currency is not the request's.
    CurrencyMismatch {
        account: i64,
        account_currency: String,
        requested: String,
    },
    /// No such customer account in this tenant.
    UnknownAccount { account: i64 },
    /// The amount is zero or negative.
    NonPositiveAmount { amount: i64 },
    /// The amount would overflow the destination's balance.
    AmountTooLarge { amount: i64 },
    /// Not an ISO 4217-style code of three capital letters.
    InvalidCurrency { currency: String },
}

impl Declined {
    /// The problem answered for it, the same on every replay.
    pub fn problem(&self) -> Problem {
        let (status, kind, title, detail) = match self {
            Declined::InsufficientFunds {
                account,
                balance,
                amount,
            } => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "insufficient-funds",
                "Insufficient funds",
                format!("account {account} holds {balance}, less than the {amount} requested"),
            ),
            Declined::SelfTransfer { account } => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "self-transfer",
                "Self-transfer",
                format!("account {account} is both the source and the destination"),
            ),
            Declined::CurrencyMismatch {
                account,
                account_currency,
                requested,
            } => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "currency-mismatch",
                "Currency mismatch",
                format!("account {account} holds {account_currency}, not {requested}"),
            ),
            Declined::UnknownAccount { account } => (
                StatusCode::NOT_FOUND,
                "unknown-account",
                "Unknown account",
                format!("there is no account {account}"),
            ),
            Declined::NonPositiveAmount { amount } => (
                StatusCode::BAD_REQUEST,
                "non-positive-amount",
                "Non-positive amount",
                format!("the amount must be a positive number of minor units, not {amount}"),
            ),
            Declined::AmountTooLarge { amount } => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "amount-too-large",
                "Amount too large",
                format!("an amount of {amount} would overflow the destination's balance"),
            ),
            Declined::InvalidCurrency { currency } => (
                StatusCode::BAD_REQUEST,
                "invalid-currency",
                "Invalid currency",
                format!(
                    "{currency:?} is not a currency code of three capital letters, like \"EUR\""
                ),
            ),
        };
        let mut problem = Problem::new(status, format!("urn:ledger:problem:{kind}"), title, detail);
        // The typed fields, for clients that act on them.
        if let Ok(serde_json::Value::Object(fields)) = serde_json::to_value(self) {
            for (name, value) in fields {
                problem = problem.with(&name, value);
            }
        }
        problem
    }
}

/// Everything a ledger operation can fail with.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// A final business refusal; `replayed` when it is the stored answer of
    /// an earlier request with the same key.
    #[error("declined: {reason:?}")]
    Declined { reason: Declined, replayed: bool },
    /// The `If-Match` version is no longer the account's: 412, not retried.
    #[error(transparent)]
    Precondition(VersionedError),
    #[error(transparent)]
    Versioned(#[from] VersionedError),
    #[error(transparent)]
    Idem(#[from] idem::Error),
    #[error(transparent)]
    Db(#[from] diesel::result::Error),
}

fn declined(reason: Declined) -> LedgerError {
    LedgerError::Declined {
        reason,
        replayed: false,
    }
}

impl IdempotentError for LedgerError {
    type Final = Declined;
    fn to_final(&self) -> Option<Declined> {
        match self {
            LedgerError::Declined { reason, .. } => Some(reason.clone()),
            _ => None,
        }
    }
    // idem calls this for replays only.
    fn from_final(reason: Declined) -> Self {
        LedgerError::Declined {
            reason,
            replayed: true,
        }
    }
}

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
    if req.amount <= 0 {
        return Err(declined(Declined::NonPositiveAmount { amount: req.amount }));
    }
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
    if req.amount <= 0 {
        return Err(declined(Declined::NonPositiveAmount { amount: req.amount }));
    }
    // Created here by the first top-up in a currency; a refusal below rolls
    // that back with the rest of the attempt.
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
    let from_balance = from.balance - amount;
    let Some(to_balance) = to.balance.checked_add(amount) else {
        return Err(declined(Declined::AmountTooLarge { amount }));
    };
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

fn valid_currency(currency: &str) -> bool {
    currency.len() == 3 && currency.bytes().all(|b| b.is_ascii_uppercase())
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
    if !valid_currency(&req.currency) {
        return Err(declined(Declined::InvalidCurrency {
            currency: req.currency.clone(),
        }));
    }
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
