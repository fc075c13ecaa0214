//! `#[idempotent]`: claim before acting, replay the first result, refuse a
//! different request under the same key.

mod expand;
pub(crate) mod parse;

use proc_macro2::TokenStream;
use quote::ToTokens;

use crate::attrs::{is_attr, Maker};
use crate::retryable;

pub(crate) fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    let mut func: syn::ItemFn = match syn::parse2(item.clone()) {
        Ok(func) => func,
        Err(err) => {
            let mut out = err.to_compile_error();
            out.extend(item);
            return out;
        }
    };
    // Said here, in this attribute's words (the loop's own check would speak
    // of #[retryable]).
    if let syn::ReturnType::Default = func.sig.output {
        let mut out = syn::Error::new_spanned(
            &func.sig.ident,
            "an #[idempotent] fn returns `Result<T, E>`: the `T` is the response stored and replayed under the key, and `E` carries idem's errors (`From<idem::Error>`)",
        )
        .to_compile_error();
        out.extend(func.into_token_stream());
        return out;
    }
    // Already expanded: below #[retryable] under another name (`use
    // idem::idempotent as once;`), which #[retryable] finds only by a path
    // ending in `idempotent`, or written twice. Said once; that output goes
    // on as it is.
    if let Some(maker) = crate::attrs::made_by(&func) {
        let mut out = crate::attrs::already_expanded(Maker::Idempotent, maker).to_compile_error();
        out.extend(func.into_token_stream());
        return out;
    }
    // A #[retryable] below this attribute has not run yet: its settings
    // become the policy of the loop generated here.
    let retry_attr = func
        .attrs
        .iter()
        .position(|a| is_attr(a, Maker::Retryable.name()))
        .map(|i| func.attrs.remove(i));
    // A second #[retryable]: one error at it, and it is dropped, so the rest
    // expands as with one.
    let twice = func
        .attrs
        .iter()
        .position(|a| is_attr(a, Maker::Retryable.name()))
        .map(|i| {
            let second = func.attrs.remove(i);
            syn::Error::new_spanned(
                &second,
                "#[retryable] is written twice on this function: one is enough",
            )
            .to_compile_error()
        });
    let mut out = twice.unwrap_or_default();
    out.extend(expand_checked(args, func, retry_attr));
    out
}

/// The function with its `#[retryable]` (if any) taken off: checked, then
/// expanded, or its errors beside a fallback.
fn expand_checked(
    args: TokenStream,
    func: syn::ItemFn,
    retry_attr: Option<syn::Attribute>,
) -> TokenStream {
    let retry_args = match &retry_attr {
        // Without the mark #[retryable] leaves when it hands over.
        Some(attr) => match &attr.meta {
            syn::Meta::List(list) => crate::attrs::strip_handed_off(list.tokens.clone()).1,
            _ => TokenStream::new(),
        },
        None => TokenStream::new(),
    };
    // The shape's errors name the attribute the user wrote.
    let maker = match retry_attr {
        Some(_) => Maker::Retryable,
        None => Maker::Idempotent,
    };
    let shape = retryable::parse::Retryable::from_tokens_for(retry_args, &func, maker);
    let parsed = parse::Idempotent::from_tokens(args, &func);
    let (shape, parsed) = match (shape, parsed) {
        (Ok(shape), Ok(parsed)) => match check_connection(&shape, &parsed) {
            Ok(()) => (Ok(shape), Ok(parsed)),
            Err(err) => (Ok(shape), Err(err)),
        },
        other => other,
    };
    match (shape, parsed) {
        (Ok(mut shape), Ok(parsed)) => {
            expand::mark_attribute_uses(&mut shape, &parsed);
            let retry_path = retry_attr.as_ref().map(|a| a.path().clone());
            let mut out = TokenStream::new();
            if parsed.scope.is_none() {
                out.extend(parse::missing_scope().to_compile_error());
            }
            out.extend(expand::idempotent(&shape, &parsed, retry_path.as_ref()));
            out
        }
        (shape, parsed) => {
            let mut errors = crate::errors::Errors::default();
            for err in [shape.err(), parsed.err()].into_iter().flatten() {
                errors.push(err);
            }
            let err = errors.finish(()).expect_err("one of the two failed");
            let mut out = err.to_compile_error();
            out.extend(fallback(func, retry_attr));
            out
        }
    }
}

/// What keeps one mistake in the attributes from becoming many: the function
/// expanded with default settings (its key derived from nothing, in the key
/// space of `scope = none`: it is never run) and the connection where it
/// stands, so callers that pass a pool and read an `Idempotent<T>` compile
/// as they will once the attributes are fixed; the function as written when
/// its shape is wrong otherwise (a parameter, the return type).
fn fallback(mut func: syn::ItemFn, retry_attr: Option<syn::Attribute>) -> TokenStream {
    // The mode that fits the function's first parameter.
    for defaults in [
        quote::quote!(scope = none),
        quote::quote!(scope = none, mode = external),
    ] {
        let shape = retryable::parse::Retryable::stand_in(&func, Maker::Idempotent);
        // Fingerprinting nothing: no bound on the parameters' types either.
        let parsed = parse::Idempotent::from_tokens(defaults, &func).map(|mut parsed| {
            parsed.fingerprint = Some(Vec::new());
            parsed
        });
        if let (Ok(mut shape), Ok(parsed)) = (shape, parsed) {
            if check_connection(&shape, &parsed).is_ok() {
                expand::mark_attribute_uses(&mut shape, &parsed);
                // A stand-in while the error stands: the parameters the
                // attributes name (`key = ..`, `scope = ..`) are not used by
                // these defaults, and a warning for each would add to the
                // one error (an error under `deny(warnings)`).
                shape
                    .func
                    .attrs
                    .push(syn::parse_quote!(#[allow(unused_variables)]));
                let retry_path = retry_attr.as_ref().map(|a| a.path().clone());
                return expand::idempotent(&shape, &parsed, retry_path.as_ref());
            }
        }
    }
    if let Some(attr) = retry_attr {
        func.attrs.push(attr);
    }
    func.into_token_stream()
}

/// The first parameter fits the mode: the attempt's connection in local
/// mode, the deferred handle in external mode.
fn check_connection(
    shape: &retryable::parse::Retryable,
    parsed: &parse::Idempotent,
) -> syn::Result<()> {
    use retryable::parse::ConnKind;
    let (kind, span) = (shape.conn_kind.0, &shape.conn_kind.1);
    match (&parsed.mode, kind) {
        (parse::ModeArg::External, ConnKind::Connection) => Err(syn::Error::new_spanned(
            span,
            "in `mode = external` the body calls another system with no transaction open: take `db: &mut idem::Deferred<'_>` here, and get the connection for the writes that commit with the outcome from `db.conn().await?` after the call",
        )),
        (parse::ModeArg::Local, ConnKind::Deferred) => Err(syn::Error::new_spanned(
            span,
            "`idem::Deferred` is for `mode = external`; a local #[idempotent] body runs in one transaction with its claim and takes `conn: &mut AsyncPgConnection`",
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests;
