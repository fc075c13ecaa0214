use diesel::prelude::*;
use idem::Versioned;

diesel::table! {
    settings (name) {
        name -> Text,
        value -> Text,
        version -> Int8,
    }
}

// `primary_key()` names no column, so the model would have no key to filter on.
#[derive(Queryable, Selectable, Versioned)]
#[diesel(table_name = settings, primary_key())]
#[versioned(tenant = none)]
struct Setting {
    name: String,
    value: String,
    version: i64,
}

fn main() {}
