//! Reads a model or a changeset struct as written: its fields and the keys of
//! its `#[versioned(..)]` and `#[diesel(..)]` attributes, each kept with the
//! user's tokens for spans. Only syntax is checked here; whether the names
//! refer to fields is `validate`'s business, and nothing here generates code.

use proc_macro2::{Span, TokenStream};
use syn::parse::{Parse, ParseStream};
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;
use syn::{Data, DeriveInput, Fields, Ident, Path, Token, Type};

use crate::errors::Errors;

const MODEL_KEYS: &str = "`tenant`, `version`, `key`, `state` and `create_once`";
const CHANGES_KEYS: &str = "`model` and `table`";

/// One field of the struct and the column it maps to.
#[derive(Clone)]
pub(crate) struct Field {
    pub(crate) ident: Ident,
    pub(crate) ty: Type,
    /// `#[diesel(column_name = ..)]`, or the field's own name.
    pub(crate) column: Ident,
}

/// `tenant = tenant_id` or `tenant = none`.
pub(crate) enum TenantArg {
    Field(Ident),
    None,
}

/// A key of an attribute as written, kept for spans.
pub(crate) struct Arg<T> {
    pub(crate) key: Ident,
    pub(crate) value: T,
}

impl<T> Arg<T> {
    fn set(slot: &mut Option<Arg<T>>, key: Ident, value: T, errors: &mut Errors) {
        if slot.is_some() {
            errors.push_at(
                &key,
                format!("`{key}` is given more than once in #[versioned(..)]; keep only the one you mean"),
            );
        } else {
            *slot = Some(Arg { key, value });
        }
    }
}

/// `create_once(key = .., fingerprint(..))`, as written.
pub(crate) struct OnceArgs {
    /// The key field(s), keyed by `key`.
    pub(crate) key: Option<Arg<Vec<Ident>>>,
    /// The fields a repeat must match, keyed by `fingerprint`.
    pub(crate) fingerprint: Option<Arg<Vec<Ident>>>,
}

impl OnceArgs {
    fn parse(meta: &syn::meta::ParseNestedMeta, errors: &mut Errors) -> syn::Result<OnceArgs> {
        let mut args = OnceArgs {
            key: None,
            fingerprint: None,
        };
        if !meta.input.peek(syn::token::Paren) {
            return Err(meta.error(
                "write `create_once(key = <field>, fingerprint(<fields a repeat must match>))`",
            ));
        }
        meta.parse_nested_meta(|inner| {
            let Some(name) = inner.path.get_ident().cloned() else {
                return Err(inner.error(ONCE_KEYS_HELP));
            };
            match name.to_string().as_str() {
                "key" => {
                    let KeyFields(fields) = inner.value()?.parse()?;
                    Arg::set(&mut args.key, name, fields, errors);
                }
                "fingerprint" => {
                    let content;
                    syn::parenthesized!(content in inner.input);
                    let idents = Punctuated::<Ident, Token![,]>::parse_terminated(&content)?;
                    Arg::set(
                        &mut args.fingerprint,
                        name,
                        idents.into_iter().collect(),
                        errors,
                    );
                }
                _ => {
                    errors.push_at(
                        &name,
                        format!("unknown key `{name}` in create_once(..); {ONCE_KEYS_HELP}"),
                    );
                    skip_meta_value(&inner)?;
                }
            }
            Ok(())
        })?;
        Ok(args)
    }
}

const ONCE_KEYS_HELP: &str =
    "create_once takes `key = <field>` (or `key = (a, b)`) and `fingerprint(<fields a repeat must match>)`";

/// A struct deriving `Versioned`, as written.
pub(crate) struct ModelInput {
    pub(crate) ident: Ident,
    pub(crate) generics: syn::Generics,
    /// `None` when the item is not a struct with named fields (already reported).
    pub(crate) fields: Option<Vec<Field>>,
    /// Where an empty field list `{}` is, for the error that it is empty.
    pub(crate) fields_span: Span,
    /// The diesel table module (`documents`), whose columns the fields name.
    pub(crate) table: Path,
    /// `#[diesel(primary_key(..))]`, keyed by `primary_key`.
    pub(crate) primary_key: Option<Arg<Vec<Ident>>>,
    /// The first `#[versioned(..)]`, if there is one.
    pub(crate) attr: Option<syn::Attribute>,
    pub(crate) tenant: Option<Arg<TenantArg>>,
    pub(crate) version: Option<Arg<Ident>>,
    pub(crate) key: Option<Arg<Vec<Ident>>>,
    pub(crate) state: Option<Arg<Ident>>,
    /// `create_once(..)`, keyed by `create_once`.
    pub(crate) create_once: Option<Arg<OnceArgs>>,
}

