// `#[diesel(column_name = ..)]` on the tenant, key, version and an assigned field:
// attributes name fields, and the generated SQL uses their columns.
use diesel::prelude::*;
use diesel_async::AsyncPgConnection;
use idem::{Versioned, VersionedChanges};

diesel::table! {
    accounts (org, account_no) {
        org -> Int8,
        account_no -> Int8,
        display_name -> Text,
        row_version -> Int8,
    }
}

#[derive(Queryable, Selectable, Versioned)]
#[diesel(table_name = accounts)]
#[versioned(tenant = tenant, version = version, key = id)]
struct Account {
    #[diesel(column_name = org)]
    tenant: i64,
    #[diesel(column_name = account_no)]
    id: i64,
    #[diesel(column_name = display_name)]
    name: String,
    #[diesel(column_name = row_version)]
    version: i64,
}

#[derive(VersionedChanges)]
#[versioned(model = Account)]
#[diesel(table_name = accounts)]
struct Rename {
    #[diesel(column_name = display_name)]
    name: String,
}

#[allow(dead_code)]
async fn use_it(conn: &mut AsyncPgConnection) -> Result<(), idem::VersionedError> {
    let row = Account::find(1).tenant(1).load(conn).await?;
    let change = Rename {
        name: row.name.clone(),
    };
    Account::update(row.id)
        .tenant(row.tenant)
        .expect_version(row.version)
        .set(&change)
        .execute(conn)
        .await?;
    Ok(())
}

fn main() {}
