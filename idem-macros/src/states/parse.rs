//! Reads a `#[derive(States)]` item as written: its shape, its variants and
//! the `#[states(From => [To, ..], ..)]` table, each kept with the user's
//! tokens for spans. Only syntax is checked here; whether the names are
//! variants is `validate`'s business.

use proc_macro2::Span;
use syn::parse::{Parse, ParseStream};
use syn::punctuated::Punctuated;
use syn::{Data, DeriveInput, Fields, Ident, Token};

use crate::errors::Errors;

/// One variant of the enum, as written.
pub(crate) struct Variant {
    pub(crate) ident: Ident,
    pub(crate) fields: Fields,
}

/// What kind of item derives `States`.
pub(crate) enum Shape {
    Enum(Vec<Variant>),
    /// A struct or a union: the span of its keyword.
    Other {
        keyword: &'static str,
        span: Span,
    },
}

/// `From => [To, ..]` (or `From => To`).
pub(crate) struct Rule {
    pub(crate) from: Ident,
    pub(crate) targets: Vec<Ident>,
}

impl Parse for Rule {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let from: Ident = input.parse()?;
        input.parse::<Token![=>]>()?;
        let targets = if input.peek(syn::token::Bracket) {
            let content;
            syn::bracketed!(content in input);
            Punctuated::<Ident, Token![,]>::parse_terminated(&content)?
                .into_iter()
                .collect()
        } else {
            vec![input.parse()?]
        };
        Ok(Rule { from, targets })
    }
}

/// An enum deriving `States`, as written.
pub(crate) struct StatesInput {
    pub(crate) ident: Ident,
    pub(crate) generics: syn::Generics,
    pub(crate) shape: Shape,
    /// The first `#[states(..)]`, if there is one.
    pub(crate) attr: Option<syn::Attribute>,
    /// Every rule of every `#[states(..)]`, in order.
    pub(crate) rules: Vec<Rule>,
}

impl StatesInput {
    pub(crate) fn parse(input: &DeriveInput, errors: &mut Errors) -> StatesInput {
        let shape = match &input.data {
            Data::Enum(data) => Shape::Enum(
                data.variants
                    .iter()
                    .map(|v| Variant {
                        ident: v.ident.clone(),
                        fields: v.fields.clone(),
                    })
                    .collect(),
            ),
            Data::Struct(data) => Shape::Other {
                keyword: "a struct",
                span: data.struct_token.span,
            },
            Data::Union(data) => Shape::Other {
                keyword: "a union",
                span: data.union_token.span,
            },
        };
        let mut attr = None;
        let mut rules = Vec::new();
        for a in input.attrs.iter().filter(|a| a.path().is_ident("states")) {
            attr.get_or_insert_with(|| a.clone());
            match a.parse_args_with(Punctuated::<Rule, Token![,]>::parse_terminated) {
                Ok(parsed) => rules.extend(parsed),
                Err(err) => errors.push(syn::Error::new(
                    err.span(),
                    format!("{err}; write the allowed transitions as #[states(Pending => [Paid, Cancelled], Paid => [Shipped])]"),
                )),
            }
        }
        StatesInput {
            ident: input.ident.clone(),
            generics: input.generics.clone(),
            shape,
            attr,
            rules,
        }
    }
}
