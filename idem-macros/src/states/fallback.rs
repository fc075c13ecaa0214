//! What a `#[derive(States)]` whose input has mistakes emits next to its
//! errors: the `StateMachine` impl (with bodies that never run, the crate
//! does not compile) and the diesel mapping, so that a model using the enum
//! as its state, and every `.transition(..)`, adds no error of its own.

use proc_macro2::TokenStream;
use quote::quote;

use super::expand::wrap;
use super::parse::StatesInput;

pub(crate) fn states(input: &StatesInput, err: syn::Error) -> TokenStream {
    let errors = err.to_compile_error();
    // A generic item's impls would need its parameters: the errors alone.
    if !input.generics.params.is_empty() {
        return errors;
    }
    let ident = &input.ident;
    let machine_impl = quote! {
        #[allow(unused_qualifications)]
        #[automatically_derived]
        impl ::idem::__private::StateMachine for #ident {
            const STATES: &'static [Self] = &[];
            const TRANSITIONS: &'static [(Self, Self)] = &[];
            fn as_text(&self) -> &'static str {
                ::core::unreachable!()
            }
            fn from_text(_: &str) -> ::core::option::Option<Self> {
                ::core::unreachable!()
            }
        }
    };
    let impls = wrap(ident, machine_impl);
    quote! {
        #errors
        #impls
    }
}
