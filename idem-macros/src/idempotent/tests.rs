//! What `#[idempotent]` writes, as a reviewer would read it (insta snapshots of
//! the pretty-printed expansion), and how it reports mistakes.
//!
//! Accept changed snapshots with `INSTA_UPDATE=always cargo test -p idem-macros`
//! (or `cargo insta review`), then read the `.snap` files that changed.

use quote::quote;

use super::idempotent;
use crate::test_support::{errors_and_fns, pretty};

#[test]
fn local_mode_over_retryable() {
    let out = idempotent(
        quote!(
            key = cmd.idempotency_key,
            scope = ctx.tenant_id,
            fingerprint(cmd.amount, cmd.currency)
        ),
        quote! {
            /// Creates a payment once per key.
            #[retryable(max = 4, deadline_ms = 800)]
            pub async fn create_payment(
                conn: &mut AsyncPgConnection,
                ctx: &Ctx,
                cmd: &PaymentCmd,
            ) -> Result<Payment, AppError> {
                let payment = insert_payment(conn, ctx, cmd).await?;
                Ok(payment)
            }
        },
    );
    insta::assert_snapshot!(pretty(out));
}

#[test]
fn external_mode_with_derived_key_and_scope_tuple() {
    let out = idempotent(
        quote!(
            mode = external,
            scope = (ctx.tenant_id, ctx.user_id),
            fingerprint(amount, cmd.merchant),
            operation = "payments.charge",
            lease_ms = 5000
        ),
        quote! {
            async fn charge(
                conn: &mut AsyncPgConnection,
                ctx: &Ctx,
                amount: Money,
                cmd: &ChargeCmd,
            ) -> Result<ChargeId, AppError> {
                gateway::charge(&cmd.merchant, &ctx.card).await
            }
        },
    );
    insta::assert_snapshot!(pretty(out));
}

#[test]
fn local_mode_with_a_replay_cache() {
    let out = idempotent(
        quote!(
            key = cmd.idempotency_key,
            scope = ctx.tenant_id,
            fingerprint(cmd.amount),
            cache = &ctx.replay_cache
        ),
        quote! {
            async fn pay(conn: &mut AsyncPgConnection, ctx: &Ctx, cmd: &PaymentCmd) -> Result<i64, AppError> {
                Ok(cmd.amount)
            }
        },
    );
    insta::assert_snapshot!(pretty(out));
}

#[test]
fn a_cache_must_be_an_expression_of_a_cache() {
    let func = quote! {
        async fn pay(conn: &mut AsyncPgConnection, cmd: &PaymentCmd) -> Result<i64, AppError> {
            Ok(cmd.amount)
        }
    };
    let (errors, fns) = errors_and_fns(idempotent(
        quote!(scope = none, cache = "redis://127.0.0.1:6379"),
        func.clone(),
    ));
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0].starts_with("`cache` takes a replay cache, not its address"),
        "{errors:?}"
    );
    assert_eq!(fns.len(), 1, "the fn is kept");
    let (errors, _) = errors_and_fns(idempotent(quote!(scope = none, cache), func));
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0].starts_with("`cache` needs a value: `cache = <expr>`"),
        "{errors:?}"
    );
}

#[test]
fn a_broken_attribute_reports_every_mistake_and_expands_with_defaults() {
    let out = idempotent(
        quote!(
            key = cmd.key,
            scope = none,
            fingerprint(conn, amount, cmd.amount),
            mode = sometimes,
            ttl = 60,
            lease_ms = 0
        ),
        quote! {
            #[retryable(max = 0)]
            async fn pay(conn: &mut AsyncPgConnection, cmd: &PaymentCmd) -> Result<i64, AppError> {
                Ok(cmd.amount)
            }
        },
    );
    let (errors, fns) = errors_and_fns(out);
    assert_eq!(
        errors,
        [
            "`max = 0` would never run the body; the first attempt counts, so use at least 1",
            "`conn` is the connection; fingerprint(..) names the request's parameters or their fields",
            "`amount` is not a parameter of `pay`; fingerprint(..) names parameters or their fields (`cmd`)",
            "`mode` is `local` (every effect is in this database; the default) or `external` (the body calls another system)",
            "unknown key `ttl` in #[idempotent(..)] (did you mean `ttl_s`?); the valid keys are `key`, `scope`, `fingerprint(..)`, `operation`, `mode`, `ttl_s`, `lease_ms`, `wait_ms`, `max_response_bytes`, `config` and `cache`",
            "`lease_ms = 0`: a lease of 0 ms runs out at once, so every external request would be reported as outcome unknown; give a number above 0, e.g. `lease_ms = 30000`",
        ]
    );
    // The function expanded with the default settings: its callers pass a
    // pool, as they will once the attributes are fixed, and see no error.
    assert_eq!(fns.len(), 1, "{errors:?}");
    let func = &fns[0];
    assert_eq!(func.sig.ident, "pay");
    let first = &func.sig.inputs[0];
    assert_eq!(quote!(#first).to_string(), "conn : & :: idem :: Pool");
    // The #[retryable] was taken in; only the stand-in's allow is left.
    let attrs: Vec<String> = func.attrs.iter().map(|a| quote!(#a).to_string()).collect();
    assert_eq!(attrs, ["# [allow (unused_variables)]"]);
}

#[test]
fn the_scope_is_required_and_none_is_said_out_loud() {
    let func = quote! {
        async fn pay(conn: &mut AsyncPgConnection, cmd: &PaymentCmd) -> Result<i64, AppError> {
            Ok(cmd.amount)
        }
    };
    let (errors, fns) = errors_and_fns(idempotent(quote!(key = cmd.key), func.clone()));
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0].contains("`scope = <values>`") && errors[0].contains("`scope = none`"),
        "{errors:?}"
    );
    assert_eq!(fns.len(), 1, "the fn is kept, so its uses do not cascade");
    // `none` is one key space: the empty scope `()`.
    let out = pretty(idempotent(quote!(key = cmd.key, scope = none), func));
    assert!(out.contains("&()"), "{out}");
}

/// The return type's `allow(clippy::type_complexity)` goes only on a function
/// that keeps an attribute macro below (which would re-emit the type as the
/// user's tokens); with only rustc's own attributes, none.
#[test]
fn the_complexity_allow_only_with_a_macro_below() {
    let attrs_of = |below: proc_macro2::TokenStream| {
        let out = idempotent(
            quote!(key = cmd.key, scope = none),
            quote! {
                #[retryable(max = 4, deadline_ms = 800)]
                #below
                async fn pay(conn: &mut AsyncPgConnection, cmd: &PayCmd) -> Result<i64, AppError> {
                    Ok(cmd.amount)
                }
            },
        );
        let (errors, fns) = errors_and_fns(out);
        assert!(errors.is_empty(), "{errors:?}");
        let func = &fns[0];
        func.attrs
            .iter()
            .map(|a| quote!(#a).to_string())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        attrs_of(quote!(#[tracing::instrument(skip(conn))])),
        [
            "# [allow (clippy :: type_complexity)]",
            "# [tracing :: instrument (skip (conn))]"
        ]
    );
    assert_eq!(
        attrs_of(quote!(#[must_use] #[inline])),
        ["# [must_use]", "# [inline]"]
    );
}
