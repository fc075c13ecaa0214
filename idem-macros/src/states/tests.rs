//! What `#[derive(States)]` writes (an insta snapshot of the pretty-printed
//! expansion), and every mistake its validation reports.
//!
//! Accept changed snapshots with `INSTA_UPDATE=always cargo test -p idem-macros`.

use proc_macro2::TokenStream;
use quote::quote;

use super::{derive_states, parse, validate};
use crate::errors::Errors;
use crate::test_support::pretty;

fn errors(input: TokenStream) -> Vec<String> {
    let input: syn::DeriveInput = syn::parse2(input).unwrap();
    let mut errors = Errors::default();
    let parsed = parse::StatesInput::parse(&input, &mut errors);
    validate::states(&parsed, &mut errors);
    match errors.finish(()) {
        Ok(()) => Vec::new(),
        Err(err) => err.into_iter().map(|e| e.to_string()).collect(),
    }
}

#[test]
fn order_status_with_three_transitions() {
    let out = derive_states(quote! {
        #[derive(Debug, Clone, Copy, PartialEq, Eq, States)]
        #[states(Pending => [Paid, Cancelled], Paid => Shipped)]
        enum OrderStatus { Pending, Paid, Shipped, Cancelled }
    });
    insta::assert_snapshot!(pretty(out));
}

#[test]
fn stored_texts_are_snake_case() {
    let text = |s: &str| validate::state_text(&syn::Ident::new(s, proc_macro2::Span::call_site()));
    assert_eq!(text("Pending"), "pending");
    assert_eq!(text("PendingPayment"), "pending_payment");
    assert_eq!(text("Step2Done"), "step2_done");
    assert_eq!(text("ABC"), "abc");
}

#[test]
fn every_mistake_is_reported_at_once() {
    let found = errors(quote! {
        #[states(Pending => [Payed, Paid, Paid], Shiped => [Pending])]
        enum OrderStatus { Pending, Paid(u8), Shipped }
    });
    assert_eq!(
        found,
        [
            "state `Paid` carries data, but a state is stored as its name in one text column; make it a plain variant: `Paid,`",
            "`Payed` is not a state of `OrderStatus`; its states are `Pending`, `Paid`, `Shipped`",
            "the transition `Pending => Paid` is declared twice; declare each transition once",
            "`Shiped` is not a state of `OrderStatus`; its states are `Pending`, `Paid`, `Shipped`",
        ]
    );
}

#[test]
fn a_broken_enum_expands_to_its_errors_and_the_impls() {
    let out = derive_states(quote! {
        #[states(Pending => [Payed])]
        enum OrderStatus { Pending, Paid }
    });
    let file: syn::File = syn::parse2(out.clone()).unwrap();
    // The compile_error!, then the `const _` with the impls.
    let [syn::Item::Macro(error), syn::Item::Const(impls)] = &file.items[..] else {
        panic!("expected one compile_error! and one const block:\n{out}");
    };
    let message: syn::LitStr = error.mac.parse_body().unwrap();
    assert_eq!(
        message.value(),
        "`Payed` is not a state of `OrderStatus`; its states are `Pending`, `Paid`"
    );
    assert!(quote!(#impls)
        .to_string()
        .contains("StateMachine for OrderStatus"));
}
