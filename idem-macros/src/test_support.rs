//! What the snapshot tests of every macro share: the expansion pretty-printed,
//! and the errors and functions of an expansion that reports mistakes.

use proc_macro2::TokenStream;
use quote::quote;

/// The expansion as formatted source; panics with the tokens if it does not parse.
pub(crate) fn pretty(tokens: TokenStream) -> String {
    match syn::parse_file(&tokens.to_string()) {
        Ok(file) => prettyplease::unparse(&file),
        Err(err) => panic!("the expansion is not valid Rust ({err}):\n{tokens}"),
    }
}

/// The `compile_error!` messages of an expansion, in order, and the functions
/// it still emits.
pub(crate) fn errors_and_fns(tokens: TokenStream) -> (Vec<String>, Vec<syn::ItemFn>) {
    let file: syn::File = match syn::parse2(tokens.clone()) {
        Ok(file) => file,
        Err(err) => panic!("the expansion is not valid Rust ({err}):\n{tokens}"),
    };
    let mut errors = Vec::new();
    let mut fns = Vec::new();
    for item in file.items {
        match item {
            syn::Item::Macro(m)
                if m.mac
                    .path
                    .segments
                    .last()
                    .is_some_and(|s| s.ident == "compile_error") =>
            {
                let message: syn::LitStr = m.mac.parse_body().unwrap();
                errors.push(message.value());
            }
            syn::Item::Fn(f) => fns.push(f),
            other => panic!("unexpected item in the expansion: {}", quote!(#other)),
        }
    }
    (errors, fns)
}