/// A struct deriving `VersionedChanges`, as written.
pub(crate) struct ChangesInput {
    pub(crate) ident: Ident,
    pub(crate) generics: syn::Generics,
    /// `None` when the item is not a struct with named fields (already reported).
    pub(crate) fields: Option<Vec<Field>>,
    pub(crate) model: Option<Path>,
    /// `#[versioned(table = ..)]`, else `#[diesel(table_name = ..)]`.
    pub(crate) table: Option<Path>,
}

/// The `(a, b)` or `a` after `key =`.
struct KeyFields(Vec<Ident>);

impl Parse for KeyFields {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        if input.peek(syn::token::Paren) {
            let content;
            syn::parenthesized!(content in input);
            let idents = Punctuated::<Ident, Token![,]>::parse_terminated(&content)?;
            if idents.is_empty() {
                return Err(
                    content.error("`key = ()` names no field; write `key = id` or `key = (a, b)`")
                );
            }
            Ok(KeyFields(idents.into_iter().collect()))
        } else {
            Ok(KeyFields(vec![input.parse()?]))
        }
    }
}

/// What `#[diesel(..)]` says about the struct, as far as idem needs it.
#[derive(Default)]
struct DieselAttrs {
    table_name: Option<Path>,
    primary_key: Option<Arg<Vec<Ident>>>,
}

fn diesel_struct_attrs(attrs: &[syn::Attribute], errors: &mut Errors) -> DieselAttrs {
    let mut out = DieselAttrs::default();
    for attr in attrs.iter().filter(|a| a.path().is_ident("diesel")) {
        let parsed = attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("table_name") {
                out.table_name = Some(meta.value()?.parse()?);
            } else if meta.path.is_ident("primary_key") {
                let content;
                syn::parenthesized!(content in meta.input);
                let idents = Punctuated::<Ident, Token![,]>::parse_terminated(&content)?;
                out.primary_key = Some(Arg {
                    key: meta.path.require_ident()?.clone(),
                    value: idents.into_iter().collect(),
                });
            } else {
                skip_meta_value(&meta)?;
            }
            Ok(())
        });
        if let Err(err) = parsed {
            errors.push(err);
        }
    }
    out
}

/// Other `#[diesel(..)]` keys belong to diesel; step over their values.
fn skip_meta_value(meta: &syn::meta::ParseNestedMeta) -> syn::Result<()> {
    if meta.input.peek(Token![=]) {
        meta.value()?.parse::<syn::Expr>()?;
    } else if meta.input.peek(syn::token::Paren) {
        let content;
        syn::parenthesized!(content in meta.input);
        content.parse::<TokenStream>()?;
    }
    Ok(())
}

fn column_name(field: &syn::Field, errors: &mut Errors) -> Option<Ident> {
    let mut column = None;
    for attr in field.attrs.iter().filter(|a| a.path().is_ident("diesel")) {
        let parsed = attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("column_name") {
                column = Some(meta.value()?.parse::<Ident>()?);
            } else {
                skip_meta_value(&meta)?;
            }
            Ok(())
        });
        if let Err(err) = parsed {
            errors.push(err);
        }
    }
    column
}

/// The struct's named fields, or `None` (reported at the offending token) when
/// the item is a tuple or unit struct, an enum or a union.
fn named_fields(input: &DeriveInput, derive: &str, errors: &mut Errors) -> Option<Vec<Field>> {
    let ident = &input.ident;
    let example = format!("`struct {ident} {{ id: i64, .. }}`");
    let named = match &input.data {
        Data::Struct(data) => match &data.fields {
            Fields::Named(named) => named,
            Fields::Unnamed(unnamed) => {
                errors.push_at(
                    unnamed,
                    format!("#[derive({derive})] needs named fields, one per column, but `{ident}` is a tuple struct; write it as {example}"),
                );
                return None;
            }
            Fields::Unit => {
                errors.push_at(
                    ident,
                    format!("#[derive({derive})] needs named fields, one per column, but `{ident}` is a unit struct; write it as {example}"),
                );
                return None;
            }
        },
        Data::Enum(data) => {
            errors.push_at(
                data.enum_token,
                format!("#[derive({derive})] needs a struct with named fields, one per column, not an enum; write {example}"),
            );
            return None;
        }
        Data::Union(data) => {
            errors.push_at(
                data.union_token,
                format!("#[derive({derive})] needs a struct with named fields, one per column, not a union; write {example}"),
            );
            return None;
        }
    };
    let fields = named
        .named
        .iter()
        // Named fields always have a name.
        .filter_map(|f| {
            let ident = f.ident.clone()?;
            Some(Field {
                column: column_name(f, errors).unwrap_or_else(|| ident.clone()),
                ident,
                ty: f.ty.clone(),
            })
        })
        .collect();
    Some(fields)
}

