use diesel::prelude::*;
use diesel_async::AsyncPgConnection;
use idem::Versioned;

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

// A table declared without tenants has no tenant to name.
async fn read(conn: &mut AsyncPgConnection) {
    let _ = Setting::find("theme".to_owned()).tenant(1).load(conn).await;
}

fn main() {}
