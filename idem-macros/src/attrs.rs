//! Recognising idem's own attributes on an item, where `#[idempotent]` and
//! `#[retryable]` each look for the other, and the output of the other.

use proc_macro2::TokenStream;

/// Whether `attr` is `#[name(..)]`, by any path ending in `name`
/// (`retryable`, `idem::retryable`).
pub(crate) fn is_attr(attr: &syn::Attribute, name: &str) -> bool {
    attr.path().segments.last().is_some_and(|s| s.ident == name)
}

/// Which of idem's function attributes already expanded `func`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Maker {
    Idempotent,
    Retryable,
}

impl Maker {
    /// The attribute as a user writes it.
    pub(crate) fn attr(self) -> &'static str {
        match self {
            Maker::Idempotent => "#[idempotent]",
            Maker::Retryable => "#[retryable]",
        }
    }
}

/// Whether `func` is the output of #[idempotent] or #[retryable], and of
/// which: its first parameter (after `&self`) is the `&::idem::Pool` that each writes in
/// place of the connection, and its body uses their `__idem_` names
/// (`__idem_request` only #[idempotent]'s). Either finds the other only by
/// name; under another name (`use idem::retryable as retry;`) the other
/// expands first, and the one that runs second meets this, as does an
/// attribute written twice.
pub(crate) fn made_by(func: &syn::ItemFn) -> Option<Maker> {
    // After `&self`, in a method.
    let first = func.sig.inputs.iter().find_map(|input| match input {
        syn::FnArg::Typed(arg) => Some(arg),
        syn::FnArg::Receiver(_) => None,
    })?;
    let syn::Type::Reference(reference) = &*first.ty else {
        return None;
    };
    let syn::Type::Path(path) = &*reference.elem else {
        return None;
    };
    let segments: Vec<String> = path
        .path
        .segments
        .iter()
        .map(|s| s.ident.to_string())
        .collect();
    if path.qself.is_some() || path.path.leading_colon.is_none() || segments != ["idem", "Pool"] {
        return None;
    }
    let mut names = Vec::new();
    idem_names(quote::ToTokens::to_token_stream(&func.block), &mut names);
    if names.iter().any(|n| n == "__idem_request") {
        Some(Maker::Idempotent)
    } else if !names.is_empty() {
        Some(Maker::Retryable)
    } else {
        None
    }
}

fn idem_names(tokens: proc_macro2::TokenStream, names: &mut Vec<String>) {
    for token in tokens {
        match token {
            proc_macro2::TokenTree::Ident(ident) => {
                let name = ident.to_string();
                if name.starts_with("__idem_") {
                    names.push(name);
                }
            }
            proc_macro2::TokenTree::Group(group) => idem_names(group.stream(), names),
            _ => {}
        }
    }
}

/// The error for an attribute (`this`) that meets a function `maker`
/// already expanded: written twice, or below the other under a name the
/// other does not know.
pub(crate) fn already_expanded(this: Maker, maker: Maker) -> syn::Error {
    let message = if this == maker {
        format!(
            "{} is written twice on this function (or once more under another name): one is enough",
            this.attr()
        )
    } else {
        let name = match this {
            Maker::Idempotent => "idempotent",
            Maker::Retryable => "retryable",
        };
        format!(
            "this {this} sits below {maker} under another name, and {maker} finds it only by a path ending in `{name}`: write it as `#[{name}(..)]` or `#[idem::{name}(..)]`, so that the two make one loop",
            this = this.attr(),
            maker = maker.attr(),
        )
    };
    syn::Error::new(proc_macro2::Span::call_site(), message)
}

/// The first argument #[retryable] adds when it hands a function to the
/// #[idempotent] below it (see `retryable/mod.rs`).
const HANDED_OFF: &str = "__idem_handed_off";

/// `args` of a #[retryable] with the mark of a hand-off, which it gets when
/// it hands a function to #[idempotent] and writes itself again below.
pub(crate) fn handed_off(args: TokenStream) -> TokenStream {
    quote::quote!(__idem_handed_off, #args)
}

/// Whether `args` carry that mark, and `args` without it.
pub(crate) fn strip_handed_off(args: TokenStream) -> (bool, TokenStream) {
    let mut tokens = args.clone().into_iter();
    match tokens.next() {
        Some(proc_macro2::TokenTree::Ident(ident)) if ident == HANDED_OFF => {
            // The comma after it, if any.
            let rest: Vec<proc_macro2::TokenTree> = tokens.collect();
            let rest = match rest.first() {
                Some(proc_macro2::TokenTree::Punct(p)) if p.as_char() == ',' => &rest[1..],
                _ => &rest[..],
            };
            (true, rest.iter().cloned().collect())
        }
        _ => (false, args),
    }
}