fn fields_span(input: &DeriveInput) -> Span {
    match &input.data {
        Data::Struct(data) => data.fields.span(),
        _ => input.ident.span(),
    }
}

/// diesel's default table name: the struct name in snake case, plus `s`.
fn inferred_table(ident: &Ident) -> Path {
    let mut snake = String::new();
    for (i, ch) in ident.to_string().chars().enumerate() {
        if ch.is_uppercase() {
            if i > 0 {
                snake.push('_');
            }
            snake.extend(ch.to_lowercase());
        } else {
            snake.push(ch);
        }
    }
    snake.push('s');
    Ident::new(&snake, ident.span()).into()
}

impl ModelInput {
    pub(crate) fn parse(input: &DeriveInput, errors: &mut Errors) -> ModelInput {
        let fields = named_fields(input, "Versioned", errors);
        let diesel = diesel_struct_attrs(&input.attrs, errors);

        let mut tenant: Option<Arg<TenantArg>> = None;
        let mut version: Option<Arg<Ident>> = None;
        let mut key: Option<Arg<Vec<Ident>>> = None;
        let mut state: Option<Arg<Ident>> = None;
        let mut create_once: Option<Arg<OnceArgs>> = None;
        let mut first_attr: Option<&syn::Attribute> = None;
        for attr in input
            .attrs
            .iter()
            .filter(|a| a.path().is_ident("versioned"))
        {
            first_attr.get_or_insert(attr);
            let parsed = attr.parse_nested_meta(|meta| {
                let Some(name) = meta.path.get_ident().cloned() else {
                    return Err(meta.error(format!("expected one of {MODEL_KEYS}")));
                };
                match name.to_string().as_str() {
                    "tenant" => {
                        let value: Ident = meta.value()?.parse()?;
                        let value = if value == "none" { TenantArg::None } else { TenantArg::Field(value) };
                        Arg::set(&mut tenant, name, value, errors);
                    }
                    "version" => Arg::set(&mut version, name, meta.value()?.parse()?, errors),
                    "key" => {
                        let KeyFields(fields) = meta.value()?.parse()?;
                        Arg::set(&mut key, name, fields, errors);
                    }
                    "state" => Arg::set(&mut state, name, meta.value()?.parse()?, errors),
                    "create_once" => {
                        let args = OnceArgs::parse(&meta, errors)?;
                        Arg::set(&mut create_once, name, args, errors);
                    }
                    _ => {
                        errors.push_at(&name, format!("unknown key `{name}` in #[versioned(..)]; the valid keys are {MODEL_KEYS}"));
                        skip_meta_value(&meta)?;
                    }
                }
                Ok(())
            });
            if let Err(err) = parsed {
                errors.push(err);
            }
        }

        ModelInput {
            ident: input.ident.clone(),
            generics: input.generics.clone(),
            fields,
            fields_span: fields_span(input),
            table: diesel
                .table_name
                .unwrap_or_else(|| inferred_table(&input.ident)),
            primary_key: diesel.primary_key,
            attr: first_attr.cloned(),
            tenant,
            version,
            key,
            state,
            create_once,
        }
    }
}

impl ChangesInput {
    pub(crate) fn parse(input: &DeriveInput, errors: &mut Errors) -> ChangesInput {
        let fields = named_fields(input, "VersionedChanges", errors);
        let diesel = diesel_struct_attrs(&input.attrs, errors);
        let mut model: Option<Arg<Path>> = None;
        let mut table: Option<Arg<Path>> = None;
        for attr in input
            .attrs
            .iter()
            .filter(|a| a.path().is_ident("versioned"))
        {
            let parsed = attr.parse_nested_meta(|meta| {
                let Some(name) = meta.path.get_ident().cloned() else {
                    return Err(meta.error(format!("expected one of {CHANGES_KEYS}")));
                };
                match name.to_string().as_str() {
                    "model" => Arg::set(&mut model, name, meta.value()?.parse()?, errors),
                    "table" => Arg::set(&mut table, name, meta.value()?.parse()?, errors),
                    _ => {
                        errors.push_at(&name, format!("unknown key `{name}` in #[versioned(..)] of a changeset; the valid keys are {CHANGES_KEYS}"));
                        skip_meta_value(&meta)?;
                    }
                }
                Ok(())
            });
            if let Err(err) = parsed {
                errors.push(err);
            }
        }
        ChangesInput {
            ident: input.ident.clone(),
            generics: input.generics.clone(),
            fields,
            model: model.map(|m| m.value),
            table: table.map(|t| t.value).or(diesel.table_name),
        }
    }
}
