//! Generates the loop around a parsed `#[retryable]` function.

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{FnArg, ReturnType};

use super::parse::{IsolationArg, OnConflictArg, Retryable};

pub(crate) fn policy(parsed: &Retryable) -> TokenStream {
    let s = &parsed.settings;
    let mut policy = match &s.policy {
        Some(base) => quote!({ let __idem_policy: ::idem::RetryPolicy = #base; __idem_policy }),
        None => quote!(::idem::RetryPolicy::new()),
    };
    let millis = |ms: u64| quote!(::core::time::Duration::from_millis(#ms));
    if let Some(n) = s.max {
        policy = quote!(#policy.max_attempts(#n));
    }
    if let Some(ms) = s.deadline_ms.map(millis) {
        policy = quote!(#policy.deadline(#ms));
    }
    if let Some(ms) = s.backoff_base_ms.map(millis) {
        policy = quote!(#policy.backoff_base(#ms));
    }
    if let Some(ms) = s.backoff_cap_ms.map(millis) {
        policy = quote!(#policy.backoff_cap(#ms));
    }
    if let Some(ms) = s.hot_row_memory_ms.map(millis) {
        policy = quote!(#policy.hot_row_memory(#ms));
    }
    if let Some(ms) = s.commit_timeout_ms.map(millis) {
        policy = quote!(#policy.commit_timeout(#ms));
    }
    if let Some(level) = s.isolation {
        let variant = match level {
            IsolationArg::ReadCommitted => quote!(ReadCommitted),
            IsolationArg::RepeatableRead => quote!(RepeatableRead),
            IsolationArg::Serializable => quote!(Serializable),
        };
        policy = quote!(#policy.isolation(::idem::Isolation::#variant));
    }
    if let Some(mode) = s.on_conflict {
        let variant = match mode {
            OnConflictArg::Retry => quote!(Retry),
            OnConflictArg::Lock => quote!(Lock),
        };
        policy = quote!(#policy.on_conflict(::idem::OnConflict::#variant));
    }
    if let Some(flag) = s.retry_lock_not_available {
        policy = quote!(#policy.retry_lock_not_available(#flag));
    }
    policy
}

/// The function as callers see it: the connection parameter takes a pool.
pub(crate) fn pool_signature(parsed: &Retryable) -> syn::Signature {
    let mut sig = parsed.func.sig.clone();
    for (index, input) in sig.inputs.iter_mut().enumerate() {
        let FnArg::Typed(arg) = input else { continue };
        let conn = index == parsed.conn_index;
        if conn {
            let span = arg.ty.span();
            *arg.ty = syn::parse_quote_spanned!(span=> &::idem::Pool);
        }
        // The connection's `mut`, and a by-value argument's, go to the
        // attempt's own binding (see `attempt_run_with`): the caller's is
        // never changed. A reference's stays, for the body's captured copy.
        if let syn::Pat::Ident(p) = &mut *arg.pat {
            let by_value = || {
                parsed
                    .replayed
                    .iter()
                    .any(|r| r.by_value && r.ident == p.ident)
            };
            if conn || by_value() {
                p.mutability = None;
            }
        }
    }
    sig
}

/// The declared return type, and where to point errors about it.
pub(crate) fn return_type(parsed: &Retryable) -> (TokenStream, Span) {
    match &parsed.func.sig.output {
        ReturnType::Type(_, ty) => (quote!(#ty), ty.span()),
        ReturnType::Default => (quote!(()), parsed.func.sig.ident.span()),
    }
}

/// One run of the user's body on `attempt`'s connection, with every
/// by-value argument cloned afresh: an expression of the declared return type.
pub(crate) fn attempt_run(parsed: &Retryable, attempt: &syn::Ident) -> TokenStream {
    attempt_run_with(parsed, quote!(#attempt.conn()))
}

/// [`attempt_run`], the body's first parameter bound to `conn` (an
/// expression of the parameter's declared type).
pub(crate) fn attempt_run_with(parsed: &Retryable, conn_value: TokenStream) -> TokenStream {
    let conn = &parsed.conn_ident;
    let body = &parsed.func.block;
    let (ret, _) = return_type(parsed);
    let replays = parsed.replayed.iter().filter(|r| r.by_value).map(|r| {
        let (ident, mutability) = (&r.ident, &r.mutability);
        quote_spanned! {r.ty_span=> let #mutability #ident = ::idem::__private::replay_arg(&#ident);}
    });
    // The connection type as the user wrote it, so that the import naming it
    // counts as used (callers see a pool there); its lifetime is the attempt's.
    let conn_ty = match &parsed.func.sig.inputs[parsed.conn_index] {
        FnArg::Typed(arg) => match &*arg.ty {
            syn::Type::Reference(r) => {
                let elem = &r.elem;
                quote_spanned!(arg.ty.span()=> &mut #elem)
            }
            _ => quote!(&mut ::idem::__private::diesel_async::AsyncPgConnection),
        },
        FnArg::Receiver(_) => quote!(&mut ::idem::__private::diesel_async::AsyncPgConnection),
    };
    // `mut conn` as the user wrote it (the pool parameter callers see drops
    // it; the body's binding keeps it).
    let mutability = match &parsed.func.sig.inputs[parsed.conn_index] {
        FnArg::Typed(arg) => match &*arg.pat {
            syn::Pat::Ident(p) => p.mutability,
            _ => None,
        },
        FnArg::Receiver(_) => None,
    };
    quote! {{
        let #mutability #conn: #conn_ty = #conn_value;
        #(#replays)*
        ::idem::__private::attempt_body::<#ret, _>(async move #body).await
    }}
}

/// The `module::function` name traces and metrics show.
pub(crate) fn function_name(parsed: &Retryable) -> TokenStream {
    let name = &parsed.func.sig.ident;
    quote!(::core::concat!(
        ::core::module_path!(),
        "::",
        ::core::stringify!(#name)
    ))
}

pub(crate) fn retryable(parsed: &Retryable) -> TokenStream {
    let attrs = &parsed.func.attrs;
    let vis = &parsed.func.vis;
    let sig = pool_signature(parsed);
    let conn = &parsed.conn_ident;
    let (_, ret_span) = return_type(parsed);

    let mixed = Span::mixed_site();
    let retry_loop = format_ident!("__idem_loop", span = mixed);
    let attempt = format_ident!("__idem_attempt", span = mixed);
    let result = format_ident!("__idem_result", span = mixed);
    let outcome = format_ident!("__idem_outcome", span = mixed);
    let error = format_ident!("__idem_error", span = mixed);
    // Spanned at the return type: a missing `From<idem::Error>` is reported
    // there, once, with the bound's own message.
    let into_err = quote_spanned!(ret_span=> ::idem::__private::idem_error(#error));
    let policy = policy(parsed);
    let name = function_name(parsed);
    let run = attempt_run(parsed, &attempt);
    // The bounds of `finish` are the ones a user's error type can miss: point
    // the call's tokens at the return type, so that those errors point there
    // rather than at the attribute.
    let at_ret =
        |ident: &syn::Ident| syn::Ident::new(&ident.to_string(), mixed.located_at(ret_span));
    let (loop_at_ret, attempt_at_ret, result_at_ret) =
        (at_ret(&retry_loop), at_ret(&attempt), at_ret(&result));
    let finish = quote_spanned! {ret_span=>
        #loop_at_ret.finish(#attempt_at_ret, ::idem::__private::commit(#result_at_ret)).await
    };

    quote! {
        #(#attrs)*
        #vis #sig {
            let mut #retry_loop = ::idem::__private::RetryLoop::new(#conn, #policy, #name);
            loop {
                let mut #attempt = match #retry_loop.begin().await {
                    ::core::result::Result::Ok(#attempt) => #attempt,
                    ::core::result::Result::Err(#error) => {
                        return ::core::result::Result::Err(#into_err);
                    }
                };
                let #result = #retry_loop.scope(async { #run }).await;
                if let ::core::ops::ControlFlow::Break(#outcome) = #finish {
                    return #outcome;
                }
            }
        }
    }
}
