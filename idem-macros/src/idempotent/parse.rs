//! Reads `#[idempotent(..)]`, checking every name it refers to.

use proc_macro2::TokenStream;
use quote::ToTokens;
use syn::parse::{Parse, ParseStream, Parser};
use syn::punctuated::Punctuated;
use syn::{Expr, FnArg, Ident, ItemFn, Lit, LitStr, Pat, ReturnType, Token, Type};

use crate::errors::Errors;

const NAMES: &[&str] = &[
    "key",
    "scope",
    "fingerprint",
    "operation",
    "mode",
    "ttl_s",
    "lease_ms",
    "wait_ms",
    "max_response_bytes",
    "config",
    "cache",
];
pub(crate) const KEYS: &str = "`key`, `scope`, `fingerprint(..)`, `operation`, `mode`, `ttl_s`, `lease_ms`, `wait_ms`, `max_response_bytes`, `config` and `cache`";

/// How `cache` is written, for messages.
const CACHE_FORM: &str = "`cache = <expr>`, where the expression gives an `idem::idempotency::ReplayCache` (a reference, an `Arc` or an `Option` of one; feature `redis`), e.g. `cache = &state.replay_cache`";

/// A named field of the fingerprint.
pub(crate) struct FingerprintField {
    /// The expression as written, without spaces: the field's name in the
    /// canonical encoding (`cmd.amount`).
    pub(crate) name: String,
    pub(crate) expr: Expr,
}

/// `scope = ..`: whose keys these are.
pub(crate) enum ScopeArg {
    /// `scope = none`: one key space for every caller, said out loud.
    None,
    /// The scope's values, e.g. `(ctx.tenant, ctx.user)`.
    Values(Expr),
}

pub(crate) enum ModeArg {
    Local,
    External,
}

pub(crate) struct Idempotent {
    pub(crate) key: Option<Expr>,
    /// Required: `None` is reported by [`missing_scope`], next to a full
    /// expansion (as `none`), so the callers see no second error.
    pub(crate) scope: Option<ScopeArg>,
    /// `None`: every parameter but the connection.
    pub(crate) fingerprint: Option<Vec<FingerprintField>>,
    pub(crate) operation: Option<LitStr>,
    pub(crate) mode: ModeArg,
    pub(crate) ttl_s: Option<u64>,
    pub(crate) lease_ms: Option<u64>,
    pub(crate) wait_ms: Option<u64>,
    pub(crate) max_response_bytes: Option<u64>,
    pub(crate) config: Option<Expr>,
    /// `cache = ..`: the replay cache read before, and filled after, the database.
    pub(crate) cache: Option<Expr>,
    /// Every non-connection parameter, for the default fingerprint.
    pub(crate) params: Vec<Ident>,
}

struct ExprList(Punctuated<Expr, Token![,]>);

impl Parse for ExprList {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        Ok(ExprList(Punctuated::parse_terminated(input)?))
    }
}

/// The parameter an expression like `cmd.amount` or `amount` starts from.
fn root_ident(expr: &Expr) -> Option<&Ident> {
    match expr {
        Expr::Path(p) => p.path.get_ident(),
        Expr::Field(f) => root_ident(&f.base),
        Expr::Reference(r) => root_ident(&r.expr),
        Expr::Paren(p) => root_ident(&p.expr),
        _ => None,
    }
}

/// Why a setting cannot be 0, and what to give instead.
fn zero_message(key: &str) -> String {
    let why = match key {
        "ttl_s" => "a record kept 0 seconds is never replayed, so a repeated request would run again",
        "lease_ms" => "a lease of 0 ms runs out at once, so every external request would be reported as outcome unknown",
        _ => "no response fits in 0 bytes, so every request would fail",
    };
    format!(
        "`{key} = 0`: {why}; give a number above 0, e.g. `{}`",
        example(key)
    )
}

/// A sensible value of a numeric setting, for messages.
fn example(key: &str) -> &'static str {
    match key {
        "ttl_s" => "ttl_s = 86400",
        "lease_ms" => "lease_ms = 30000",
        "wait_ms" => "wait_ms = 500",
        _ => "max_response_bytes = 65536",
    }
}

/// Types no alias of `Result` is named after.
const NOT_RESULTS: &[&str] = &[
    "Option", "Vec", "String", "str", "Box", "HashMap", "BTreeMap", "bool", "char", "i8", "i16",
    "i32", "i64", "i128", "isize", "u8", "u16", "u32", "u64", "u128", "usize", "f32", "f64",
];

/// The return type, when it visibly is no `Result` (any other path may be an
/// alias of one, and is left to the type check, which names `ResultParts`).
fn not_a_result(output: &ReturnType) -> Option<&Type> {
    let ReturnType::Type(_, ty) = output else {
        return None;
    };
    match &**ty {
        Type::Path(p) => match p.path.segments.last() {
            Some(last) if NOT_RESULTS.iter().any(|name| last.ident == name) => Some(ty),
            _ => None,
        },
        Type::Paren(_) | Type::Group(_) | Type::Macro(_) | Type::Verbatim(_) => None,
        _ => Some(ty),
    }
}

