// The expansions compile without a single warning, whatever lints the user denies.
#![deny(warnings)]
#![deny(missing_docs, unused_qualifications, unused_results, unreachable_pub)]
#![deny(rust_2018_idioms, future_incompatible, nonstandard_style, unsafe_code)]
//! A crate that denies warnings and derives both traits.

use diesel::prelude::*;
use diesel_async::AsyncPgConnection;
use idem::{Versioned, VersionedChanges};

diesel::table! {
    /// Documents.
    documents (tenant_id, document_id) {
        /// Tenant.
        tenant_id -> Int8,
        /// Key.
        document_id -> Int8,
        /// Body.
        body -> Text,
        /// State.
        status -> Text,
        /// Version.
        version -> Int8,
    }
}

diesel::table! {
    /// Settings.
    settings (scope, name) {
        /// Key, first part.
        scope -> Text,
        /// Key, second part.
        name -> Text,
        /// Value.
        value -> Text,
        /// Version.
        version -> Int4,
    }
}

/// A tenanted model with a state.
#[derive(Debug, Queryable, Selectable, Versioned)]
#[diesel(table_name = documents)]
#[versioned(tenant = tenant_id, version = version, key = document_id, state = status)]
pub struct Document {
    /// Tenant.
    pub tenant_id: i64,
    /// Key.
    pub document_id: i64,
    /// Body.
    pub body: String,
    /// State.
    pub status: String,
    /// Version.
    pub version: i64,
}

/// A borrowing changeset.
#[derive(VersionedChanges)]
#[versioned(model = Document)]
#[diesel(table_name = documents)]
pub struct Edit<'a> {
    /// Body.
    pub body: &'a str,
    /// State.
    pub status: &'a str,
}

/// An untenanted model with a composite key.
#[derive(Debug, Queryable, Selectable, Versioned)]
#[diesel(table_name = settings)]
#[versioned(tenant = none, version = version, key = (scope, name))]
pub struct Setting {
    /// Key, first part.
    pub scope: String,
    /// Key, second part.
    pub name: String,
    /// Value.
    pub value: String,
    /// Version.
    pub version: i32,
}

/// An owning changeset.
#[derive(VersionedChanges)]
#[versioned(model = Setting)]
#[diesel(table_name = settings)]
pub struct SetValue {
    /// Value.
    #[diesel(column_name = value)]
    pub new_value: String,
}

/// Uses every builder once.
pub async fn use_all(conn: &mut AsyncPgConnection) -> Result<(), idem::VersionedError> {
    let doc = Document::find(7).tenant(1).load(conn).await?;
    let edit = Edit {
        body: "b",
        status: "published",
    };
    let doc = Document::update(7)
        .tenant(1)
        .expect_version(doc.version)
        .expect_state("draft".to_owned())
        .set(&edit)
        .execute(conn)
        .await?;
    Document::delete(7)
        .tenant(1)
        .expect_version(doc.version)
        .execute(conn)
        .await?;
    let _inserted = doc.insert(conn).await?;

    let key = ("ui".to_owned(), "theme".to_owned());
    let setting = Setting::find(key.clone()).load(conn).await?;
    let change = SetValue {
        new_value: "dark".to_owned(),
    };
    let setting = Setting::update(key.clone())
        .expect_version(setting.version())
        .set(&change)
        .execute(conn)
        .await?;
    Setting::delete(key)
        .expect_version(setting.version())
        .execute(conn)
        .await?;
    Ok(())
}

fn main() {}
