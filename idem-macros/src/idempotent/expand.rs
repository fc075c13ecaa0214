//! Generates the idempotent function: validation, the claim (local mode: in
//! each attempt; external mode: committed first), and the retry loop whose
//! attempts run the body and record its outcome.

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned, ToTokens};
use syn::spanned::Spanned;

use super::parse::{variables_in, Idempotent, ModeArg, ScopeArg};
use crate::retryable::expand::{
    attempt_run, attempt_run_with, function_name, policy, pool_signature, return_type,
};
use crate::retryable::parse::Retryable;

fn config(parsed: &Idempotent) -> TokenStream {
    let mut config = match &parsed.config {
        Some(expr) => {
            quote!({ let __idem_config: ::idem::IdempotencyConfig = #expr; __idem_config })
        }
        None => quote!(::idem::IdempotencyConfig::new()),
    };
    if let ModeArg::External = parsed.mode {
        config = quote!(#config.mode(::idem::Mode::External));
    }
    if let Some(s) = parsed.ttl_s {
        config = quote!(#config.ttl(::core::time::Duration::from_secs(#s)));
    }
    if let Some(ms) = parsed.lease_ms {
        config = quote!(#config.lease(::core::time::Duration::from_millis(#ms)));
    }
    if let Some(ms) = parsed.wait_ms {
        config = quote!(#config.wait(::core::time::Duration::from_millis(#ms)));
    }
    if let Some(n) = parsed.max_response_bytes {
        let n = n as usize;
        config = quote!(#config.max_response_bytes(#n));
    }
    config
}

/// A by-value parameter is cloned afresh for each attempt; when only the
/// attribute (key, scope, fingerprint) reads it, that per-attempt copy would
/// be reported as an unused variable at the parameter. Mark the copies of the
/// parameters the attribute reads as used.
pub(crate) fn mark_attribute_uses(shape: &mut Retryable, parsed: &Idempotent) {
    let mut names = Vec::new();
    let scope = match &parsed.scope {
        Some(ScopeArg::Values(expr)) => Some(expr),
        _ => None,
    };
    let exprs = [
        parsed.key.as_ref(),
        scope,
        parsed.config.as_ref(),
        parsed.cache.as_ref(),
    ];
    for expr in exprs.into_iter().flatten() {
        variables_in(expr.to_token_stream(), &mut names);
    }
    match &parsed.fingerprint {
        Some(fields) => {
            for field in fields {
                variables_in(field.expr.to_token_stream(), &mut names);
            }
        }
        None => names.extend(parsed.params.iter().cloned()),
    }
    let marks: Vec<syn::Stmt> = shape
        .replayed
        .iter()
        .filter(|r| r.by_value && names.contains(&r.ident))
        .map(|r| {
            let ident = &r.ident;
            syn::parse_quote!(let _ = &#ident;)
        })
        .collect();
    shape.func.block.stmts.splice(0..0, marks);
}

pub(crate) fn idempotent(
    shape: &Retryable,
    parsed: &Idempotent,
    retryable: Option<&syn::Path>,
) -> TokenStream {
    let has_retryable = retryable.is_some();
    let attrs = &shape.func.attrs;
    let vis = &shape.func.vis;
    let mut sig = pool_signature(shape);
    let pool = &shape.conn_ident;
    let (ret, ret_span) = return_type(shape);
    let parts = quote_spanned!(ret_span=> <#ret as ::idem::__private::ResultParts>);
    sig.output = syn::parse_quote_spanned! {ret_span=>
        -> ::core::result::Result<::idem::Idempotent<#parts::Ok>, #parts::Err>
    };

    let mixed = Span::mixed_site();
    let request = format_ident!("__idem_request", span = mixed);
    let retry_loop = format_ident!("__idem_loop", span = mixed);
    let attempt = format_ident!("__idem_attempt", span = mixed);
    let result = format_ident!("__idem_result", span = mixed);
    let outcome = format_ident!("__idem_outcome", span = mixed);
    let error = format_ident!("__idem_error", span = mixed);
    // Spanned at the return type: a missing `From<idem::Error>` is reported
    // there, once, with the bound's own message.
    let into_err = quote_spanned!(ret_span=> ::idem::__private::idem_error(#error));

    // No #[retryable]: one attempt, still claimed and recorded in its transaction.
    let policy = if has_retryable {
        policy(shape)
    } else {
        quote!(::idem::RetryPolicy::new().max_attempts(1))
    };
    let config = config(parsed);
    let name = function_name(shape);
    let operation = match &parsed.operation {
        Some(op) => quote!(#op),
        None => name.clone(),
    };
    let key = match &parsed.key {
        Some(expr) => {
            quote!(::core::option::Option::Some(::idem::__private::KeyInput::key(&(#expr))))
        }
        None => quote!(::core::option::Option::None),
    };
    let scope = match &parsed.scope {
        // A tuple of borrowed fields (`(ctx.user, ctx.conversation)`) is
        // serialized from references, so it needs no Copy or Clone.
        Some(ScopeArg::Values(syn::Expr::Tuple(tuple))) => {
            let elems = tuple.elems.iter();
            quote!(&(#(&(#elems),)*))
        }
        Some(ScopeArg::Values(expr)) => quote!(&(#expr)),
        Some(ScopeArg::None) | None => quote!(&()),
    };
    let fields: Vec<TokenStream> = match &parsed.fingerprint {
        Some(fields) => fields
            .iter()
            .map(|f| {
                let name = &f.name;
                let expr = &f.expr;
                quote!(::idem::__private::Field::new(#name, &(#expr))?)
            })
            .collect(),
        None => parsed
            .params
            .iter()
            .map(|p| {
                let name = p.to_string();
                quote!(::idem::__private::Field::new(#name, &#p)?)
            })
            .collect(),
    };
    // External mode: the body gets the deferred handle, and nothing is open
    // while it calls the other system.
    let run = match parsed.mode {
        ModeArg::External => {
            attempt_run_with(shape, quote!(&mut ::idem::Deferred::new(&mut #attempt)))
        }
        ModeArg::Local => attempt_run(shape, &attempt),
    };
    let err_ty = quote_spanned!(ret_span=> #parts::Err);
    let ok_ty = quote_spanned!(ret_span=> #parts::Ok);

    let build = quote! {
        let #request = match (|| -> ::core::result::Result<::idem::__private::Request, ::idem::Error> {
            let __idem_fields = [#(#fields),*];
            ::idem::__private::Request::new(#config, #operation, #key, #scope, &__idem_fields)
        })() {
            ::core::result::Result::Ok(#request) => #request,
            ::core::result::Result::Err(#error) => {
                return ::core::result::Result::Err(#into_err);
            }
        };
    };

    // Both modes: the same begin / scope / finish as #[retryable], with the
    // call's enter and leave steps around the body and its end after the loop.
    let call = format_ident!("__idem_call", span = mixed);
    // `cache = ..`: a replay from Redis answers before any connection is
    // checked out; the cache is filled in `end`.
    let cached = parsed.cache.as_ref().map(|expr| {
        let input =
            quote_spanned!(expr.span()=> ::idem::__private::CacheInput::replay_cache(&(#expr)));
        quote! {
            #call.set_cache(#input);
            if let ::core::option::Option::Some(#outcome) = #call.cached::<#ok_ty>(#pool).await {
                return #outcome;
            }
        }
    });
    let flow = quote! {
        let mut #call = ::idem::__private::Call::<#err_ty>::new(#request, #pool);
        #cached
        let mut #retry_loop = ::idem::__private::RetryLoop::new(#pool, #policy, #name);
        let #outcome = loop {
            let mut #attempt = match #retry_loop.begin_with(#call.begin()).await {
                ::core::result::Result::Ok(#attempt) => #attempt,
                ::core::result::Result::Err(#error) => break ::core::result::Result::Err(#into_err),
            };
            let #result = #retry_loop.scope(::idem::__private::under_key(::std::borrow::ToOwned::to_owned(#call.request().key()), async {
                if let ::core::option::Option::Some(#outcome) = #call.enter::<#ok_ty>(&mut #attempt).await {
                    return #outcome;
                }
                let #outcome = #run;
                #call.leave(&mut #attempt, #outcome).await
            })).await;
            if let ::core::ops::ControlFlow::Break(#outcome) = #retry_loop.finish(#attempt, #result).await {
                break #outcome;
            }
        };
        #call.end(#pool, &mut #retry_loop, #outcome).await
    };

    // The #[retryable] attribute was consumed here, so its import would look
    // unused; name it once. Spanned at the user's path: without the import,
    // rustc's "unresolved import" points at their `#[retryable]`, not at
    // this attribute.
    let uses_retryable = retryable
        .map(|path| quote_spanned!(path.span()=> #[allow(unused_imports)] use #path as _;));

    // The return type spells the user's `Result<V, E>` out through
    // `ResultParts`, which clippy scores as too complex. It stays silent on
    // macro output, but an attribute macro below this one that re-emits the
    // type (`#[tracing::instrument]` binds it in a `let`) makes the type the
    // user's tokens again, and the warning lands on their return type. Only
    // then is it allowed: a crate that forbids the lint gets no error from
    // an allow it does not need.
    let allow_complexity = attrs
        .iter()
        .any(|attr| !crate::attrs::is_builtin(attr))
        .then(|| quote!(#[allow(clippy::type_complexity)]));
    quote! {
        #allow_complexity
        #(#attrs)*
        #vis #sig {
            #uses_retryable
            #build
            #flow
        }
    }
}
