//! What `#[retryable]` writes, as a reviewer would read it (insta snapshots of
//! the pretty-printed expansion), and how it reports mistakes.
//!
//! Accept changed snapshots with `INSTA_UPDATE=always cargo test -p idem-macros`
//! (or `cargo insta review`), then read the `.snap` files that changed.

use quote::quote;

use super::retryable;
use crate::test_support::{errors_and_fns, pretty};

#[test]
fn free_fn_with_every_setting_kind() {
    let out = retryable(
        quote!(
            max = 5,
            deadline_ms = 1200,
            isolation = serializable,
            on_conflict = lock
        ),
        quote! {
            /// Moves money.
            pub async fn transfer(
                conn: &mut AsyncPgConnection,
                amount: Amount,
                cmd: &Transfer,
            ) -> Result<Receipt, AppError> {
                let receipt = debit(conn, &cmd.from, amount.clone()).await?;
                credit(conn, &cmd.to, amount).await?;
                Ok(receipt)
            }
        },
    );
    insta::assert_snapshot!(pretty(out));
}

#[test]
fn method_on_shared_self_with_generics() {
    let out = retryable(
        quote!(),
        quote! {
            async fn load<'a, K>(&self, conn: &mut diesel_async::AsyncPgConnection, key: &'a K) -> AppResult<Row>
            where
                K: AsRef<str> + ?Sized,
            {
                self.table.find(conn, key.as_ref()).await
            }
        },
    );
    insta::assert_snapshot!(pretty(out));
}

#[test]
fn above_idempotent_lets_it_run_first() {
    let out = retryable(
        quote!(max = 3),
        quote! {
            #[idem::idempotent(key = cmd.key, fingerprint(cmd.amount))]
            #[tracing::instrument(skip_all)]
            async fn pay(conn: &mut AsyncPgConnection, cmd: &PaymentCmd) -> Result<i64, AppError> {
                Ok(cmd.amount)
            }
        },
    );
    insta::assert_snapshot!(pretty(out));
}

#[test]
fn a_broken_attribute_reports_every_mistake_and_keeps_the_fn() {
    let out = retryable(
        quote!(max = 0, isolation = snapshot, colour = blue, max = 2),
        quote! {
            fn transfer(conn: &mut AsyncPgConnection, log: &mut Vec<String>) -> Result<(), AppError> {
                Ok(())
            }
        },
    );
    let (errors, fns) = errors_and_fns(out);
    let fns: Vec<String> = fns.iter().map(|f| f.sig.ident.to_string()).collect();
    assert_eq!(
        errors,
        [
            "`max = 0` would never run the body; the first attempt counts, so use at least 1",
            "`isolation` is one of `read_committed` (the default), `repeatable_read` or `serializable`",
            "unknown key `colour` in #[retryable(..)]; the valid keys are `max`, `deadline_ms`, `backoff_base_ms`, `backoff_cap_ms`, `isolation`, `on_conflict`, `retry_lock_not_available`, `commit_timeout_ms`, `hot_row_memory_ms` and `policy`",
            "`max` is given twice; keep one (it was first given as `max = 0`)",
            "#[retryable] needs an `async fn`: each attempt awaits the database",
            "a #[retryable] body is replayed on every attempt, and a `&mut` argument would carry one attempt's changes into the next; take it by value (Clone) or by shared reference",
        ]
    );
    assert_eq!(fns, ["transfer"]);
}

/// A function #[retryable] or #[idempotent] already expanded is told by its
/// `&::idem::Pool` and the macro's own names; a user's own `&::idem::Pool`
/// parameter is not mistaken for one (it gets the connection error).
#[test]
fn an_expanded_function_is_told_by_its_maker() {
    use crate::attrs::{made_by, Maker};
    let written = quote! {
        async fn pay(conn: &mut AsyncPgConnection, cmd: &Cmd) -> Result<i64, AppError> {
            Ok(cmd.amount)
        }
    };
    let by_retryable: syn::ItemFn =
        syn::parse2(retryable(quote!(max = 3), written.clone())).unwrap();
    assert_eq!(made_by(&by_retryable), Some(Maker::Retryable));
    let by_idempotent: syn::ItemFn = syn::parse2(crate::idempotent::idempotent(
        quote!(key = cmd.key, scope = "s", fingerprint(cmd.amount)),
        written.clone(),
    ))
    .unwrap();
    assert_eq!(made_by(&by_idempotent), Some(Maker::Idempotent));
    let own: syn::ItemFn = syn::parse2(quote! {
        async fn pay(pool: &::idem::Pool, cmd: &Cmd) -> Result<i64, AppError> {
            Ok(cmd.amount)
        }
    })
    .unwrap();
    assert_eq!(made_by(&own), None);
    // Nor one with a name of the macros' own kind in it.
    let own_names: syn::ItemFn = syn::parse2(quote! {
        async fn pay(pool: &::idem::Pool, cmd: &Cmd) -> Result<i64, AppError> {
            let __idem_total = cmd.amount;
            Ok(__idem_total)
        }
    })
    .unwrap();
    assert_eq!(made_by(&own_names), None);
    let (errors, _) = errors_and_fns(retryable(quote!(max = 3), quote!(#own)));
    assert_eq!(errors.len(), 1);
    assert!(
        errors[0]
            .starts_with("the first parameter of a #[retryable] fn is the attempt's connection"),
        "{errors:?}"
    );
}

/// The same for a method: the pool comes after `&self`.
#[test]
fn an_expanded_method_is_told_by_its_maker() {
    use crate::attrs::{made_by, Maker};
    let method: syn::ItemFn = syn::parse2(retryable(
        quote!(max = 3),
        quote! {
            async fn pay(&self, conn: &mut AsyncPgConnection) -> Result<i64, AppError> {
                Ok(1)
            }
        },
    ))
    .unwrap();
    assert_eq!(made_by(&method), Some(Maker::Retryable));
}