fn lit_u64(expr: &Expr) -> Option<u64> {
    match expr {
        Expr::Lit(syn::ExprLit {
            lit: Lit::Int(i), ..
        }) => i.base10_parse().ok(),
        _ => None,
    }
}

impl Idempotent {
    pub(crate) fn from_tokens(args: TokenStream, func: &ItemFn) -> syn::Result<Idempotent> {
        let mut errors = Errors::default();
        // Each named parameter, and whether it is the connection (or the
        // deferred handle). Where the connection is missing or out of place,
        // #[retryable]'s check of the shape says so, once; here every other
        // parameter is still one of the request's.
        let params: Vec<(Ident, bool)> = func
            .sig
            .inputs
            .iter()
            .filter_map(|input| match input {
                FnArg::Typed(arg) => match &*arg.pat {
                    Pat::Ident(p) => Some((
                        p.ident.clone(),
                        crate::retryable::parse::is_connection(&arg.ty),
                    )),
                    _ => None,
                },
                FnArg::Receiver(_) => None,
            })
            .collect();
        let conn = params.iter().find(|(_, c)| *c).map(|(p, _)| p.clone());
        let data_params: Vec<Ident> = params
            .iter()
            .filter(|(p, _)| Some(p) != conn.as_ref())
            .map(|(p, _)| p.clone())
            .collect();

        let mut out = Idempotent {
            key: None,
            scope: None,
            fingerprint: None,
            operation: None,
            mode: ModeArg::Local,
            ttl_s: None,
            lease_ms: None,
            wait_ms: None,
            max_response_bytes: None,
            config: None,
            cache: None,
            params: data_params.clone(),
        };
        let mut seen: Vec<Ident> = Vec::new();
        let parser = syn::meta::parser(|meta| {
            let Some(key) = meta.path.get_ident().cloned() else {
                return Err(meta.error(format!("expected one of {KEYS}")));
            };
            if seen.contains(&key) {
                errors.push_at(
                    &key,
                    format!("`{key}` is given twice in #[idempotent(..)]; keep one"),
                );
            }
            seen.push(key.clone());
            match key.to_string().as_str() {
                "fingerprint" => {
                    let content;
                    syn::parenthesized!(content in meta.input);
                    let list: ExprList = content.parse()?;
                    let mut fields: Vec<FingerprintField> = Vec::new();
                    for expr in list.0 {
                        match root_ident(&expr) {
                            Some(root) if data_params.contains(root) => {}
                            Some(root) if Some(root) == conn.as_ref() => errors.push_at(
                                root,
                                format!("`{root}` is the connection; fingerprint(..) names the request's parameters or their fields"),
                            ),
                            Some(root) => {
                                let names: Vec<String> = data_params.iter().map(|p| format!("`{p}`")).collect();
                                errors.push_at(
                                    root,
                                    format!(
                                        "`{root}` is not a parameter of `{}`; fingerprint(..) names parameters or their fields ({})",
                                        func.sig.ident,
                                        if names.is_empty() { "it has none".to_owned() } else { names.join(", ") }
                                    ),
                                );
                            }
                            None => errors.push_at(&expr, "fingerprint(..) takes parameters or fields of them, like `cmd.amount`"),
                        }
                        let name: String = expr
                            .to_token_stream()
                            .to_string()
                            .chars()
                            .filter(|c| !c.is_whitespace())
                            .collect();
                        if fields.iter().any(|f| f.name == name) {
                            errors.push_at(
                                &expr,
                                format!("`{name}` is named twice in fingerprint(..)"),
                            );
                        }
                        fields.push(FingerprintField { name, expr });
                    }
                    if fields.is_empty() {
                        errors.push_at(&key, "fingerprint() names nothing; leave it out to fingerprint every parameter");
                    }
                    out.fingerprint = Some(fields);
                }
                "key" => {
                    let value: Expr = meta.value()?.parse()?;
                    if let Some(at) = conn.as_ref().and_then(|c| names_variable(&value, c)) {
                        errors.push_at(&at, format!("`{at}` is the connection; `key = ..` is made of the request's parameters or their fields"));
                    }
                    out.key = Some(value);
                }
                "scope" => {
                    let value: Expr = meta.value()?.parse()?;
                    if let Some(at) = conn.as_ref().and_then(|c| names_variable(&value, c)) {
                        errors.push_at(&at, format!("`{at}` is the connection; `scope = ..` is made of values the caller has (parameters, their fields, constants)"));
                    }
                    out.scope = Some(match &value {
                        Expr::Path(p) if p.path.is_ident("none") => ScopeArg::None,
                        _ => ScopeArg::Values(value),
                    });
                }
                "config" => out.config = Some(meta.value()?.parse()?),
                "cache" => {
                    if !meta.input.peek(Token![=]) {
                        return Err(syn::Error::new_spanned(
                            &key,
                            format!("`cache` needs a value: {CACHE_FORM}"),
                        ));
                    }
                    let value: Expr = meta.value()?.parse()?;
                    match &value {
                        Expr::Lit(syn::ExprLit {
                            lit: Lit::Str(_), ..
                        }) => errors.push_at(
                            &value,
                            format!(
                                "`cache` takes a replay cache, not its address: build one `idem::idempotency::ReplayCache::new(url)` per process, and give {CACHE_FORM}"
                            ),
                        ),
                        Expr::Lit(_) => errors.push_at(
                            &value,
                            format!("`cache` takes a replay cache: {CACHE_FORM}"),
                        ),
                        _ => out.cache = Some(value),
                    }
                }
                "operation" => out.operation = Some(meta.value()?.parse()?),
                "mode" => {
                    let value: Ident = meta.value()?.parse()?;
                    out.mode = match value.to_string().as_str() {
                        "local" => ModeArg::Local,
                        "external" => ModeArg::External,
                        _ => {
                            errors.push_at(&value, "`mode` is `local` (every effect is in this database; the default) or `external` (the body calls another system)");
                            ModeArg::Local
                        }
                    };
                }
                "ttl_s" | "lease_ms" | "wait_ms" | "max_response_bytes" => {
                    let value: Expr = meta.value()?.parse()?;
                    match lit_u64(&value) {
                        Some(0) if key != "wait_ms" => {
                            errors.push_at(&value, zero_message(&key.to_string()))
                        }
                        Some(n) => match key.to_string().as_str() {
                            "ttl_s" => out.ttl_s = Some(n),
                            "lease_ms" => out.lease_ms = Some(n),
                            "wait_ms" => out.wait_ms = Some(n),
                            _ => out.max_response_bytes = Some(n),
                        },
                        None => errors.push_at(
                            &value,
                            format!(
                                "`{key}` takes a whole number, e.g. `{}`",
                                example(&key.to_string())
                            ),
                        ),
                    }
                }
                _ => {
                    let name = key.to_string();
                    let hint = NAMES
                        .iter()
                        .find(|valid| valid.starts_with(name.as_str()) || name.starts_with(*valid))
                        .map(|valid| format!(" (did you mean `{valid}`?)"))
                        .unwrap_or_default();
                    errors.push_at(
                        &key,
                        format!(
                            "unknown key `{key}` in #[idempotent(..)]{hint}; the valid keys are {KEYS}"
                        ),
                    );
                    if meta.input.peek(Token![=]) {
                        meta.value()?.parse::<Expr>()?;
                    } else if meta.input.peek(syn::token::Paren) {
                        let content;
                        syn::parenthesized!(content in meta.input);
                        content.parse::<TokenStream>()?;
                    }
                }
            }
            Ok(())
        });
        if let Err(err) = parser.parse2(args) {
            errors.push(err);
        }
        if let Some(ty) = not_a_result(&func.sig.output) {
            errors.push_at(
                ty,
                "an #[idempotent] fn returns `Result<T, E>`: the `T` is the response stored and replayed under the key, and `E` carries idem's errors (`From<idem::Error>`)",
            );
        }
        if let Some(op) = &out.operation {
            if op.value().is_empty() {
                errors.push_at(
                    op,
                    "`operation` names the operation in the idempotency record; it cannot be empty",
                );
            }
        }
        errors.finish(out)
    }
}

