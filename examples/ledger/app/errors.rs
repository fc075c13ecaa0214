//! Why a ledger request fails: the final, typed declines (stored under the
//! key and replayed) and everything else, and the checks of the inputs that
//! decline before anything is written.

use axum::http::StatusCode;
use idem::http::Problem;
use idem::{IdempotentError, VersionedError};
use serde::{Deserialize, Serialize};

use super::limits::{echo, metadata_fault, valid_currency, MAX_AMOUNT};

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
    /// The amount is above [`MAX_AMOUNT`].
    AmountTooLarge { amount: i64 },
    /// The movement would take an account's balance out of `i64`: the
    /// destination's above `i64::MAX`, or a funding account's below
    /// `i64::MIN`.
    BalanceOverflow {
        account: i64,
        balance: i64,
        amount: i64,
    },
    /// Not an ISO 4217-style code of three capital letters. `currency` is
    /// what was sent, cut short by [`echo`].
    InvalidCurrency { currency: String },
    /// The metadata is not a small, shallow JSON object without U+0000
    /// (see `limits`).
    InvalidMetadata { reason: String },
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
                format!(
                    "an amount of {amount} is more than one movement may carry, \
                     {MAX_AMOUNT} minor units; split it"
                ),
            ),
            Declined::BalanceOverflow {
                account,
                balance,
                amount,
            } => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "balance-overflow",
                "Balance limit reached",
                format!(
                    "moving {amount} would take the balance of account {account}, {balance}, \
                     beyond what the ledger can hold; nothing was moved"
                ),
            ),
            Declined::InvalidCurrency { currency } => (
                StatusCode::BAD_REQUEST,
                "invalid-currency",
                "Invalid currency",
                format!(
                    "\"{currency}\" is not a currency code of three capital letters, like \"EUR\""
                ),
            ),
            Declined::InvalidMetadata { reason } => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid-metadata",
                "Invalid metadata",
                reason.clone(),
            ),
        };
        let mut problem = Problem::new(status, format!("urn:ledger:problem:{kind}"), title, detail);
        if let Declined::AmountTooLarge { .. } = self {
            problem = problem.with("max_amount", MAX_AMOUNT);
        }
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

pub(super) fn declined(reason: Declined) -> LedgerError {
    LedgerError::Declined {
        reason,
        replayed: false,
    }
}

/// 1 to [`MAX_AMOUNT`]: checked before anything else, so no arithmetic
/// ever sees an absurd amount.
pub(super) fn check_amount(amount: i64) -> Result<(), LedgerError> {
    if amount <= 0 {
        Err(declined(Declined::NonPositiveAmount { amount }))
    } else if amount > MAX_AMOUNT {
        Err(declined(Declined::AmountTooLarge { amount }))
    } else {
        Ok(())
    }
}

pub(super) fn check_currency(currency: &str) -> Result<(), LedgerError> {
    if valid_currency(currency) {
        Ok(())
    } else {
        Err(declined(Declined::InvalidCurrency {
            currency: echo(currency),
        }))
    }
}

pub(super) fn check_metadata(metadata: &serde_json::Value) -> Result<(), LedgerError> {
    match metadata_fault(metadata) {
        None => Ok(()),
        Some(reason) => Err(declined(Declined::InvalidMetadata { reason })),
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
