//! `#[retryable]`: the body becomes one attempt of a retry loop over a pool.

pub(crate) mod expand;
pub(crate) mod parse;

use proc_macro2::TokenStream;
use quote::ToTokens;

use crate::attrs::Maker;

pub(crate) fn retryable(args: TokenStream, item: TokenStream) -> TokenStream {
    let func: syn::ItemFn = match syn::parse2(item.clone()) {
        Ok(func) => func,
        Err(err) => {
            let mut out = err.to_compile_error();
            out.extend(item);
            return out;
        }
    };
    // Handed off once already: an #[idempotent] still here is one rustc
    // could not resolve (not imported), which would be handed the function
    // again and again; expanded as it is, rustc names the missing import.
    let (handed_off, args) = crate::attrs::strip_handed_off(args);
    // The mark only ever goes below an #[idempotent]; written by hand, it
    // is refused (and the rest expands as without it).
    let forged = handed_off
        && !func
            .attrs
            .iter()
            .any(|a| crate::attrs::is_attr(a, Maker::Idempotent.name()));
    if forged {
        let mut out = syn::Error::new(
            proc_macro2::Span::call_site(),
            "`__idem_handed_off` is idem's own mark, not a setting: take it out of #[retryable(..)]",
        )
        .to_compile_error();
        out.extend(retryable(args, func.into_token_stream()));
        return out;
    }
    // #[idempotent] below #[retryable]: let it run first, with this attribute
    // still on the function, so both orders of stacking mean the same thing.
    if let Some(i) = func
        .attrs
        .iter()
        .position(|a| crate::attrs::is_attr(a, Maker::Idempotent.name()))
        .filter(|_| !handed_off)
    {
        let mut func = func;
        let inner = func.attrs.remove(i);
        let inner_args = match &inner.meta {
            syn::Meta::List(list) => list.tokens.clone(),
            _ => TokenStream::new(),
        };
        // The user's own path, so their `use idem::idempotent` counts as used.
        let inner_path = inner.path();
        let args = crate::attrs::handed_off(args);
        return quote::quote! {
            #[#inner_path(#inner_args)]
            #[::idem::retryable(#args)]
            #func
        };
    }
    // Already expanded: below #[idempotent] under another name (`use
    // idem::retryable as retry;`), which #[idempotent] finds only by a path
    // ending in `retryable`, or written twice. Said once, here, rather than
    // as errors about the pool parameter of that output, which goes on as
    // it is.
    if let Some(maker) = crate::attrs::made_by(&func) {
        let mut out = crate::attrs::already_expanded(Maker::Retryable, maker).to_compile_error();
        out.extend(func.into_token_stream());
        return out;
    }
    match parse::Retryable::from_tokens(args, &func) {
        Ok(parsed) if parsed.conn_kind.0 == parse::ConnKind::Deferred => {
            let mut out = syn::Error::new_spanned(
                &parsed.conn_kind.1,
                "`idem::Deferred` is the database side of an external #[idempotent] fn; a #[retryable] body runs in its attempt's transaction and takes `conn: &mut AsyncPgConnection` (with #[idempotent(.., mode = external)] below, write it by that name: #[retryable] finds it only by a path ending in `idempotent`)",
            )
            .to_compile_error();
            out.extend(func.into_token_stream());
            out
        }
        Ok(parsed) => expand::retryable(&parsed),
        Err(err) => with_fallback(err, &func),
    }
}

/// The error, beside what keeps one mistake from becoming many: when only
/// the settings are wrong, or the connection is out of place, the function
/// expanded with the default settings and the connection where it stands
/// (its callers pass a pool there, and see no error of their own); when the
/// function itself is wrong otherwise, the function as written.
fn with_fallback(err: syn::Error, func: &syn::ItemFn) -> TokenStream {
    let mut out = err.to_compile_error();
    match parse::Retryable::stand_in(func, Maker::Retryable) {
        Ok(defaults) if defaults.conn_kind.0 != parse::ConnKind::Deferred => {
            out.extend(expand::retryable(&defaults))
        }
        _ => out.extend(func.into_token_stream()),
    }
    out
}

#[cfg(test)]
mod tests;