/// The error for an attribute without `scope`.
pub(crate) fn missing_scope() -> syn::Error {
    // At the attribute: the key space is a decision, never a default (a
    // replay skips the body and any authorization in it).
    syn::Error::new(
        proc_macro2::Span::call_site(),
        "#[idempotent(..)] must name whose keys these are: add `scope = <values>` with the \
         principal in it (e.g. `scope = (ctx.tenant, ctx.user)`), or `scope = none` for one \
         key space shared by every caller. A replay returns the stored response without \
         running the body, so a scope without the principal lets one caller read another's result",
    )
}

/// The variables `tokens` name, in order: every identifier but a field's
/// (right after a `.`), inside groups too.
pub(super) fn variables_in(tokens: TokenStream, out: &mut Vec<Ident>) {
    let mut after_dot = false;
    for token in tokens {
        let dot = matches!(&token, proc_macro2::TokenTree::Punct(p) if p.as_char() == '.');
        match token {
            proc_macro2::TokenTree::Ident(ident) if !after_dot => out.push(ident),
            proc_macro2::TokenTree::Group(group) => variables_in(group.stream(), out),
            _ => {}
        }
        after_dot = dot;
    }
}

/// Where `expr` uses the variable `name` (not a field of that name, after a
/// `.`): the token, to point an error at.
fn names_variable(expr: &Expr, name: &Ident) -> Option<Ident> {
    let mut variables = Vec::new();
    variables_in(expr.to_token_stream(), &mut variables);
    variables.into_iter().find(|variable| variable == name)
}
