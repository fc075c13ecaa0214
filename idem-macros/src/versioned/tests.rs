//! What the derives write, as a reviewer would read it (insta snapshots of the
//! pretty-printed expansion), and how the parse step reports mistakes.
//!
//! Accept changed snapshots with `INSTA_UPDATE=always cargo test -p idem-macros`
//! (or `cargo insta review`), then read the `.snap` files that changed.

use proc_macro2::TokenStream;
use quote::quote;

use super::{derive_changes, derive_model, parse, validate};
use crate::errors::Errors;
use crate::test_support::pretty;

/// Every message of a failed parse and validation, in the order they were found.
fn model_errors(input: TokenStream) -> Vec<String> {
    let input: syn::DeriveInput = syn::parse2(input).unwrap();
    let mut errors = Errors::default();
    let parsed = parse::ModelInput::parse(&input, &mut errors);
    validate::model(&parsed, &mut errors);
    messages(errors)
}

fn changes_errors(input: TokenStream) -> Vec<String> {
    let input: syn::DeriveInput = syn::parse2(input).unwrap();
    let mut errors = Errors::default();
    let parsed = parse::ChangesInput::parse(&input, &mut errors);
    validate::changes(&parsed, &mut errors);
    messages(errors)
}

fn messages(errors: Errors) -> Vec<String> {
    match errors.finish(()) {
        Ok(()) => Vec::new(),
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
fn a_broken_model_expands_to_its_errors_and_a_fallback_impl() {
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
            "unknown key `sate` in #[versioned(..)]; the valid keys are `tenant`, `version`, `key`, `state` and `create_once`",
            "unknown key `verison` in #[versioned(..)]; the valid keys are `tenant`, `version`, `key`, `state` and `create_once`",
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
            "unknown key `colour` in #[versioned(..)]; the valid keys are `tenant`, `version`, `key`, `state` and `create_once`",
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

#[test]
fn a_model_without_fields_is_one_error() {
    for input in [
        quote!(
            #[versioned(tenant = none)]
            struct Empty {}
        ),
        quote!(
            #[versioned(tenant = tenant_id, version = version, key = id)]
            struct Empty {}
        ),
    ] {
        assert_eq!(
            model_errors(input),
            ["`Empty` has no fields, but a #[derive(Versioned)] model needs one per column, at least its key and its version: `struct Empty { id: i64, version: i64, .. }`"]
        );
    }
}

#[test]
fn a_model_of_another_shape_is_one_error() {
    let cases = [
        (
            quote!(#[versioned(tenant = tenant_id)] struct Pair(i64, i64);),
            "#[derive(Versioned)] needs named fields, one per column, but `Pair` is a tuple struct; write it as `struct Pair { id: i64, .. }`",
        ),
        (
            quote!(#[versioned(tenant = none)] struct Unit;),
            "#[derive(Versioned)] needs named fields, one per column, but `Unit` is a unit struct; write it as `struct Unit { id: i64, .. }`",
        ),
        (
            quote!(#[versioned(tenant = none, key = id)] enum Status { Draft, Published }),
            "#[derive(Versioned)] needs a struct with named fields, one per column, not an enum; write `struct Status { id: i64, .. }`",
        ),
        (
            quote!(#[versioned(tenant = none)] union Bits { a: i64, b: f64 }),
            "#[derive(Versioned)] needs a struct with named fields, one per column, not a union; write `struct Bits { id: i64, .. }`",
        ),
    ];
    for (input, message) in cases {
        assert_eq!(model_errors(input), [message]);
    }
}

#[test]
fn model_rejects_an_empty_or_repeated_key() {
    let errors = model_errors(quote! {
        #[diesel(primary_key())]
        #[versioned(tenant = none)]
        struct Document { id: i64, version: i64 }
    });
    assert_eq!(
        errors,
        ["`primary_key()` names no column; name the row's key here or with #[versioned(key = <field>)]"]
    );
    let errors = model_errors(quote! {
        #[versioned(tenant = none, key = (id, id))]
        struct Document { id: i64, version: i64 }
    });
    assert_eq!(
        errors,
        ["`id` is named twice in the key; name each key field once"]
    );
}

/// Whatever the struct, the derive answers with valid Rust: the expansion, or
/// its errors and a fallback impl. It never panics.
#[test]
fn every_broken_model_expands_to_errors_and_a_fallback() {
    let cases = [
        quote!(
            #[versioned(tenant = none)]
            struct Empty {}
        ),
        quote!(
            #[versioned(tenant = none)]
            struct Pair(i64, i64);
        ),
        quote!(
            #[versioned(tenant = none)]
            struct Unit;
        ),
        quote!(
            #[versioned(tenant = none)]
            enum Status {
                Draft,
            }
        ),
        quote!(
            #[versioned(tenant = none)]
            struct Generic<'a, T: Clone>
            where
                T: Send,
            {
                id: &'a T,
                version: i64,
            }
        ),
        quote!(
            #[versioned(tenant = none)]
            struct NoVersion {
                id: i64,
            }
        ),
        quote!(
            #[versioned(tenant = none)]
            struct NoKey {
                version: i64,
            }
        ),
        quote!(
            #[diesel(primary_key())]
            #[versioned(tenant = none)]
            struct EmptyPk {
                id: i64,
                version: i64,
            }
        ),
        quote!(
            struct NoAttr {
                id: i64,
                version: i64,
            }
        ),
        quote!(
            #[versioned(tenant = none, version = id)]
            struct TwoRoles {
                id: i64,
            }
        ),
    ];
    for input in cases {
        let out = pretty(derive_model(input.clone()));
        assert!(out.contains("compile_error!"), "{input}:\n{out}");
        assert!(out.contains("::idem::Versioned for"), "{input}:\n{out}");
    }
}

#[test]
fn a_broken_changeset_still_implements_versioned_changes_for_its_model() {
    let out = pretty(derive_changes(quote! {
        #[versioned(model = Document)]
        struct Edit { body: String }
    }));
    assert!(out.contains("compile_error!"), "{out}");
    assert!(
        out.contains("impl ::idem::VersionedChanges<Document> for Edit"),
        "{out}"
    );
}

#[test]
fn a_changeset_of_another_shape_is_one_error() {
    let errors = changes_errors(quote! {
        #[versioned(model = Document)]
        #[diesel(table_name = documents)]
        struct Edit(String);
    });
    assert_eq!(
        errors,
        ["#[derive(VersionedChanges)] needs named fields, one per column, but `Edit` is a tuple struct; write it as `struct Edit { id: i64, .. }`"]
    );
}
