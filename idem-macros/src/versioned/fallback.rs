//! What a derive whose input has mistakes emits next to its errors: the impls
//! the rest of the crate expects, with bodies that can never run (the crate
//! does not compile), so that one mistake gives one error rather than a
//! cascade at every `Model::find(..)`, `Model::update(..)` and changeset.
//!
//! Each associated type is the one the model declares where validation could
//! tell it. Where it could not (the key names no field, the tenant is missing),
//! the type is `[(); <the first error>]`: the `compile_error!` is reported once
//! where the user made the mistake, and rustc stays silent about anything its
//! erroneous length touches, as it does after any type error.

use proc_macro2::TokenStream;
use quote::{quote, ToTokens};

use super::expand::column;
use super::parse::{ChangesInput, Field, ModelInput, TenantArg};
use super::validate::{Roles, Tenant};

/// The impl of `idem::Versioned` (and the `Assignable` marks) for a model that
/// could not be expanded, after the errors `err` holds.
pub(crate) fn model(input: &ModelInput, roles: &Roles, err: syn::Error) -> TokenStream {
    let ident = &input.ident;
    let generic = !input.generics.params.is_empty();
    // A generic model's field types may name its parameters, which the
    // associated types cannot; they stay unresolved.
    let fields: &[Field] = match &input.fields {
        Some(fields) if !generic => fields,
        _ => &[],
    };
    let mut types = Types {
        fields,
        unresolved: false,
    };

    let private = quote!(::idem::__private);
    let (tenant_ty, tenant_start) = match roles.tenant {
        Some(Tenant::None) => (quote!(()), quote!(#private::Untenanted)),
        Some(Tenant::Field(i)) => (types.field(i), quote!(#private::TenantMissing)),
        // A named but misspelt tenant: the builders still ask for `.tenant(..)`.
        None if matches!(
            input.tenant.as_ref().map(|t| &t.value),
            Some(TenantArg::Field(_))
        ) =>
        {
            (types.unknown(), quote!(#private::TenantMissing))
        }
        // No tenant at all: whether the builders want one is unknown too.
        None => (types.unknown(), types.unknown()),
    };
    let key_ty = match roles.key.as_deref() {
        Some([single]) => types.field(*single),
        Some(many) if !many.is_empty() => {
            let tys: Vec<TokenStream> = many.iter().map(|&i| types.field(i)).collect();
            quote!((#(#tys,)*))
        }
        _ => types.unknown(),
    };
    let state_ty = match roles.state {
        Some(None) => quote!(::idem::NoState),
        Some(Some(i)) => types.field(i),
        None => types.unknown(),
    };

    let mut errors = err.into_iter();
    let unresolved = match (types.unresolved, errors.next()) {
        (true, Some(first)) => {
            let first = first.to_compile_error();
            quote!(type __IdemUnresolved = [(); #first];)
        }
        (_, first) => first.map(|e| e.to_compile_error()).unwrap_or_default(),
    };
    let errors = errors.map(|e| e.to_compile_error());

    let mut generics = input.generics.clone();
    if generic {
        let (_, ty_generics, _) = input.generics.split_for_impl();
        // The supertraits, as a bound the impl may assume (a bound without the
        // impl's parameters would be rejected as trivially false).
        generics.make_where_clause().predicates.push(syn::parse_quote!(
            for<'__idem_w> #ident #ty_generics: ::core::marker::Send + ::core::marker::Sync + 'static
        ));
    }
    let (impl_generics, ty_generics, where_clause) = generics.split_for_impl();
    let assignable = if generic {
        Vec::new()
    } else {
        assignable(input, roles)
    };

    let conn = quote!(&'c mut #private::diesel_async::AsyncPgConnection);
    let derr = quote!(#private::diesel::result::Error);
    let future = |output: TokenStream| quote!(impl ::core::future::Future<Output = ::core::result::Result<#output, #derr>> + ::core::marker::Send + 'c);
    let (row, rows, probe, count) = (
        future(quote!(Self)),
        future(quote!(::core::option::Option<Self>)),
        future(quote!(
            ::core::option::Option<(i64, ::core::option::Option<Self::State>)>
        )),
        future(quote!(usize)),
    );
    let once = once(input, generic);
    let made = future(quote!(
        ::core::option::Option<(Self, ::core::primitive::bool)>
    ));
    quote! {
        const _: () = {
            #unresolved

            #[allow(unused_qualifications)]
            #[automatically_derived]
            impl #impl_generics ::idem::Versioned for #ident #ty_generics #where_clause {
                type Tenant = #tenant_ty;
                type Key = #key_ty;
                type State = #state_ty;
                type TenantStart = #tenant_start;

                fn table_sql() -> ::std::string::String {
                    ::core::unreachable!()
                }
                const VERSION_COLUMN: &'static str = "";
                const IDENTITY_COLUMNS: &'static [&'static str] = &[];
                fn version(&self) -> i64 {
                    ::core::unreachable!()
                }
                fn __insert<'c>(&'c self, _: #conn) -> #row {
                    async move { ::core::unreachable!() }
                }
                fn __load<'c>(_: #conn, _: Self::Tenant, _: Self::Key, _: bool) -> #rows {
                    async move { ::core::unreachable!() }
                }
                fn __probe<'c>(_: #conn, _: Self::Tenant, _: Self::Key) -> #probe {
                    async move { ::core::unreachable!() }
                }
                fn __update<'c, C: ::idem::VersionedChanges<Self> + ::core::marker::Sync>(
                    _: #conn, _: Self::Tenant, _: Self::Key, _: i64,
                    _: ::core::option::Option<Self::State>, _: &'c C,
                ) -> #rows {
                    async move { ::core::unreachable!() }
                }
                fn __transition<'c, C: ::idem::VersionedChanges<Self> + ::core::marker::Sync>(
                    _: #conn, _: Self::Tenant, _: Self::Key, _: i64,
                    _: Self::State, _: Self::State, _: &'c ::idem::__private::TransitionRecord, _: &'c C,
                ) -> #rows {
                    async move { ::core::unreachable!() }
                }
                fn __load_made<'c>(_: #conn, _: Self::Tenant, _: Self::Key, _: &'c ::idem::__private::TransitionRecord) -> #made {
                    async move { ::core::unreachable!() }
                }
                fn __identity(_: Self::Tenant, _: Self::Key)
                    -> impl ::idem::__private::diesel::query_builder::QueryFragment<::idem::__private::diesel::pg::Pg> + ::core::marker::Send + ::core::marker::Sync
                {}
                fn __state(&self) -> ::core::option::Option<Self::State> {
                    ::core::unreachable!()
                }
                fn __delete<'c>(_: #conn, _: Self::Tenant, _: Self::Key, _: i64) -> #count {
                    async move { ::core::unreachable!() }
                }
            }

            #(#assignable)*

            #once
        };
        #(#errors)*
    }
}

/// A `create_once(..)` that was declared is implemented too, so a call of
/// `create_once` adds no error of its own.
fn once(input: &ModelInput, generic: bool) -> TokenStream {
    if input.create_once.is_none() || generic {
        return TokenStream::new();
    }
    let ident = &input.ident;
    let private = quote!(::idem::__private);
    let conn = quote!(&'c mut #private::diesel_async::AsyncPgConnection);
    let derr = quote!(#private::diesel::result::Error);
    let future = |output: TokenStream| quote!(impl ::core::future::Future<Output = ::core::result::Result<#output, #derr>> + ::core::marker::Send + 'c);
    let inserted = future(quote!(::core::option::Option<Self>));
    let read = future(quote!(
        ::core::option::Option<(Self, ::std::vec::Vec<::core::primitive::bool>)>
    ));
    quote! {
        #[allow(unused_qualifications)]
        #[automatically_derived]
        impl #private::CreateOnceModel for #ident {
            const ONCE_COLUMNS: &'static [&'static str] = &[];
            const ONCE_FIELDS: &'static [&'static str] = &[];
            fn __once_key_missing(&self) -> bool {
                ::core::unreachable!()
            }
            fn __once_insert<'c>(&'c self, _: #conn) -> #inserted {
                async move { ::core::unreachable!() }
            }
            fn __once_read<'c>(&'c self, _: #conn) -> #read {
                async move { ::core::unreachable!() }
            }
        }
    }
}

