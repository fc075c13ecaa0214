//! Recognising idem's own attributes on an item, where `#[idempotent]` and
//! `#[retryable]` each look for the other, and the output of the other.

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
