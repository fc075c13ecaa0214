//! Recognising idem's own attributes on an item, where `#[idempotent]` and
//! `#[retryable]` each look for the other.

/// Whether `attr` is `#[name(..)]`, by any path ending in `name`
/// (`retryable`, `idem::retryable`).
pub(crate) fn is_attr(attr: &syn::Attribute, name: &str) -> bool {
    attr.path().segments.last().is_some_and(|s| s.ident == name)
}