/// The associated types as far as they are known.
struct Types<'a> {
    fields: &'a [Field],
    /// Whether some type is `__IdemUnresolved`.
    unresolved: bool,
}

impl Types<'_> {
    fn field(&mut self, index: usize) -> TokenStream {
        match self.fields.get(index) {
            Some(field) => field.ty.to_token_stream(),
            None => self.unknown(),
        }
    }

    fn unknown(&mut self) -> TokenStream {
        self.unresolved = true;
        quote!(__IdemUnresolved)
    }
}

/// Every column but the known version, tenant and key may be assigned, so that
/// a changeset of the broken model adds no error of its own.
fn assignable(input: &ModelInput, roles: &Roles) -> Vec<TokenStream> {
    let Some(fields) = &input.fields else {
        return Vec::new();
    };
    let ident = &input.ident;
    let mut protected: Vec<usize> = roles.key.iter().flatten().copied().collect();
    protected.extend(roles.version);
    if let Some(Tenant::Field(i)) = roles.tenant {
        protected.push(i);
    }
    fields
        .iter()
        .enumerate()
        .filter(|(i, _)| !protected.contains(i))
        .map(|(_, f)| {
            let col = column(&input.table, f);
            quote!(impl ::idem::__private::Assignable<#ident> for #col {})
        })
        .collect()
}

/// The impl of `idem::VersionedChanges` for a changeset that could not be
/// expanded, when it names its model; otherwise only the errors.
pub(crate) fn changes(input: &ChangesInput, err: syn::Error) -> TokenStream {
    let errors = err.to_compile_error();
    let Some(model) = &input.model else {
        return errors;
    };
    let ident = &input.ident;
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    quote! {
        #errors
        #[allow(unused_qualifications)]
        #[automatically_derived]
        impl #impl_generics ::idem::VersionedChanges<#model> for #ident #ty_generics #where_clause {
            fn __changeset(&self) -> impl ::idem::__private::diesel::query_builder::QueryFragment<::idem::__private::diesel::pg::Pg> + ::core::marker::Send + ::core::marker::Sync + '_ {}
        }
    }
}
