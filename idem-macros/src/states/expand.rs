//! Generates the `StateMachine` impl and the diesel `Text` mapping of a valid
//! state enum. Every path into idem is absolute and hidden.

use proc_macro2::TokenStream;
use quote::quote;
use syn::Ident;

use super::validate::Machine;

pub(crate) fn states(machine: &Machine) -> TokenStream {
    let ident = &machine.ident;
    let variants: Vec<&Ident> = machine.states.iter().map(|(v, _)| v).collect();
    let texts: Vec<&String> = machine.states.iter().map(|(_, t)| t).collect();
    let froms: Vec<&Ident> = machine
        .transitions
        .iter()
        .map(|&(f, _)| variants[f])
        .collect();
    let tos: Vec<&Ident> = machine
        .transitions
        .iter()
        .map(|&(_, t)| variants[t])
        .collect();
    let machine_impl = quote! {
        #[automatically_derived]
        impl ::idem::__private::StateMachine for #ident {
            const STATES: &'static [Self] = &[#(Self::#variants,)*];
            const TRANSITIONS: &'static [(Self, Self)] = &[#((Self::#froms, Self::#tos),)*];

            fn allowed(from: &Self, to: &Self) -> bool {
                ::core::matches!((from, to), #((Self::#froms, Self::#tos))|*)
            }

            fn as_text(&self) -> &'static str {
                match self {
                    #(Self::#variants => #texts,)*
                }
            }

            fn from_text(text: &str) -> ::core::option::Option<Self> {
                match text {
                    #(#texts => ::core::option::Option::Some(Self::#variants),)*
                    _ => ::core::option::Option::None,
                }
            }
        }
    };
    wrap(ident, machine_impl)
}

/// The `StateMachine` impl and the diesel mapping of `ident`, which goes
/// through that impl, in one `const _` block.
pub(crate) fn wrap(ident: &Ident, machine_impl: TokenStream) -> TokenStream {
    let d = quote!(::idem::__private::diesel);
    let text = quote!(#d::sql_types::Text);
    let pg = quote!(#d::pg::Pg);
    let bound = quote!(#d::internal::derives::as_expression::Bound);
    quote! {
        const _: () = {
            #machine_impl

            // Stored as its text in a `Text` column: bindable, comparable and
            // loadable like diesel's own `#[derive(AsExpression, FromSqlRow)]`.
            #[automatically_derived]
            impl #d::expression::AsExpression<#text> for #ident {
                type Expression = #bound<#text, Self>;
                fn as_expression(self) -> Self::Expression {
                    #bound::new(self)
                }
            }
            #[automatically_derived]
            impl<'__idem_a> #d::expression::AsExpression<#text> for &'__idem_a #ident {
                type Expression = #bound<#text, Self>;
                fn as_expression(self) -> Self::Expression {
                    #bound::new(self)
                }
            }
            #[automatically_derived]
            impl #d::serialize::ToSql<#text, #pg> for #ident {
                fn to_sql<'__idem_b>(&'__idem_b self, out: &mut #d::serialize::Output<'__idem_b, '_, #pg>) -> #d::serialize::Result {
                    ::idem::__private::state_to_sql(self, out)
                }
            }
            #[automatically_derived]
            impl #d::deserialize::FromSql<#text, #pg> for #ident {
                fn from_sql(value: #d::pg::PgValue<'_>) -> #d::deserialize::Result<Self> {
                    ::idem::__private::state_from_sql(value)
                }
            }
            #[automatically_derived]
            impl #d::deserialize::Queryable<#text, #pg> for #ident {
                type Row = Self;
                fn build(row: Self) -> #d::deserialize::Result<Self> {
                    ::core::result::Result::Ok(row)
                }
            }
        };
    }
}
