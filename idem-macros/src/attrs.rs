//! Recognising idem's own attributes on an item, where `#[idempotent]` and
//! `#[retryable]` each look for the other, and the output of the other.

use proc_macro2::TokenStream;

/// Whether `attr` is `#[name(..)]`, by any path ending in `name`
/// (`retryable`, `idem::retryable`).
pub(crate) fn is_attr(attr: &syn::Attribute, name: &str) -> bool {
    attr.path().segments.last().is_some_and(|s| s.ident == name)
}

/// Whether `attr` is one of rustc's own inert attributes (`doc`, the lint
/// levels, `must_use`, `inline`, ..), which no macro expands: anything else
/// on a function may be an attribute macro that expands after idem's.
pub(crate) fn is_builtin(attr: &syn::Attribute) -> bool {
    const BUILTIN: [&str; 14] = [
        "doc",
        "allow",
        "warn",
        "deny",
        "forbid",
        "expect",
        "must_use",
        "inline",
        "cold",
        "cfg",
        "deprecated",
        "track_caller",
        "no_mangle",
        "export_name",
    ];
    attr.path()
        .get_ident()
        .is_some_and(|ident| BUILTIN.iter().any(|name| ident == name))
}

/// Which of idem's function attributes already expanded `func`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Maker {
    Idempotent,
    Retryable,
}

impl Maker {
    /// The attribute's name, which the other one looks for.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Maker::Idempotent => "idempotent",
            Maker::Retryable => "retryable",
        }
    }

    /// The attribute as a user writes it.
    pub(crate) fn attr(self) -> &'static str {
        match self {
            Maker::Idempotent => "#[idempotent]",
            Maker::Retryable => "#[retryable]",
        }
    }

    /// The same with its article, for a message ("an `#[idempotent]` fn").
    pub(crate) fn a_attr(self) -> &'static str {
        match self {
            Maker::Idempotent => "an #[idempotent]",
            Maker::Retryable => "a #[retryable]",
        }
    }
}

/// Whether `func` is the output of `#[idempotent]` or `#[retryable]`, and of
/// which: its first parameter (after `&self`) is the `&::idem::Pool` that
/// each writes in place of the connection, and its body binds, at its top,
/// the name each begins with (`__idem_request`, `__idem_loop`). Either
/// finds the other only by name; under another name (`use idem::retryable
/// as retry;`) the other expands first, and the one that runs second meets
/// this, as does an attribute written twice.
pub(crate) fn made_by(func: &syn::ItemFn) -> Option<Maker> {
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
    let bound: Vec<String> = func
        .block
        .stmts
        .iter()
        .filter_map(|stmt| match stmt {
            syn::Stmt::Local(local) => match &local.pat {
                syn::Pat::Ident(p) => Some(p.ident.to_string()),
                syn::Pat::Type(t) => match &*t.pat {
                    syn::Pat::Ident(p) => Some(p.ident.to_string()),
                    _ => None,
                },
                _ => None,
            },
            _ => None,
        })
        .collect();
    if bound.iter().any(|n| n == "__idem_request") {
        Some(Maker::Idempotent)
    } else if bound.iter().any(|n| n == "__idem_loop") {
        Some(Maker::Retryable)
    } else {
        None
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
        let name = this.name();
        format!(
            "this {this} sits below {maker} under another name, and {maker} finds it only by a path ending in `{name}`: write it as `#[{name}(..)]` or `#[idem::{name}(..)]`, so that the two make one loop",
            this = this.attr(),
            maker = maker.attr(),
        )
    };
    syn::Error::new(proc_macro2::Span::call_site(), message)
}

/// The first argument `#[retryable]` adds when it hands a function to the
/// `#[idempotent]` below it (see `retryable/mod.rs`).
const HANDED_OFF: &str = "__idem_handed_off";

/// `args` of a `#[retryable]` with the mark of a hand-off, which it gets when
/// it hands a function to `#[idempotent]` and writes itself again below.
pub(crate) fn handed_off(args: TokenStream) -> TokenStream {
    let mark = proc_macro2::Ident::new(HANDED_OFF, proc_macro2::Span::call_site());
    quote::quote!(#mark, #args)
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
