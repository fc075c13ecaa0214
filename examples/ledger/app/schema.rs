//! The ledger's tables: accounts (with their balance cache), movements
//! (`ledger_transfers`: transfers and top-ups) and the append-only
//! double-entry `ledger_entries`.

use diesel::prelude::*;
use diesel_async::{AsyncPgConnection, SimpleAsyncConnection};
use idem::{Versioned, VersionedChanges};
use serde::{Deserialize, Serialize};

diesel::table! {
    ledger_accounts (id) {
        id -> Int8,
        tenant_id -> Int8,
        kind -> Text,
        currency -> Text,
        balance -> Int8,
        metadata -> Jsonb,
        version -> Int8,
    }
}

diesel::table! {
    ledger_transfers (id) {
        id -> Int8,
        tenant_id -> Int8,
        kind -> Text,
        from_account -> Int8,
        to_account -> Int8,
        amount -> Int8,
        currency -> Text,
        idempotency_key -> Text,
    }
}

diesel::table! {
    ledger_entries (id) {
        id -> Int8,
        tenant_id -> Int8,
        transfer_id -> Int8,
        account_id -> Int8,
        direction -> Text,
        amount -> Int8,
        currency -> Text,
    }
}

diesel::joinable!(ledger_entries -> ledger_transfers (transfer_id));
diesel::allow_tables_to_appear_in_same_query!(ledger_accounts, ledger_transfers, ledger_entries);

/// `kind` of a customer's account.
pub const USER: &str = "user";
/// `kind` of the account money enters the ledger from: one per tenant and
/// currency. A top-up debits it and credits the customer, so its balance is
/// minus everything ever topped up, and the sum of all balances is 0.
pub const FUNDING: &str = "funding";
/// `direction` of an entry that takes money out of an account.
pub const DEBIT: &str = "DEBIT";
/// `direction` of an entry that puts money into an account.
pub const CREDIT: &str = "CREDIT";

/// The tables, created if missing.
///
/// * `balance` is a cache: the truth is the entries, `Σ CREDIT − Σ DEBIT` of
///   the account, and every write of it happens in the transaction that
///   writes the entries (`--reconcile` checks it).
/// * `version` makes every balance or metadata write a compare-and-set
///   (`#[derive(Versioned)]`), and is the account's `ETag`.
/// * Entries are append-only: a trigger refuses UPDATE, DELETE and TRUNCATE
///   (a mistake is corrected by a new, reversing movement), and a deferred
///   constraint trigger refuses, at commit, a movement whose debits and
///   credits differ.
pub const SCHEMA: &str = r#"
CREATE TABLE IF NOT EXISTS ledger_accounts (
    id        bigserial PRIMARY KEY,
    tenant_id bigint NOT NULL,
    kind      text   NOT NULL DEFAULT 'user' CHECK (kind IN ('user', 'funding')),
    currency  text   NOT NULL CHECK (currency ~ '^[A-Z]{3}$'),
    balance   bigint NOT NULL DEFAULT 0,
    metadata  jsonb  NOT NULL DEFAULT '{}'::jsonb CHECK (jsonb_typeof(metadata) = 'object'),
    version   bigint NOT NULL DEFAULT 0 CHECK (version >= 0),
    CHECK (kind = 'funding' OR balance >= 0)
);
CREATE UNIQUE INDEX IF NOT EXISTS ledger_accounts_one_funding
    ON ledger_accounts (tenant_id, currency) WHERE kind = 'funding';

CREATE TABLE IF NOT EXISTS ledger_transfers (
    id              bigserial PRIMARY KEY,
    tenant_id       bigint NOT NULL,
    kind            text   NOT NULL CHECK (kind IN ('transfer', 'top_up')),
    from_account    bigint NOT NULL REFERENCES ledger_accounts (id),
    to_account      bigint NOT NULL REFERENCES ledger_accounts (id),
    amount          bigint NOT NULL CHECK (amount > 0),
    currency        text   NOT NULL,
    idempotency_key text   NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    CHECK (from_account <> to_account)
);

