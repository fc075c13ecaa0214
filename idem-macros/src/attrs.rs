//! Recognising idem's own attributes on an item, where `#[idempotent]` and
//! `#[retryable]` each look for the other, and the output of the other.

/// Whether `attr` is `#[name(..)]`, by any path ending in `name`
/// (`retryable`, `idem::retryable`).
pub(crate) fn is_attr(attr: &syn::Attribute, name: &str) -> bool {
    attr.path().segments.last().is_some_and(|s| s.ident == name)
}

/// Whether `func` is the output of #[idempotent] or #[retryable]: its first
/// parameter is the `&::idem::Pool` that each writes in place of the
/// connection, and its body uses their `__idem_` names. Either finds the
/// other only by name; under another name (`use idem::retryable as
/// retry;`) the other expands first, and the one that runs second meets
/// this.
pub(crate) fn takes_idem_pool(func: &syn::ItemFn) -> bool {
    let Some(syn::FnArg::Typed(first)) = func.sig.inputs.first() else {
        return false;
    };
    let syn::Type::Reference(reference) = &*first.ty else {
        return false;
    };
    let syn::Type::Path(path) = &*reference.elem else {
        return false;
    };
    let segments: Vec<String> = path
        .path
        .segments
        .iter()
        .map(|s| s.ident.to_string())
        .collect();
    path.qself.is_none()
        && path.path.leading_colon.is_some()
        && segments == ["idem", "Pool"]
        && uses_idem_names(quote::ToTokens::to_token_stream(&func.block))
}

fn uses_idem_names(tokens: proc_macro2::TokenStream) -> bool {
    tokens.into_iter().any(|token| match token {
        proc_macro2::TokenTree::Ident(ident) => ident.to_string().starts_with("__idem_"),
        proc_macro2::TokenTree::Group(group) => uses_idem_names(group.stream()),
        _ => false,
    })
}
