//! The procedural macros of `idem`. Use them through the `idem` crate, whose
//! documentation describes what each one guarantees.
//!
//! Every macro keeps parsing, validation and generation apart: `parse` turns
//! tokens into a typed description (keeping the user's tokens for spans),
//! reporting every mistake at once; `expand` only reads that description.

mod errors;
mod idempotent;
mod retryable;
mod versioned;

use proc_macro::TokenStream;

/// See `idem::Versioned`.
#[proc_macro_derive(Versioned, attributes(versioned, diesel))]
pub fn derive_versioned(input: TokenStream) -> TokenStream {
    versioned::derive_model(input.into()).into()
}

/// See `idem::VersionedChanges`.
#[proc_macro_derive(VersionedChanges, attributes(versioned, diesel))]
pub fn derive_versioned_changes(input: TokenStream) -> TokenStream {
    versioned::derive_changes(input.into()).into()
}

/// See `idem::retryable`.
#[proc_macro_attribute]
pub fn retryable(args: TokenStream, item: TokenStream) -> TokenStream {
    retryable::retryable(args.into(), item.into()).into()
}

/// See `idem::idempotent`.
#[proc_macro_attribute]
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    idempotent::idempotent(args.into(), item.into()).into()
}
