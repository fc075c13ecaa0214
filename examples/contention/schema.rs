//! The accounts and the ledger entries behind their balances: tables, models,
//! the reset before each run and the audit after it.

use super::*;

diesel::table! {
    contention_accounts (id) {
        id -> Int8,
        balance -> Int8,
        version -> Int8,
    }
}

diesel::table! {
    contention_entries (id) {
        id -> Int8,
        transfer_id -> Int8,
        account_id -> Int8,
        amount -> Int8,
    }
}

pub(crate) const SCHEMA: &str = "
    DROP TABLE IF EXISTS contention_entries;
    DROP TABLE IF EXISTS contention_accounts;
    CREATE TABLE contention_accounts (
        id      bigint PRIMARY KEY,
        balance bigint NOT NULL CHECK (balance >= 0),
        version bigint NOT NULL DEFAULT 0 CHECK (version >= 0)
    );
    -- Append-only: the truth the balance cache is derived from.
    CREATE TABLE contention_entries (
        id          bigserial PRIMARY KEY,
        transfer_id bigint NOT NULL,
        account_id  bigint NOT NULL,
        amount      bigint NOT NULL
    );
";

/// Every account back at its opening balance, with the opening entry (transfer
/// 0) that explains it.
pub(crate) fn reset_sql() -> String {
    format!(
        "TRUNCATE contention_entries, contention_accounts RESTART IDENTITY;
         INSERT INTO contention_accounts (id, balance, version)
             SELECT g, {OPENING_BALANCE}, 0 FROM generate_series(1, {ACCOUNTS}) g;
         INSERT INTO contention_entries (transfer_id, account_id, amount)
             SELECT 0, g, {OPENING_BALANCE} FROM generate_series(1, {ACCOUNTS}) g;
         ANALYZE contention_accounts, contention_entries;"
    )
}

#[derive(Debug, Queryable, Selectable, Versioned)]
#[diesel(table_name = contention_accounts)]
#[versioned(tenant = none, key = id, version = version)]
pub(crate) struct Account {
    pub(crate) id: i64,
    pub(crate) balance: i64,
    pub(crate) version: i64,
}

#[derive(VersionedChanges)]
#[versioned(model = Account)]
#[diesel(table_name = contention_accounts)]
pub(crate) struct SetBalance {
    pub(crate) balance: i64,
}

#[derive(Insertable)]
#[diesel(table_name = contention_entries)]
pub(crate) struct NewEntry {
    pub(crate) transfer_id: i64,
    pub(crate) account_id: i64,
    pub(crate) amount: i64,
}

/// The ledger after `committed` transfers: every cache equals its entries,
/// money is conserved, and each transfer bumped exactly two versions.
pub(crate) async fn audit(
    admin: &mut AsyncPgConnection,
    committed: usize,
) -> Result<(), Box<dyn Error>> {
    let accounts: Vec<(i64, i64, i64)> = contention_accounts::table
        .select((
            contention_accounts::id,
            contention_accounts::balance,
            contention_accounts::version,
        ))
        .order(contention_accounts::id)
        .load(admin)
        .await?;
    let entries: Vec<(i64, i64)> = contention_entries::table
        .select((contention_entries::account_id, contention_entries::amount))
        .load(admin)
        .await?;
    let mut sums = vec![0_i64; ACCOUNTS as usize + 1];
    for (account, amount) in &entries {
        sums[*account as usize] += amount;
    }
    for (id, balance, _) in &accounts {
        if *balance != sums[*id as usize] {
            return Err(format!(
                "account {id}: cached balance {balance} != sum of entries {}",
                sums[*id as usize]
            )
            .into());
        }
    }
    let total: i64 = accounts.iter().map(|a| a.1).sum();
    let versions: i64 = accounts.iter().map(|a| a.2).sum();
    let expected_entries = ACCOUNTS as usize + 2 * committed;
    if total != ACCOUNTS * OPENING_BALANCE
        || versions != 2 * committed as i64
        || entries.len() != expected_entries
    {
        return Err(format!(
            "total {total} (want {}), versions {versions} (want {}), entries {} (want {expected_entries})",
            ACCOUNTS * OPENING_BALANCE,
            2 * committed,
            entries.len()
        )
        .into());
    }
    Ok(())
}
