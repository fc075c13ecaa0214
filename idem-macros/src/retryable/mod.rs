//! `#[retryable]`: the body becomes one attempt of a retry loop over a pool.

mod expand;
mod parse;

use proc_macro2::TokenStream;
use quote::ToTokens;

pub(crate) fn retryable(args: TokenStream, item: TokenStream) -> TokenStream {
    let func: syn::ItemFn = match syn::parse2(item.clone()) {
        Ok(func) => func,
        Err(err) => {
            let mut out = err.to_compile_error();
            out.extend(item);
            return out;
        }
    };
    match parse::Retryable::from_tokens(args, &func) {
        Ok(parsed) => expand::retryable(&parsed),
        // Keep the function as written next to the error, so one mistake in the
        // attribute does not turn every caller into an error too.
        Err(err) => {
            let mut out = err.to_compile_error();
            out.extend(func.into_token_stream());
            out
        }
    }
}
