//! Reads `#[retryable(..)]` and the function under it, checking that the body
//! can be replayed. Nothing here generates code.

use proc_macro2::{Span, TokenStream};
use quote::ToTokens;
use syn::parse::Parser;
use syn::spanned::Spanned;
use syn::{Expr, FnArg, Ident, ItemFn, Lit, Pat, Type};

use crate::attrs::Maker;
use crate::errors::Errors;

pub(crate) const KEYS: &str = "`max`, `deadline_ms`, `backoff_base_ms`, `backoff_cap_ms`, `isolation`, `on_conflict`, `retry_lock_not_available`, `commit_timeout_ms`, `hot_row_memory_ms` and `policy`";

/// The isolation level a `#[retryable(isolation = ..)]` names.
#[derive(Clone, Copy)]
pub(crate) enum IsolationArg {
    ReadCommitted,
    RepeatableRead,
    Serializable,
}

/// What `#[retryable(on_conflict = ..)]` names.
#[derive(Clone, Copy)]
pub(crate) enum OnConflictArg {
    Retry,
    Lock,
}

/// The attribute's settings, typed: each given at most once, each value
/// already checked. Expansion reads fields, never key strings.
#[derive(Default)]
pub(crate) struct Settings {
    /// `policy = <expr>`: the base the other keys apply on top of.
    pub(crate) policy: Option<Expr>,
    pub(crate) max: Option<u32>,
    pub(crate) deadline_ms: Option<u64>,
    pub(crate) backoff_base_ms: Option<u64>,
    pub(crate) backoff_cap_ms: Option<u64>,
    pub(crate) commit_timeout_ms: Option<u64>,
    pub(crate) hot_row_memory_ms: Option<u64>,
    pub(crate) isolation: Option<IsolationArg>,
    pub(crate) on_conflict: Option<OnConflictArg>,
    pub(crate) retry_lock_not_available: Option<bool>,
}

/// A parameter handed to every attempt again.
pub(crate) struct Replayed {
    pub(crate) ident: Ident,
    /// By value: each attempt gets a clone.
    pub(crate) by_value: bool,
    pub(crate) ty_span: Span,
    /// `mut x: T`: kept on the attempt's own binding of a by-value argument.
    pub(crate) mutability: Option<syn::Token![mut]>,
}

pub(crate) struct Retryable {
    pub(crate) func: ItemFn,
    pub(crate) settings: Settings,
    /// Index of the connection parameter in `func.sig.inputs`.
    pub(crate) conn_index: usize,
    pub(crate) conn_ident: Ident,
    /// What the first parameter is, and its type's tokens to point errors at.
    pub(crate) conn_kind: (ConnKind, proc_macro2::TokenStream),
    pub(crate) replayed: Vec<Replayed>,
}

/// What the first parameter hands the body: the attempt's connection, or
/// (external `#[idempotent]` only) the deferred handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ConnKind {
    Connection,
    Deferred,
}

fn connection_kind(ty: &Type) -> Option<ConnKind> {
    match ty {
        Type::Reference(r) if r.mutability.is_some() => match &*r.elem {
            Type::Path(p) => match p.path.segments.last() {
                Some(s) if s.ident == "AsyncPgConnection" => Some(ConnKind::Connection),
                Some(s) if s.ident == "Deferred" => Some(ConnKind::Deferred),
                _ => None,
            },
            _ => None,
        },
        _ => None,
    }
}

pub(crate) fn is_connection(ty: &Type) -> bool {
    connection_kind(ty).is_some()
}

fn lit_u64(expr: &Expr) -> Option<u64> {
    match expr {
        Expr::Lit(syn::ExprLit {
            lit: Lit::Int(i), ..
        }) => i.base10_parse().ok(),
        _ => None,
    }
}

impl Retryable {
    pub(crate) fn from_tokens(args: TokenStream, func: &ItemFn) -> syn::Result<Retryable> {
        Retryable::from_tokens_for(args, func, Maker::Retryable)
    }

    /// [`Retryable::from_tokens`], its errors about the function naming
    /// `maker`: the attribute the user wrote (`#[idempotent]` checks the same
    /// shape when no `#[retryable]` is written with it).
    pub(crate) fn from_tokens_for(
        args: TokenStream,
        func: &ItemFn,
        maker: Maker,
    ) -> syn::Result<Retryable> {
        Retryable::parse(args, func, maker, false)
    }

    /// The function's shape for a stand-in while an error stands: the
    /// connection taken where it is, also after other parameters, so that
    /// callers written for that order see no error of their own.
    pub(crate) fn stand_in(func: &ItemFn, maker: Maker) -> syn::Result<Retryable> {
        Retryable::parse(TokenStream::new(), func, maker, true)
    }

