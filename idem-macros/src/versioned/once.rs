//! Generates `CreateOnceModel` for a model that declares
//! `create_once(key = .., fingerprint(..))`: the statements
//! `Versioned::create_once` runs. Nothing for a model without it.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};

use super::expand::{column, conjunction, insert_values_with};
use super::validate::Model;

pub(crate) fn expand(model: &Model) -> TokenStream {
    let Some(once) = &model.once else {
        return TokenStream::new();
    };
    let ident = &model.ident;
    let table = &model.table;
    let private = quote!(::idem::__private);
    let rqd = quote!(#private::diesel_async::RunQueryDsl);
    let conn_ty = quote!(&'c mut #private::diesel_async::AsyncPgConnection);
    let derr = quote!(#private::diesel::result::Error);

    // The tenant, then the key: the unique index the insert relies on, and
    // the row a conflict reads.
    let identity: Vec<usize> = model
        .tenant
        .into_iter()
        .chain(once.key.iter().copied())
        .collect();
    let identity_cols: Vec<TokenStream> = identity
        .iter()
        .map(|&i| column(table, model.field(i)))
        .collect();
    let filter = conjunction(
        &identity
            .iter()
            .zip(&identity_cols)
            .map(|(&i, col)| {
                let name = &model.field(i).ident;
                (col.clone(), quote!(&self.#name))
            })
            .collect::<Vec<_>>(),
    );
    let null_checks = identity.iter().map(|&i| {
        let name = &model.field(i).ident;
        quote!(|| (&&#private::OnceKeyProbe(&self.#name)).__idem_is_null())
    });
    let field_names = once
        .fingerprint
        .iter()
        .map(|&i| model.field(i).ident.to_string());
    // The version is 0 through the guard that refuses a table without the
    // key's unique index (evaluated when PostgreSQL plans the statement).
    let version_col = column(table, model.field(model.version));
    let insert_values = insert_values_with(model, quote!(__idem_guard));

    // One flag per fingerprint field, compared in SQL (so by the column's own
    // equality), NULL equal to NULL.
    let read = if once.fingerprint.is_empty() {
        quote! {
            let __idem_found: ::core::option::Option<Self> = #rqd::get_result(
                #table::table.filter(#filter).select(Self::as_select()),
                conn,
            ).await.optional()?;
            ::core::result::Result::Ok(__idem_found.map(|row| (row, ::std::vec::Vec::new())))
        }
    } else {
        let same = once.fingerprint.iter().map(|&i| {
            let f = model.field(i);
            let col = column(table, f);
            let name = &f.ident;
            quote!(#private::diesel::PgExpressionMethods::is_not_distinct_from(#col, &self.#name))
        });
        let flags: Vec<syn::Ident> = (0..once.fingerprint.len())
            .map(|n| quote::format_ident!("__idem_same{}", n))
            .collect();
        let flag_tys = flags.iter().map(|_| quote!(::core::primitive::bool));
        quote! {
            let __idem_found: ::core::option::Option<(Self, (#(#flag_tys,)*))> = #rqd::get_result(
                #table::table.filter(#filter).select((Self::as_select(), (#(#same,)*))),
                conn,
            ).await.optional()?;
            ::core::result::Result::Ok(__idem_found.map(|(row, (#(#flags,)*))| (row, ::std::vec![#(#flags),*])))
        }
    };

    // Each fingerprint column's SQL type must have `=`, asked at the
    // user's name for it (json has none: every repeat would fail).
    let comparable = once
        .fingerprint
        .iter()
        .zip(&once.fingerprint_names)
        .map(|(&i, name)| {
            let col = super::expand::respan(column(table, model.field(i)), name.span());
            quote_spanned! {name.span()=>
                #private::assert_sql_equality::<<#col as #private::diesel::Expression>::SqlType>();
            }
        });
    quote! {
        // Never called: it only asks the compiler about the fingerprint's types.
        #[allow(dead_code)]
        fn __idem_check_fingerprint() {
            #(#comparable)*
        }

        #[automatically_derived]
        impl #private::CreateOnceModel for #ident {
            const ONCE_COLUMNS: &'static [&'static str] = &[#(<#identity_cols as #private::diesel::Column>::NAME,)*];
            const ONCE_FIELDS: &'static [&'static str] = &[#(#field_names,)*];

            // `&&` picks the `Option` impl where the field is one.
            #[allow(clippy::needless_borrow)]
            fn __once_key_missing(&self) -> bool {
                use #private::{OnceKeyNull as _, OnceKeyValue as _};
                false #(#null_checks)*
            }

            fn __once_insert<'c>(&'c self, conn: #conn_ty)
                -> impl ::core::future::Future<Output = ::core::result::Result<::core::option::Option<Self>, #derr>> + ::core::marker::Send + 'c
            {
                async move {
                    static __IDEM_GUARD: ::std::sync::OnceLock<::std::string::String> = ::std::sync::OnceLock::new();
                    let __idem_guard = #private::OnceGuard::<Self, <#version_col as #private::diesel::Expression>::SqlType>::new(
                        __IDEM_GUARD.get_or_init(|| #private::create_once_guard_sql(
                            &<Self as ::idem::Versioned>::table_sql(),
                            <Self as #private::CreateOnceModel>::ONCE_COLUMNS,
                        )),
                    );
                    // No conflict target: every unique index is an arbiter,
                    // so a racer meeting the winner on another unique column
                    // waits and writes nothing rather than failing.
                    #rqd::get_result(
                        #private::diesel::insert_into(#table::table)
                            .values((#(#insert_values,)*))
                            .on_conflict_do_nothing()
                            .returning(Self::as_select()),
                        conn,
                    ).await.optional()
                }
            }

            fn __once_read<'c>(&'c self, conn: #conn_ty)
                -> impl ::core::future::Future<Output = ::core::result::Result<::core::option::Option<(Self, ::std::vec::Vec<::core::primitive::bool>)>, #derr>> + ::core::marker::Send + 'c
            {
                async move { #read }
            }
        }
    }
}
