//! `#[derive(States)]`: a fieldless enum's allowed transitions, declared once.
//!
//! `parse` reads the enum and its `#[states(..)]` table, `validate` checks
//! every name against the variants, `expand` writes the `StateMachine` impl
//! and the diesel `Text` mapping of a valid input, and `fallback` the impls
//! that keep one mistake to one error.

mod expand;
mod fallback;
mod parse;
mod validate;

use proc_macro2::TokenStream;

use crate::errors::{to_compile_errors, Errors};

pub(crate) fn derive_states(input: TokenStream) -> TokenStream {
    let input: syn::DeriveInput = match syn::parse2(input) {
        Ok(input) => input,
        Err(err) => return to_compile_errors(err),
    };
    let mut errors = Errors::default();
    let parsed = parse::StatesInput::parse(&input, &mut errors);
    let machine = validate::states(&parsed, &mut errors);
    match (errors.finish(()), machine) {
        (Ok(()), Some(machine)) => expand::states(&machine),
        (Err(err), _) => fallback::states(&parsed, err),
        // Validation reports whatever keeps it from a complete machine.
        (Ok(()), None) => to_compile_errors(syn::Error::new_spanned(
            &parsed.ident,
            "#[derive(States)] could not tell this enum's states and transitions, and did not say why; please report this to idem, with the enum",
        )),
    }
}

#[cfg(test)]
mod tests;
