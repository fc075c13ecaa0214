//! `#[derive(Versioned)]` and `#[derive(VersionedChanges)]`.

mod expand;
mod parse;

use proc_macro2::TokenStream;

use crate::errors::to_compile_errors;

pub(crate) fn derive_model(input: TokenStream) -> TokenStream {
    match syn::parse2(input).and_then(|input| parse::Model::from_input(&input)) {
        Ok(model) => expand::model(&model),
        Err(err) => to_compile_errors(err),
    }
}

pub(crate) fn derive_changes(input: TokenStream) -> TokenStream {
    match syn::parse2(input).and_then(|input| parse::ChangeSet::from_input(&input)) {
        Ok(changes) => expand::changes(&changes),
        Err(err) => to_compile_errors(err),
    }
}

#[cfg(test)]
mod tests;
