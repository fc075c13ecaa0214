// `tenant = none`: the builders skip `.tenant(..)` altogether.
use diesel::prelude::*;
use diesel_async::AsyncPgConnection;
use idem::{Versioned, VersionedChanges};

diesel::table! {
    settings (name) {
        name -> Text,
        value -> Text,
        version -> Int8,
    }
}

#[derive(Queryable, Selectable, Versioned)]
#[diesel(table_name = settings)]
#[versioned(tenant = none, version = version, key = name)]
struct Setting {
    name: String,
    value: String,
    version: i64,
}

#[derive(VersionedChanges)]
#[versioned(model = Setting)]
#[diesel(table_name = settings)]
struct SetValue {
    value: String,
}

#[allow(dead_code)]
async fn use_it(conn: &mut AsyncPgConnection) -> Result<(), idem::VersionedError> {
    let row = Setting::find("theme".to_owned()).load(conn).await?;
    let change = SetValue {
        value: "dark".to_owned(),
    };
    let row = Setting::update(row.name)
        .expect_version(row.version)
        .set(&change)
        .execute(conn)
        .await?;
    Setting::delete(row.name)
        .expect_version(row.version)
        .execute(conn)
        .await?;
    Ok(())
}

fn main() {}
