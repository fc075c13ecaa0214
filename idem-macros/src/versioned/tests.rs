//! What the derives write, as a reviewer would read it (insta snapshots of the
//! pretty-printed expansion), and how the parse step reports mistakes.
//!
//! Accept changed snapshots with `INSTA_UPDATE=always cargo test -p idem-macros`
//! (or `cargo insta review`), then read the `.snap` files that changed.

use proc_macro2::TokenStream;
use quote::quote;

use super::{derive_changes, derive_model, parse};
use crate::test_support::pretty;

/// Every message of a failed parse, in the order they were found.
fn model_errors(input: TokenStream) -> Vec<String> {
    let input: syn::DeriveInput = syn::parse2(input).unwrap();
    match parse::Model::from_input(&input) {
        Ok(_) => Vec::new(),
        Err(err) => err.into_iter().map(|e| e.to_string()).collect(),
    }
}

fn changes_errors(input: TokenStream) -> Vec<String> {
    let input: syn::DeriveInput = syn::parse2(input).unwrap();
    match parse::ChangeSet::from_input(&input) {
        Ok(_) => Vec::new(),
        Err(err) => err.into_iter().map(|e| e.to_string()).collect(),
    }
}

#[test]
fn model_tenanted_with_state() {
    let out = derive_model(quote! {
        #[derive(Queryable, Selectable, Versioned)]
        #[diesel(table_name = documents)]
        #[versioned(tenant = tenant_id, version = version, key = document_id, state = status)]
        struct Document {
            tenant_id: i64,
            document_id: i64,
            body: serde_json::Value,
            status: String,
            version: i64,
        }
    });
    insta::assert_snapshot!(pretty(out));
}

#[test]
fn model_untenanted_composite_key() {
    let out = derive_model(quote! {
        #[derive(Queryable, Selectable, Versioned)]
        #[diesel(table_name = settings)]
        #[versioned(tenant = none, version = revision, key = (scope, name))]
        struct Setting {
            scope: String,
            name: String,
            #[diesel(column_name = setting_value)]
            value: String,
            revision: i32,
        }
    });
    insta::assert_snapshot!(pretty(out));
}

#[test]
fn changes_owned() {
    let out = derive_changes(quote! {
        #[derive(VersionedChanges)]
        #[versioned(model = Document)]
        #[diesel(table_name = documents)]
        struct Publish {
            status: String,
            #[diesel(column_name = body)]
            content: serde_json::Value,
        }
    });
    insta::assert_snapshot!(pretty(out));
}

#[test]
fn changes_borrowing_with_where_clause() {
    let out = derive_changes(quote! {
        #[derive(VersionedChanges)]
        #[versioned(model = crate::Setting, table = crate::schema::settings)]
        struct SetValue<'a, T>
        where
            T: AsRef<str>,
        {
            #[diesel(column_name = setting_value)]
            value: &'a T,
        }
    });
    insta::assert_snapshot!(pretty(out));
}

#[test]
fn a_broken_model_expands_to_compile_errors_only() {
    let out = derive_model(quote! {
        #[versioned(tenant = tenant_id, sate = status)]
        struct Document {
            tenant_id: i64,
            version: i64,
        }
    });
    insta::assert_snapshot!(pretty(out));
}

#[test]
fn model_reports_every_unknown_key() {
    let errors = model_errors(quote! {
        #[versioned(tenant = tenant_id, sate = status, verison = version)]
        struct Document { tenant_id: i64, id: i64, status: String, version: i64 }
    });
    assert_eq!(
        errors,
        [
            "unknown key `sate` in #[versioned(..)]; the valid keys are `tenant`, `version`, `key` and `state`",
            "unknown key `verison` in #[versioned(..)]; the valid keys are `tenant`, `version`, `key` and `state`",
        ]
    );
}

#[test]
fn model_reports_every_missing_field() {
    let errors = model_errors(quote! {
        #[versioned(tenant = tenant, version = revision, key = (id, line), state = state)]
        struct Document { tenant_id: i64, id: i64, status: String, version: i64 }
    });
    let fields = "its fields are `tenant_id`, `id`, `status`, `version`";
    assert_eq!(
        errors,
        [
            format!("`Document` has no field `tenant`; {fields}"),
            format!("`Document` has no field `revision`; {fields}"),
            format!("`Document` has no field `line`; {fields}"),
            format!("`Document` has no field `state`; {fields}"),
        ]
    );
}

#[test]
fn model_reports_attribute_and_field_mistakes_together() {
    let errors = model_errors(quote! {
        #[versioned(version = revision, version = version, colour = blue)]
        struct Document { id: i64, version: i64 }
    });
    assert_eq!(
        errors,
        [
            "`version` is given more than once in #[versioned(..)]; keep only the one you mean",
            "unknown key `colour` in #[versioned(..)]; the valid keys are `tenant`, `version`, `key` and `state`",
            "#[versioned(..)] must name the tenant: add `tenant = <field>`, or `tenant = none` for a table that has no tenants",
            "`Document` has no field `revision`; its fields are `id`, `version`",
        ]
    );
}

#[test]
fn model_rejects_one_field_in_two_roles() {
    let errors = model_errors(quote! {
        #[versioned(tenant = none, version = id)]
        struct Document { id: i64, body: String }
    });
    assert_eq!(
        errors,
        ["field `id` cannot be both the version and the key"]
    );
}

#[test]
fn a_correct_model_has_no_errors() {
    let errors = model_errors(quote! {
        #[versioned(tenant = none)]
        struct Document { id: i64, body: String, version: i64 }
    });
    assert!(errors.is_empty(), "{errors:?}");
}

#[test]
fn changes_report_every_mistake() {
    let errors = changes_errors(quote! {
        #[versioned(modle = Document, tabel = documents)]
        struct Edit {}
    });
    assert_eq!(
        errors,
        [
            "unknown key `modle` in #[versioned(..)] of a changeset; the valid keys are `model` and `table`",
            "unknown key `tabel` in #[versioned(..)] of a changeset; the valid keys are `model` and `table`",
            "#[derive(VersionedChanges)] needs #[versioned(model = <the #[derive(Versioned)] struct>)]",
            "name the table this changeset writes: #[diesel(table_name = <table>)]",
            "a changeset with no fields would only bump the version; give it at least one field",
        ]
    );
}
