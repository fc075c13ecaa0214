//! Generates the idempotent function: validation, the replay fast path, and
//! the retry loop whose attempts claim, run and record.

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned};

use super::parse::{Idempotent, ModeArg};
use crate::retryable::expand::{attempt_run, function_name, policy, pool_signature, return_type};
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
    let parts = quote!(<#ret as ::idem::__private::ResultParts>);
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
    let body_ran = format_ident!("__idem_body_ran", span = mixed);

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
        Some(expr) => quote!(&(#expr)),
        None => quote!(&()),
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
    let run = attempt_run(shape, &attempt);
    let err_ty = quote_spanned!(ret_span=> #parts::Err);
    let ok_ty = quote!(#parts::Ok);

    let build = quote! {
        let #request = match (|| -> ::core::result::Result<::idem::__private::Request, ::idem::IdempotencyError> {
            let __idem_fields = [#(#fields),*];
            ::idem::__private::Request::new(#config, #operation, #key, #scope, &__idem_fields)
        })() {
            ::core::result::Result::Ok(#request) => #request,
            ::core::result::Result::Err(#error) => {
                return ::core::result::Result::Err(::core::convert::From::from(#error));
            }
        };
    };

    let flow = match parsed.mode {
        ModeArg::Local => quote! {
            if let ::idem::__private::Lookup::Done(#outcome) = #request.lookup::<#ok_ty, #err_ty>(#pool).await {
                return #outcome;
            }
            let mut #retry_loop = ::idem::__private::RetryLoop::new(#pool, #policy, #name);
            loop {
                let mut #attempt = match #retry_loop.begin_deferred().await {
                    ::core::result::Result::Ok(#attempt) => #attempt,
                    ::core::result::Result::Err(#error) => {
                        return ::core::result::Result::Err(::core::convert::From::from(#error));
                    }
                };
                let #result: ::core::result::Result<::core::result::Result<::idem::Idempotent<#ok_ty>, #err_ty>, #err_ty> =
                    #retry_loop.scope(#request.scope_key(async {
                        // A replay commits (nothing was written); a refusal or a
                        // conflict is an error, so the loop rolls back and, for a
                        // conflict, replays the claim.
                        if let ::idem::__private::Lookup::Done(#outcome) = #request.claim_local::<#ok_ty, #err_ty>(&mut #attempt).await {
                            return #outcome.map(::core::result::Result::Ok);
                        }
                        let #outcome = #run;
                        #request.record_local(&mut #attempt, #outcome).map(::core::result::Result::Ok)
                    })).await;
                if let ::core::ops::ControlFlow::Break(#outcome) = #retry_loop.finish(#attempt, #result).await {
                    return match #outcome {
                        ::core::result::Result::Ok(#outcome) => #outcome,
                        ::core::result::Result::Err(#error) => #request.finish_error(#pool, #error).await,
                    };
                }
            }
        },
        ModeArg::External => quote! {
            if let ::idem::__private::Lookup::Done(#outcome) = #request.claim_external::<#ok_ty, #err_ty>(#pool).await {
                return #outcome;
            }
            let mut #body_ran = false;
            let mut #retry_loop = ::idem::__private::RetryLoop::new(#pool, #policy, #name);
            let #outcome: ::core::result::Result<::idem::Idempotent<#ok_ty>, #err_ty> = loop {
                let mut #attempt = match #retry_loop.begin().await {
                    ::core::result::Result::Ok(#attempt) => #attempt,
                    ::core::result::Result::Err(#error) => break ::core::result::Result::Err(::core::convert::From::from(#error)),
                };
                #body_ran = true;
                let #result: ::core::result::Result<::idem::Idempotent<#ok_ty>, #err_ty> =
                    #retry_loop.scope(#request.scope_key(async {
                        match #run {
                            ::core::result::Result::Ok(#outcome) => #request.record_external(&mut #attempt, #outcome),
                            ::core::result::Result::Err(#error) => ::core::result::Result::Err(#error),
                        }
                    })).await;
                if let ::core::ops::ControlFlow::Break(#outcome) = #retry_loop.finish(#attempt, #result).await {
                    break #outcome;
                }
            };
            match #outcome {
                ::core::result::Result::Ok(#outcome) => ::core::result::Result::Ok(#outcome),
                ::core::result::Result::Err(#error) => {
                    ::core::result::Result::Err(#request.settle_failure(#pool, #error, #body_ran).await)
                }
            }
        },
    };

    // The #[retryable] attribute was consumed here, so its import would look
    // unused; name it once.
    let uses_retryable = retryable.map(|path| quote!(#[allow(unused_imports)] use #path as _;));

    quote! {
        #(#attrs)*
        #vis #sig {
            #uses_retryable
            #build
            #flow
        }
    }
}