    fn parse(
        args: TokenStream,
        func: &ItemFn,
        maker: Maker,
        connection_anywhere: bool,
    ) -> syn::Result<Retryable> {
        let (attr, a_attr) = (maker.attr(), maker.a_attr());
        let mut errors = Errors::default();
        let mut settings = Settings::default();
        // Every key given so far, with its value as written.
        let mut given: Vec<(Ident, String)> = Vec::new();
        let parser = syn::meta::parser(|meta| {
            let Some(key) = meta.path.get_ident().cloned() else {
                return Err(meta.error(format!("expected one of {KEYS}")));
            };
            if !meta.input.peek(syn::Token![=]) {
                // Spanned at the key: syn's own "expected `=`" points at the
                // whole attribute when the key is the last thing in it.
                return Err(syn::Error::new_spanned(
                    &key,
                    format!("`{key}` needs a value: `{key} = ..`"),
                ));
            }
            let value: Expr = meta.value()?.parse()?;
            if let Some((_, first)) = given.iter().find(|(k, _)| *k == key) {
                errors.push_at(
                    &key,
                    format!("`{key}` is given twice; keep one (it was first given as `{key} = {first}`)"),
                );
                return Ok(());
            }
            given.push((key.clone(), value.to_token_stream().to_string()));
            let name = key.to_string();
            let ident = match &value {
                Expr::Path(p) => p.path.get_ident().map(ToString::to_string),
                _ => None,
            };
            let millis = || match lit_u64(&value) {
                Some(0) if name == "deadline_ms" || name == "commit_timeout_ms" => Err(
                    "a zero budget would fail every call; give a number of milliseconds above 0",
                ),
                Some(ms) => Ok(ms),
                None => {
                    Err("this key takes a whole number of milliseconds, e.g. `deadline_ms = 800`")
                }
            };
            let checked: Result<(), &str> = match name.as_str() {
                "max" => match lit_u64(&value) {
                    Some(0) => Err("`max = 0` would never run the body; the first attempt counts, so use at least 1"),
                    Some(n) if n <= u32::MAX as u64 => {
                        settings.max = Some(n as u32);
                        Ok(())
                    }
                    Some(_) => Err("`max` is at most 4294967295 attempts (a `u32`); a few are enough, e.g. `max = 4`"),
                    None => Err("`max` takes a whole number of attempts, e.g. `max = 4`"),
                },
                "deadline_ms" => millis().map(|ms| settings.deadline_ms = Some(ms)),
                "backoff_base_ms" => millis().map(|ms| settings.backoff_base_ms = Some(ms)),
                "backoff_cap_ms" => millis().map(|ms| settings.backoff_cap_ms = Some(ms)),
                "commit_timeout_ms" => millis().map(|ms| settings.commit_timeout_ms = Some(ms)),
                "hot_row_memory_ms" => millis().map(|ms| settings.hot_row_memory_ms = Some(ms)),
                "isolation" => match ident.as_deref() {
                    Some("read_committed") => Ok(IsolationArg::ReadCommitted),
                    Some("repeatable_read") => Ok(IsolationArg::RepeatableRead),
                    Some("serializable") => Ok(IsolationArg::Serializable),
                    _ => Err("`isolation` is one of `read_committed` (the default), `repeatable_read` or `serializable`"),
                }
                .map(|level| settings.isolation = Some(level)),
                "on_conflict" => match ident.as_deref() {
                    Some("retry") => Ok(OnConflictArg::Retry),
                    Some("lock") => Ok(OnConflictArg::Lock),
                    _ => Err("`on_conflict` is `retry` (the default) or `lock`"),
                }
                .map(|mode| settings.on_conflict = Some(mode)),
                "retry_lock_not_available" => match &value {
                    Expr::Lit(syn::ExprLit { lit: Lit::Bool(b), .. }) => {
                        settings.retry_lock_not_available = Some(b.value);
                        Ok(())
                    }
                    _ => Err("`retry_lock_not_available` is `true` or `false`"),
                },
                "policy" => {
                    settings.policy = Some(value.clone());
                    Ok(())
                }
                _ => {
                    errors.push_at(&key, format!("unknown key `{key}` in #[retryable(..)]; the valid keys are {KEYS}"));
                    return Ok(());
                }
            };
            if let Err(message) = checked {
                errors.push_at(&value, message);
            }
            Ok(())
        });
        if let Err(err) = parser.parse2(args) {
            errors.push(err);
        }

        let sig = &func.sig;
        if sig.asyncness.is_none() {
            errors.push_at(
                sig.fn_token,
                format!("{attr} needs an `async fn`: each attempt awaits the database"),
            );
        }
        if matches!(sig.output, syn::ReturnType::Default) {
            errors.push_at(&sig.ident, format!("{a_attr} fn returns `Result<T, E>`: the loop must see an attempt fail to replay it"));
        }

        let mut conn: Option<(usize, Ident)> = None;
        // The missing connection was reported at the first parameter: the
        // rest are read as the arguments they are, not reported again.
        let mut no_conn = false;
        let mut replayed = Vec::new();
        for (index, input) in sig.inputs.iter().enumerate() {
            match input {
                FnArg::Receiver(receiver) => {
                    // `&self`, or the same written out: `self: &Self`.
                    let shared = match &*receiver.ty {
                        Type::Reference(r) => r.mutability.is_none(),
                        _ => false,
                    };
                    if !shared || receiver.mutability.is_some() {
                        errors.push_at(receiver, format!("{a_attr} method takes `&self`: its body is replayed on every attempt, so it cannot consume or mutate `self`"));
                    }
                }
                FnArg::Typed(arg) => {
                    let (ident, mutability) = match &*arg.pat {
                        Pat::Ident(p) if p.by_ref.is_none() && p.subpat.is_none() => {
                            (p.ident.clone(), p.mutability)
                        }
                        other => {
                            errors.push_at(other, format!("give this parameter a plain name: {attr} hands it to every attempt again"));
                            // A connection without a name is still the
                            // connection: not reported again at the next.
                            if conn.is_none() && is_connection(&arg.ty) {
                                no_conn = true;
                            }
                            continue;
                        }
                    };
                    let later = sig.inputs.iter().skip(index + 1).find_map(|i| match i {
                        FnArg::Typed(a) if is_connection(&a.ty) => Some(a),
                        _ => None,
                    });
                    // A stand-in takes the connection where it is: the
                    // parameters before it are arguments.
                    let before_conn = connection_anywhere && later.is_some();
                    if conn.is_none() && !no_conn && !before_conn {
                        if is_connection(&arg.ty) {
                            conn = Some((index, ident));
                        } else {
                            let message = match later {
                                Some(later) => format!(
                                    "the attempt's connection comes first in {a_attr} fn: move `{}` before `{}` (callers pass an `&idem::Pool` in its place)",
                                    later.pat.to_token_stream(),
                                    arg.pat.to_token_stream(),
                                ),
                                None => format!("the first parameter of {a_attr} fn is the attempt's connection: `conn: &mut AsyncPgConnection` (callers pass an `&idem::Pool` in its place)"),
                            };
                            errors.push_at(&arg.ty, message);
                            // One mistake, one error: the connection found later
                            // is not reported as a stray `&mut` argument too.
                            if later.is_some() {
                                break;
                            }
                            no_conn = true;
                        }
                        continue;
                    }
                    if is_connection(&arg.ty) {
                        errors.push_at(&arg.ty, format!("{a_attr} fn takes one connection, its first parameter, which each attempt gets afresh: this is a second one; take it out"));
                        continue;
                    }
                    match &*arg.ty {
                        Type::Reference(r) if r.mutability.is_some() => errors.push_at(
                            &arg.ty,
                            format!("{a_attr} body is replayed on every attempt, and a `&mut` argument would carry one attempt's changes into the next; take it by value (Clone) or by shared reference"),
                        ),
                        Type::Reference(_) => replayed.push(Replayed { ident, by_value: false, ty_span: arg.ty.span(), mutability }),
                        _ => replayed.push(Replayed { ident, by_value: true, ty_span: arg.ty.span(), mutability }),
                    }
                }
            }
        }
        if conn.is_none() && !sig.inputs.iter().any(|i| matches!(i, FnArg::Typed(_))) {
            errors.push_at(&sig.ident, format!("{a_attr} fn takes the attempt's connection as its first parameter: `conn: &mut AsyncPgConnection`"));
        }

        let (conn_index, conn_ident) =
            conn.unwrap_or_else(|| (0, Ident::new("conn", Span::call_site())));
        let conn_kind = match sig.inputs.iter().nth(conn_index) {
            Some(FnArg::Typed(arg)) => (
                connection_kind(&arg.ty).unwrap_or(ConnKind::Connection),
                arg.ty.to_token_stream(),
            ),
            _ => (ConnKind::Connection, sig.ident.to_token_stream()),
        };
        errors.finish(Retryable {
            func: func.clone(),
            settings,
            conn_index,
            conn_ident,
            conn_kind,
            replayed,
        })
    }
}
