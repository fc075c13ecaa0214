//! Generates the impls for a parsed model or changeset. Reads only the typed
//! description from `parse`; every path into idem is absolute and hidden.

use proc_macro2::{Group, Span, TokenStream, TokenTree};
use quote::{format_ident, quote, quote_spanned};

use super::parse::Field;
use super::validate::{ChangeSet, Model};

pub(crate) fn column(table: &syn::Path, field: &Field) -> TokenStream {
    let column = &field.column;
    quote!(#table::#column)
}

/// `tokens` with every token (and group) at `span`, so that an error about the
/// whole path points at the user's field rather than at the `table_name`
/// attribute the path starts with.
pub(crate) fn respan(tokens: TokenStream, span: Span) -> TokenStream {
    tokens
        .into_iter()
        .map(|token| match token {
            TokenTree::Group(group) => {
                let mut new = Group::new(group.delimiter(), respan(group.stream(), span));
                new.set_span(span);
                TokenTree::Group(new)
            }
            mut other => {
                other.set_span(span);
                other
            }
        })
        .collect()
}

/// `a.eq(x).and(b.eq(y))...` over `(column, value)` pairs, in order. A model
/// always has a key, so there is at least one pair.
pub(crate) fn conjunction(predicates: &[(TokenStream, TokenStream)]) -> TokenStream {
    let mut iter = predicates.iter().map(|(col, val)| quote!(#col.eq(#val)));
    match iter.next() {
        Some(first) => iter.fold(first, |acc, next| quote!(#acc.and(#next))),
        None => quote!(::core::compile_error!(
            "#[derive(Versioned)] found no key column to filter on; please report this to idem"
        )),
    }
}

/// The model's impls; `once` (the create-once impl, from `once.rs`) goes
/// into the same block, under the same trait imports.
pub(crate) fn model(model: &Model, once: TokenStream) -> TokenStream {
    let ident = &model.ident;
    let table = &model.table;
    let version = model.field(model.version);
    let version_ty = &version.ty;
    let version_col = column(table, version);
    let rqd = quote!(::idem::__private::diesel_async::RunQueryDsl);
    let vv = quote!(<#version_ty as ::idem::__private::VersionValue>);
    let conn_ty = quote!(::idem::__private::diesel_async::AsyncPgConnection);
    let derr = quote!(::idem::__private::diesel::result::Error);

    let (tenant_ty, tenant_start) = match model.tenant {
        Some(i) => {
            let ty = &model.field(i).ty;
            (quote!(#ty), quote!(::idem::__private::TenantMissing))
        }
        None => (quote!(()), quote!(::idem::__private::Untenanted)),
    };
    let key_fields: Vec<&Field> = model.key.iter().map(|&i| model.field(i)).collect();
    let key_ty = match key_fields.as_slice() {
        [single] => {
            let ty = &single.ty;
            quote!(#ty)
        }
        many => {
            let tys = many.iter().map(|f| &f.ty);
            quote!((#(#tys,)*))
        }
    };
    // Destructure the key into one binding per column.
    let key_bindings: Vec<syn::Ident> = (0..key_fields.len())
        .map(|i| format_ident!("__idem_key{}", i))
        .collect();
    let key_pattern = match key_bindings.as_slice() {
        [single] => quote!(#single),
        many => quote!((#(#many,)*)),
    };
    let state = model.state.map(|i| model.field(i));
    let state_ty = match state {
        Some(f) => {
            let ty = &f.ty;
            quote!(#ty)
        }
        None => quote!(::idem::NoState),
    };

    // The row predicates every statement carries: tenant (unless none), then key.
    let mut row_preds: Vec<(TokenStream, TokenStream)> = Vec::new();
    if let Some(i) = model.tenant {
        row_preds.push((column(table, model.field(i)), quote!(__idem_tenant)));
    }
    for (field, binding) in key_fields.iter().zip(&key_bindings) {
        row_preds.push((column(table, field), quote!(#binding)));
    }
    let row_filter = conjunction(&row_preds);
    let identity_cols = row_preds.iter().map(|(col, _)| col);
    // Each identity value bound with its column's SQL type, as the filter
    // binds it.
    let identity_binds = row_preds.iter().map(|(col, value)| {
        quote! {
            ::idem::__private::diesel::expression::AsExpression::<
                <#col as ::idem::__private::diesel::Expression>::SqlType,
            >::as_expression(#value)
        }
    });
    let mut cas_preds = row_preds.clone();
    cas_preds.push((version_col.clone(), quote!(__idem_expected)));
    let cas_filter = conjunction(&cas_preds);
    let bind_row = quote! {
        let __idem_tenant = __idem_tenant;
        let #key_pattern = __idem_key;
    };

    let probe_select = match state {
        Some(f) => {
            let col = column(table, f);
            quote! {
                let __idem_found: ::core::option::Option<(#version_ty, #state_ty)> = #rqd::get_result(
                    #table::table.filter(#row_filter).select((#version_col, #col)),
                    conn,
                ).await.optional()?;
                ::core::result::Result::Ok(__idem_found.map(|(v, s)| (#vv::to_i64(v), ::core::option::Option::Some(s))))
            }
        }
        None => quote! {
            let __idem_found: ::core::option::Option<#version_ty> = #rqd::get_result(
                #table::table.filter(#row_filter).select(#version_col),
                conn,
            ).await.optional()?;
            ::core::result::Result::Ok(__idem_found.map(|v| (#vv::to_i64(v), ::core::option::Option::None)))
        },
    };
    let state_filter_update = match state {
        Some(f) => {
            let col = column(table, f);
            quote! {
                ::core::option::Option::Some(__idem_state) => {
                    let __idem_query = ::idem::__private::CasUpdate::new(
                        #table::table, changes.__changeset(), __idem_version_name,
                        __idem_filter.and(#col.eq(__idem_state)), Self::as_select(),
                    );
                    #rqd::get_result(__idem_query, conn).await.optional()
                }
            }
        }
        None => quote! {
            ::core::option::Option::Some(__idem_never) => match __idem_never {},
        },
    };

    // A transition: the state assigned after the changeset's columns, and
    // required to be `from` besides the version.
    let (transition_update, state_of_row) = match state {
        Some(f) => {
            let col = column(table, f);
            let name = &f.ident;
            (
                quote! {
                    async move {
                        // The record of the transition names the row too.
                        let __idem_identity = <Self as ::idem::Versioned>::__identity(
                            ::core::clone::Clone::clone(&__idem_tenant),
                            ::core::clone::Clone::clone(&__idem_key),
                        );
                        #bind_row
                        let ::core::option::Option::Some(__idem_expected) = #vv::from_i64(__idem_expected) else {
                            return ::core::result::Result::Ok(::core::option::Option::None);
                        };
                        let __idem_query = ::idem::__private::RecordedTransition::new(
                            ::idem::__private::CasUpdate::new(
                                #table::table,
                                (changes.__changeset(), ::idem::__private::diesel::query_builder::AsChangeset::as_changeset(#col.eq(__idem_to))),
                                <Self as ::idem::Versioned>::VERSION_COLUMN,
                                #cas_filter.and(#col.eq(__idem_from)),
                                ::idem::__private::TransitionRecord::returning(Self::as_select()),
                            ),
                            __idem_identity,
                            record,
                        );
                        #rqd::get_result(__idem_query, conn).await.optional()
                    }
                },
                quote!(::core::option::Option::Some(::core::clone::Clone::clone(&self.#name))),
            )
        }
        None => (
            quote! {
                let _ = (conn, __idem_tenant, __idem_key, __idem_expected, __idem_to, record, changes);
                async move { match __idem_from {} }
            },
            quote!(::core::option::Option::None),
        ),
    };

    let insert_values = insert_values(model);
    let version_ident = &version.ident;

    // Every column a changeset may assign: all but version, tenant and key.
    let protected: Vec<usize> = model
        .tenant
        .into_iter()
        .chain(Some(model.version))
        .chain(model.key.iter().copied())
        .collect();
    let assignable = model
        .fields
        .iter()
        .enumerate()
        .filter(|(i, _)| !protected.contains(i))
        .map(|(_, f)| {
            let col = column(table, f);
            quote!(impl ::idem::__private::Assignable<#ident> for #col {})
        });
    quote! {
        const _: () = {
            use ::idem::__private::diesel::{BoolExpressionMethods as _, ExpressionMethods as _, OptionalExtension as _, QueryDsl as _, SelectableHelper as _};

            #[automatically_derived]
            impl ::idem::Versioned for #ident {
                type Tenant = #tenant_ty;
                type Key = #key_ty;
                type State = #state_ty;
                type TenantStart = #tenant_start;

                fn table_sql() -> ::std::string::String {
                    ::idem::__private::table_sql(#table::table)
                }
                const VERSION_COLUMN: &'static str = <#version_col as ::idem::__private::diesel::Column>::NAME;
                const IDENTITY_COLUMNS: &'static [&'static str] = &[#(<#identity_cols as ::idem::__private::diesel::Column>::NAME,)*];

                // `#vv` carries the span of the version field's type, so a type
                // that is not an integer is reported once, at that type.
                fn version(&self) -> i64 {
                    #vv::to_i64(self.#version_ident)
                }

                fn __insert<'c>(&'c self, conn: &'c mut #conn_ty)
                    -> impl ::core::future::Future<Output = ::core::result::Result<Self, #derr>> + ::core::marker::Send + 'c
                {
                    async move {
                        #rqd::get_result(
                            ::idem::__private::diesel::insert_into(#table::table)
                                .values((#(#insert_values,)*))
                                .returning(Self::as_select()),
                            conn,
                        ).await
                    }
                }

                fn __load<'c>(conn: &'c mut #conn_ty, __idem_tenant: Self::Tenant, __idem_key: Self::Key, for_update: bool)
                    -> impl ::core::future::Future<Output = ::core::result::Result<::core::option::Option<Self>, #derr>> + ::core::marker::Send + 'c
                {
                    async move {
                        #bind_row
                        let __idem_query = #table::table.filter(#row_filter).select(Self::as_select());
                        if for_update {
                            #rqd::get_result(__idem_query.for_update(), conn).await.optional()
                        } else {
                            #rqd::get_result(__idem_query, conn).await.optional()
                        }
                    }
                }

                fn __probe<'c>(conn: &'c mut #conn_ty, __idem_tenant: Self::Tenant, __idem_key: Self::Key)
                    -> impl ::core::future::Future<Output = ::core::result::Result<::core::option::Option<(i64, ::core::option::Option<Self::State>)>, #derr>> + ::core::marker::Send + 'c
                {
                    async move {
                        #bind_row
                        #probe_select
                    }
                }

                fn __update<'c, C: ::idem::VersionedChanges<Self> + ::core::marker::Sync>(
                    conn: &'c mut #conn_ty,
                    __idem_tenant: Self::Tenant,
                    __idem_key: Self::Key,
                    __idem_expected: i64,
                    __idem_from_state: ::core::option::Option<Self::State>,
                    changes: &'c C,
                ) -> impl ::core::future::Future<Output = ::core::result::Result<::core::option::Option<Self>, #derr>> + ::core::marker::Send + 'c
                {
                    async move {
                        #bind_row
                        // An expected version the column cannot hold matches no row.
                        let ::core::option::Option::Some(__idem_expected) = <#version_ty as ::idem::__private::VersionValue>::from_i64(__idem_expected) else {
                            return ::core::result::Result::Ok(::core::option::Option::None);
                        };
                        let __idem_version_name = <Self as ::idem::Versioned>::VERSION_COLUMN;
                        let __idem_filter = #cas_filter;
                        match __idem_from_state {
                            ::core::option::Option::None => {
                                let __idem_query = ::idem::__private::CasUpdate::new(
                                    #table::table, changes.__changeset(), __idem_version_name, __idem_filter, Self::as_select(),
                                );
                                #rqd::get_result(__idem_query, conn).await.optional()
                            }
                            #state_filter_update
                        }
                    }
                }

                fn __transition<'c, C: ::idem::VersionedChanges<Self> + ::core::marker::Sync>(
                    conn: &'c mut #conn_ty,
                    __idem_tenant: Self::Tenant,
                    __idem_key: Self::Key,
                    __idem_expected: i64,
                    __idem_from: Self::State,
                    __idem_to: Self::State,
                    record: &'c ::idem::__private::TransitionRecord,
                    changes: &'c C,
                ) -> impl ::core::future::Future<Output = ::core::result::Result<::core::option::Option<Self>, #derr>> + ::core::marker::Send + 'c
                {
                    #transition_update
                }

                fn __load_made<'c>(conn: &'c mut #conn_ty, __idem_tenant: Self::Tenant, __idem_key: Self::Key, record: &'c ::idem::__private::TransitionRecord)
                    -> impl ::core::future::Future<Output = ::core::result::Result<::core::option::Option<(Self, ::core::primitive::bool)>, #derr>> + ::core::marker::Send + 'c
                {
                    async move {
                        // The record names the row by its identity; the read
                        // gives the row, and whether the record was written
                        // with the row version it returns.
                        let __idem_made = record.made(
                            #table::table,
                            <Self as ::idem::Versioned>::__identity(
                                ::core::clone::Clone::clone(&__idem_tenant),
                                ::core::clone::Clone::clone(&__idem_key),
                            ),
                        );
                        #bind_row
                        #rqd::get_result(
                            #table::table.filter(#row_filter).select((Self::as_select(), __idem_made)),
                            conn,
                        ).await.optional()
                    }
                }

                fn __identity(__idem_tenant: Self::Tenant, __idem_key: Self::Key)
                    -> impl ::idem::__private::diesel::query_builder::QueryFragment<::idem::__private::diesel::pg::Pg> + ::core::marker::Send + ::core::marker::Sync
                {
                    #bind_row
                    ::idem::__private::JsonbArray((#(#identity_binds,)*))
                }

                fn __state(&self) -> ::core::option::Option<Self::State> {
                    #state_of_row
                }

                fn __delete<'c>(conn: &'c mut #conn_ty, __idem_tenant: Self::Tenant, __idem_key: Self::Key, __idem_expected: i64)
                    -> impl ::core::future::Future<Output = ::core::result::Result<usize, #derr>> + ::core::marker::Send + 'c
                {
                    async move {
                        #bind_row
                        let ::core::option::Option::Some(__idem_expected) = <#version_ty as ::idem::__private::VersionValue>::from_i64(__idem_expected) else {
                            return ::core::result::Result::Ok(0);
                        };
                        #rqd::execute(::idem::__private::diesel::delete(#table::table.filter(#cas_filter)), conn).await
                    }
                }
            }

            #(#assignable)*

            #once
        };
    }
}

/// `column.eq(&self.field)` for every field, the version at zero: the values
/// of a new row.
pub(crate) fn insert_values(model: &Model) -> Vec<TokenStream> {
    let version_ty = &model.field(model.version).ty;
    insert_values_with(
        model,
        quote!(<#version_ty as ::idem::__private::VersionValue>::ZERO),
    )
}

/// The values of a new row, the version written as `version`.
pub(crate) fn insert_values_with(model: &Model, version: TokenStream) -> Vec<TokenStream> {
    let version_field = model.field(model.version);
    model
        .fields
        .iter()
        .map(|f| {
            let col = column(&model.table, f);
            if std::ptr::eq(f, version_field) {
                quote!(#col.eq(#version))
            } else {
                let name = &f.ident;
                quote!(#col.eq(&self.#name))
            }
        })
        .collect()
}

pub(crate) fn changes(changes: &ChangeSet) -> TokenStream {
    let ident = &changes.ident;
    let model = &changes.model;
    let table = &changes.table;
    let (impl_generics, ty_generics, where_clause) = changes.generics.split_for_impl();
    let assignments = changes.fields.iter().map(|f| {
        let col = column(table, f);
        let name = &f.ident;
        quote!(#col.eq(&self.#name))
    });
    let checks = changes.fields.iter().map(|f| {
        let col = respan(column(table, f), f.ident.span());
        quote_spanned! {f.ident.span()=>
            ::idem::__private::assert_assignable::<#model, #col>();
        }
    });
    // The bypass guard: both impls carry a bound nothing satisfies. The bound
    // names the implementing type itself, so rustc's help reads "not implemented
    // for `&Edit`" / "for `Edit`"; the owned impl needs a binder to keep rustc
    // from rejecting a bound without generics as trivially false.
    let guard = quote!(::idem::__private::BypassesVersionCheck);
    let mut ref_generics = changes.generics.clone();
    ref_generics.params.insert(0, syn::parse_quote!('__idem_r));
    ref_generics
        .make_where_clause()
        .predicates
        .push(syn::parse_quote!(for<'__idem_x> #ident #ty_generics: #guard));
    let (ref_impl, _, ref_where) = ref_generics.split_for_impl();
    let mut owned_generics = changes.generics.clone();
    owned_generics
        .make_where_clause()
        .predicates
        .push(syn::parse_quote!(for<'__idem_x> #ident #ty_generics: #guard));
    let (_, _, owned_where) = owned_generics.split_for_impl();

    // Spanned at the struct rather than at the derive: rustc then does not tell
    // the user to "consider manually implementing `AsChangeset`", the one fix
    // that would defeat the guard.
    let guard_impls = quote_spanned! {ident.span()=>
        #[automatically_derived]
        impl #ref_impl ::idem::__private::diesel::query_builder::AsChangeset for &'__idem_r #ident #ty_generics #ref_where {
            type Target = #table::table;
            type Changeset = ();
            fn as_changeset(self) {}
        }
        #[automatically_derived]
        impl #impl_generics ::idem::__private::diesel::query_builder::AsChangeset for #ident #ty_generics #owned_where {
            type Target = #table::table;
            type Changeset = ();
            fn as_changeset(self) {}
        }
    };

    quote! {
        const _: () = {
            use ::idem::__private::diesel::ExpressionMethods as _;

            #[automatically_derived]
            impl #impl_generics ::idem::VersionedChanges<#model> for #ident #ty_generics #where_clause {
                fn __changeset(&self) -> impl ::idem::__private::diesel::query_builder::QueryFragment<::idem::__private::diesel::pg::Pg> + ::core::marker::Send + ::core::marker::Sync + '_ {
                    ::idem::__private::diesel::query_builder::AsChangeset::as_changeset((#(#assignments,)*))
                }
            }

            // Never called: it only asks the compiler whether each field may be assigned.
            #[allow(dead_code)]
            fn __idem_check_fields() {
                #(#checks)*
            }

            // A versioned changeset must not be usable as a plain diesel changeset:
            // these impls exist only so that `diesel::update(..).set(..)` fails with
            // the guard's message instead of a bare "AsChangeset is not implemented".
            #guard_impls
        };
    }
}
