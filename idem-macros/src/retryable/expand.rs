//! Generates the loop around a parsed `#[retryable]` function.

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{FnArg, ReturnType};

use super::parse::{Retryable, SettingValue};

fn policy(parsed: &Retryable) -> TokenStream {
    let mut policy = quote!(::idem::RetryPolicy::new());
    if let Some(base) = parsed.settings.iter().find_map(|s| match &s.value {
        SettingValue::Policy(expr) => Some(expr),
        _ => None,
    }) {
        policy = quote!({ let __idem_policy: ::idem::RetryPolicy = #base; __idem_policy });
    }
    for setting in &parsed.settings {
        let setter = match (setting.key.to_string().as_str(), &setting.value) {
            ("max", SettingValue::Count(n)) => quote!(.max_attempts(#n)),
            ("deadline_ms", SettingValue::Millis(ms)) => {
                quote!(.deadline(::core::time::Duration::from_millis(#ms)))
            }
            ("backoff_base_ms", SettingValue::Millis(ms)) => {
                quote!(.backoff_base(::core::time::Duration::from_millis(#ms)))
            }
            ("backoff_cap_ms", SettingValue::Millis(ms)) => {
                quote!(.backoff_cap(::core::time::Duration::from_millis(#ms)))
            }
            ("commit_timeout_ms", SettingValue::Millis(ms)) => {
                quote!(.commit_timeout(::core::time::Duration::from_millis(#ms)))
            }
            (_, SettingValue::Isolation(level)) => {
                let variant = match level.to_string().as_str() {
                    "serializable" => quote!(Serializable),
                    "repeatable_read" => quote!(RepeatableRead),
                    _ => quote!(ReadCommitted),
                };
                quote!(.isolation(::idem::Isolation::#variant))
            }
            (_, SettingValue::OnConflict(mode)) => {
                let variant = if mode == "lock" {
                    quote!(Lock)
                } else {
                    quote!(Retry)
                };
                quote!(.on_conflict(::idem::OnConflict::#variant))
            }
            (_, SettingValue::Flag(flag)) => quote!(.retry_lock_not_available(#flag)),
            _ => continue,
        };
        policy = quote!(#policy #setter);
    }
    policy
}

pub(crate) fn retryable(parsed: &Retryable) -> TokenStream {
    let func = &parsed.func;
    let attrs = &func.attrs;
    let vis = &func.vis;
    let mut sig = func.sig.clone();
    let body = &func.block;
    let conn = &parsed.conn_ident;

    // The caller hands a pool where the function declared its connection.
    if let FnArg::Typed(arg) = &mut sig.inputs[parsed.conn_index] {
        let span = arg.ty.span();
        *arg.ty = syn::parse_quote_spanned!(span=> &::idem::Pool);
        if let syn::Pat::Ident(p) = &mut *arg.pat {
            p.mutability = None;
        }
    }
    let ret = match &sig.output {
        ReturnType::Type(_, ty) => quote!(#ty),
        ReturnType::Default => quote!(()),
    };
    let ret_span = match &sig.output {
        ReturnType::Type(_, ty) => ty.span(),
        ReturnType::Default => sig.ident.span(),
    };

    let mixed = Span::mixed_site();
    let retry_loop = format_ident!("__idem_loop", span = mixed);
    let attempt = format_ident!("__idem_attempt", span = mixed);
    let result = format_ident!("__idem_result", span = mixed);
    let outcome = format_ident!("__idem_outcome", span = mixed);
    let error = format_ident!("__idem_error", span = mixed);
    let name = &sig.ident;
    let policy = policy(parsed);

    let replays = parsed.replayed.iter().filter(|r| r.by_value).map(|r| {
        let ident = &r.ident;
        quote_spanned! {r.ty_span=> let #ident = ::idem::__private::replay_arg(&#ident);}
    });
    let finish = quote_spanned! {ret_span=>
        #retry_loop.finish(#attempt, #result).await
    };

    quote! {
        #(#attrs)*
        #vis #sig {
            let mut #retry_loop = ::idem::__private::RetryLoop::new(
                #conn,
                #policy,
                ::core::concat!(::core::module_path!(), "::", ::core::stringify!(#name)),
            );
            loop {
                let mut #attempt = match #retry_loop.begin().await {
                    ::core::result::Result::Ok(#attempt) => #attempt,
                    ::core::result::Result::Err(#error) => {
                        return ::core::result::Result::Err(::core::convert::From::from(#error));
                    }
                };
                let #result = {
                    let #conn: &mut ::idem::__private::diesel_async::AsyncPgConnection = #attempt.conn();
                    #(#replays)*
                    #retry_loop
                        .scope(::idem::__private::attempt_body::<#ret, _>(async move #body))
                        .await
                };
                if let ::core::ops::ControlFlow::Break(#outcome) = #finish {
                    return #outcome;
                }
            }
        }
    }
}