CREATE TABLE IF NOT EXISTS ledger_entries (
    id          bigserial PRIMARY KEY,
    tenant_id   bigint NOT NULL,
    transfer_id bigint NOT NULL REFERENCES ledger_transfers (id),
    account_id  bigint NOT NULL REFERENCES ledger_accounts (id),
    direction   text   NOT NULL CHECK (direction IN ('DEBIT', 'CREDIT')),
    amount      bigint NOT NULL CHECK (amount > 0),
    currency    text   NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS ledger_entries_by_account ON ledger_entries (account_id);
CREATE INDEX IF NOT EXISTS ledger_entries_by_transfer ON ledger_entries (transfer_id);

CREATE OR REPLACE FUNCTION ledger_entries_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'ledger_entries is append-only: % refused; correct a mistake with a new, reversing movement', TG_OP
        USING ERRCODE = 'LDG01';
END $$;
DROP TRIGGER IF EXISTS ledger_entries_append_only ON ledger_entries;
CREATE TRIGGER ledger_entries_append_only BEFORE UPDATE OR DELETE ON ledger_entries
    FOR EACH ROW EXECUTE FUNCTION ledger_entries_append_only();
DROP TRIGGER IF EXISTS ledger_entries_no_truncate ON ledger_entries;
CREATE TRIGGER ledger_entries_no_truncate BEFORE TRUNCATE ON ledger_entries
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_entries_append_only();

CREATE OR REPLACE FUNCTION ledger_movement_balanced() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    debits  bigint;
    credits bigint;
BEGIN
    SELECT coalesce(sum(amount) FILTER (WHERE direction = 'DEBIT'), 0),
           coalesce(sum(amount) FILTER (WHERE direction = 'CREDIT'), 0)
      INTO debits, credits
      FROM ledger_entries WHERE transfer_id = NEW.transfer_id;
    IF debits <> credits THEN
        RAISE EXCEPTION 'movement % does not balance: debits % <> credits %', NEW.transfer_id, debits, credits
            USING ERRCODE = 'LDG02';
    END IF;
    RETURN NULL;
END $$;
DROP TRIGGER IF EXISTS ledger_entries_balanced ON ledger_entries;
CREATE CONSTRAINT TRIGGER ledger_entries_balanced AFTER INSERT ON ledger_entries
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION ledger_movement_balanced();
"#;

/// Drops the ledger's tables and forgets its idempotency keys (their
/// responses name movements that no longer exist).
const RESET: &str = r#"
DROP TABLE IF EXISTS ledger_entries, ledger_transfers, ledger_accounts CASCADE;
DELETE FROM idem_requests WHERE scope_label LIKE '["ledger",%';
"#;

/// Create the tables (after `idem::migrate`, which creates `idem_requests`
/// and the version guard); with `reset`, drop the old ones first.
///
/// The version guard makes any UPDATE of an account that does not bump its
/// version by one fail, whoever sends it (psql, a data fix).
pub async fn setup(conn: &mut AsyncPgConnection, reset: bool) -> QueryResult<()> {
    if reset {
        conn.batch_execute(RESET).await?;
    }
    conn.batch_execute(SCHEMA).await?;
    idem::versioned::backstop::install_version_guard::<Account>(conn).await
}

/// An account. Every write of it is a compare-and-set on `version` within
/// its tenant.
#[derive(Debug, Clone, PartialEq, Queryable, Selectable, Versioned, Serialize, Deserialize)]
#[diesel(table_name = ledger_accounts)]
#[versioned(tenant = tenant_id, key = id, version = version)]
pub struct Account {
    pub id: i64,
    pub tenant_id: i64,
    pub kind: String,
    pub currency: String,
    /// Cache of `Σ CREDIT − Σ DEBIT` over the account's entries.
    pub balance: i64,
    pub metadata: serde_json::Value,
    pub version: i64,
}

/// The balance cache, written with the entries that change it.
#[derive(VersionedChanges)]
#[versioned(model = Account)]
#[diesel(table_name = ledger_accounts)]
pub struct NewBalance {
    pub balance: i64,
}

/// The account's metadata, replaced by `PATCH /accounts/{id}`.
#[derive(VersionedChanges)]
#[versioned(model = Account)]
#[diesel(table_name = ledger_accounts)]
pub struct NewMetadata {
    pub metadata: serde_json::Value,
}
