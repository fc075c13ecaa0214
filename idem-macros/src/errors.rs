//! Collects every mistake in a macro's input so they are reported at once.

use proc_macro2::TokenStream;

/// Errors found while reading a macro's input, each spanned at the user's token.
#[derive(Default)]
pub(crate) struct Errors {
    first: Option<syn::Error>,
}

impl Errors {
    pub(crate) fn push(&mut self, err: syn::Error) {
        match &mut self.first {
            Some(first) => first.combine(err),
            None => self.first = Some(err),
        }
    }

    pub(crate) fn push_at(&mut self, span: impl quote::ToTokens, message: impl std::fmt::Display) {
        self.push(syn::Error::new_spanned(span, message));
    }

    /// `Err` with every collected error, or `Ok(value)` when there were none.
    pub(crate) fn finish<T>(self, value: T) -> syn::Result<T> {
        match self.first {
            Some(err) => Err(err),
            None => Ok(value),
        }
    }
}

/// The `compile_error!`s for `err`, for a derive (which cannot re-emit its item).
pub(crate) fn to_compile_errors(err: syn::Error) -> TokenStream {
    err.to_compile_error()
}
