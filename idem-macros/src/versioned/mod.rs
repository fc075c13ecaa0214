//! `#[derive(Versioned)]` and `#[derive(VersionedChanges)]`.
//!
//! `parse` reads the struct and its attributes, `validate` checks every name
//! and role against the fields, `expand` writes the impls of a valid input,
//! `once` the create-once statements of a model that declares them, and
//! `fallback` the impls that keep one mistake to one error.

mod expand;
mod fallback;
mod once;
mod parse;
mod validate;

use proc_macro2::TokenStream;

use crate::errors::{to_compile_errors, Errors};

pub(crate) fn derive_model(input: TokenStream) -> TokenStream {
    let input: syn::DeriveInput = match syn::parse2(input) {
        Ok(input) => input,
        Err(err) => return to_compile_errors(err),
    };
    let mut errors = Errors::default();
    let parsed = parse::ModelInput::parse(&input, &mut errors);
    let roles = validate::model(&parsed, &mut errors);
    if let Err(err) = errors.finish(()) {
        return fallback::model(&parsed, &roles, err);
    }
    let ident = parsed.ident.clone();
    match roles.into_model(parsed) {
        Some(model) => expand::model(&model, once::expand(&model)),
        // Validation reports every role it cannot resolve; this is a bug of idem.
        None => to_compile_errors(syn::Error::new_spanned(
            ident,
            "#[derive(Versioned)] could not tell this model's tenant, version and key columns, and did not say why; please report this to idem, with the struct",
        )),
    }
}

pub(crate) fn derive_changes(input: TokenStream) -> TokenStream {
    let input: syn::DeriveInput = match syn::parse2(input) {
        Ok(input) => input,
        Err(err) => return to_compile_errors(err),
    };
    let mut errors = Errors::default();
    let parsed = parse::ChangesInput::parse(&input, &mut errors);
    let changes = validate::changes(&parsed, &mut errors);
    match (errors.finish(()), changes) {
        (Ok(()), Some(changes)) => expand::changes(&changes),
        (Err(err), _) => fallback::changes(&parsed, err),
        // Validation reports a missing model, table or field list.
        (Ok(()), None) => to_compile_errors(syn::Error::new_spanned(
            &parsed.ident,
            "#[derive(VersionedChanges)] could not tell this changeset's model, table and fields, and did not say why; please report this to idem, with the struct",
        )),
    }
}

#[cfg(test)]
mod tests;
