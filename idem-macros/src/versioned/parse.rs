//! Reads a model or a changeset struct into a typed description, checking every
//! name it refers to. Nothing here generates code.

use proc_macro2::{Span, TokenStream};
use syn::parse::{Parse, ParseStream};
use syn::punctuated::Punctuated;
use syn::{Data, DeriveInput, Fields, Ident, Path, Token, Type};

use crate::errors::Errors;

const MODEL_KEYS: &str = "`tenant`, `version`, `key` and `state`";
const CHANGES_KEYS: &str = "`model` and `table`";

/// One field of the struct and the column it maps to.
pub(crate) struct Field {
    pub(crate) ident: Ident,
    pub(crate) ty: Type,
    /// `#[diesel(column_name = ..)]`, or the field's own name.
    pub(crate) column: Ident,
}

/// A struct deriving `Versioned`.
pub(crate) struct Model {
    pub(crate) ident: Ident,
    /// The diesel table module (`documents`), whose columns the fields name.
    pub(crate) table: Path,
    pub(crate) fields: Vec<Field>,
    /// Index into `fields`; `None` for `tenant = none`.
    pub(crate) tenant: Option<usize>,
    pub(crate) version: usize,
    /// Indexes into `fields`, in key order.
    pub(crate) key: Vec<usize>,
    pub(crate) state: Option<usize>,
}

/// A struct deriving `VersionedChanges`.
pub(crate) struct ChangeSet {
    pub(crate) ident: Ident,
    pub(crate) generics: syn::Generics,
    pub(crate) model: Path,
    pub(crate) table: Path,
    pub(crate) fields: Vec<Field>,
}

/// `tenant = tenant_id` or `tenant = none`.
enum TenantArg {
    Field(Ident),
    None,
}

/// A key of `#[versioned(..)]` as written, kept for spans.
struct Arg<T> {
    key: Ident,
    value: T,
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
    primary_key: Option<Vec<Ident>>,
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
                out.primary_key = Some(idents.into_iter().collect());
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

fn named_fields(input: &DeriveInput, derive: &str, errors: &mut Errors) -> Vec<Field> {
    let fields = match &input.data {
        Data::Struct(data) => match &data.fields {
            Fields::Named(named) => &named.named,
            _ => {
                errors.push_at(
                    &input.ident,
                    format!("#[derive({derive})] needs a struct with named fields"),
                );
                return Vec::new();
            }
        },
        _ => {
            errors.push_at(
                &input.ident,
                format!("#[derive({derive})] needs a struct with named fields"),
            );
            return Vec::new();
        }
    };
    fields
        .iter()
        .map(|f| {
            let ident = f.ident.clone().expect("named fields have names");
            Field {
                column: column_name(f, errors).unwrap_or_else(|| ident.clone()),
                ident,
                ty: f.ty.clone(),
            }
        })
        .collect()
}

fn find_field(fields: &[Field], name: &Ident, owner: &Ident, errors: &mut Errors) -> Option<usize> {
    let found = fields.iter().position(|f| f.ident == *name);
    if found.is_none() {
        let names: Vec<String> = fields.iter().map(|f| format!("`{}`", f.ident)).collect();
        errors.push_at(
            name,
            format!(
                "`{owner}` has no field `{name}`; its fields are {}",
                names.join(", ")
            ),
        );
    }
    found
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

impl Model {
    pub(crate) fn from_input(input: &DeriveInput) -> syn::Result<Model> {
        let mut errors = Errors::default();
        if !input.generics.params.is_empty() {
            errors.push_at(
                &input.generics,
                "a #[derive(Versioned)] model cannot be generic",
            );
        }
        let fields = named_fields(input, "Versioned", &mut errors);
        let diesel = diesel_struct_attrs(&input.attrs, &mut errors);

        let mut tenant: Option<Arg<TenantArg>> = None;
        let mut version: Option<Arg<Ident>> = None;
        let mut key: Option<Arg<KeyFields>> = None;
        let mut state: Option<Arg<Ident>> = None;
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
                        Arg::set(&mut tenant, name, value, &mut errors);
                    }
                    "version" => Arg::set(&mut version, name, meta.value()?.parse()?, &mut errors),
                    "key" => Arg::set(&mut key, name, meta.value()?.parse()?, &mut errors),
                    "state" => Arg::set(&mut state, name, meta.value()?.parse()?, &mut errors),
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

        let seen_attr = first_attr.is_some();
        match first_attr {
            None => errors.push_at(
                &input.ident,
                "#[derive(Versioned)] needs #[versioned(tenant = <field>, version = <field>, key = <field>)] on the struct (`tenant = none` for a table without tenants)",
            ),
            Some(attr) if tenant.is_none() => errors.push_at(
                attr,
                "#[versioned(..)] must name the tenant: add `tenant = <field>`, or `tenant = none` for a table that has no tenants",
            ),
            Some(_) => {}
        }

        let ident = &input.ident;
        let tenant_index = match tenant.as_ref().map(|t| &t.value) {
            Some(TenantArg::Field(name)) => find_field(&fields, name, ident, &mut errors),
            _ => None,
        };
        let version_index = match &version {
            Some(v) => find_field(&fields, &v.value, ident, &mut errors),
            None => {
                let found = fields.iter().position(|f| f.ident == "version");
                if found.is_none() && !fields.is_empty() && seen_attr {
                    errors.push_at(ident, "name the version column: #[versioned(version = <field>)] (no field is called `version`)");
                }
                found
            }
        };
        let key_names: Vec<Ident> = match (&key, diesel.primary_key) {
            (Some(k), _) => k.value.0.clone(),
            (None, Some(pk)) => pk,
            (None, None) => match fields.iter().find(|f| f.ident == "id") {
                Some(f) => vec![f.ident.clone()],
                None => {
                    if !fields.is_empty() && seen_attr {
                        errors.push_at(ident, "name the row's key: #[versioned(key = <field>)] or key = (a, b) (there is no #[diesel(primary_key(..))] and no field `id`)");
                    }
                    Vec::new()
                }
            },
        };
        let key_indexes: Vec<usize> = key_names
            .iter()
            .filter_map(|k| find_field(&fields, k, ident, &mut errors))
            .collect();
        let state_index = state
            .as_ref()
            .and_then(|s| find_field(&fields, &s.value, ident, &mut errors));

        // One column cannot play two roles: the version would then be part of the
        // key, or the tenant assignable as a state.
        let mut roles: Vec<(usize, &str)> = Vec::new();
        roles.extend(tenant_index.map(|i| (i, "tenant")));
        roles.extend(version_index.map(|i| (i, "version")));
        roles.extend(key_indexes.iter().map(|&i| (i, "key")));
        roles.extend(state_index.map(|i| (i, "state")));
        for (n, (index, role)) in roles.iter().enumerate() {
            if let Some((_, other)) = roles[..n].iter().find(|(i, _)| i == index) {
                let field = &fields[*index].ident;
                let at = match *role {
                    "version" => version.as_ref().map(|v| v.value.span()),
                    "state" => state.as_ref().map(|s| s.value.span()),
                    "key" => key.as_ref().map(|k| k.key.span()),
                    _ => None,
                }
                .unwrap_or_else(|| input.ident.span());
                errors.push(syn::Error::new(
                    at,
                    format!("field `{field}` cannot be both the {other} and the {role}"),
                ));
            }
        }

        let table = diesel
            .table_name
            .unwrap_or_else(|| inferred_table(&input.ident));
        let model = Model {
            ident: input.ident.clone(),
            table,
            fields,
            tenant: tenant_index,
            version: version_index.unwrap_or(0),
            key: key_indexes,
            state: state_index,
        };
        errors.finish(model)
    }

    pub(crate) fn field(&self, index: usize) -> &Field {
        &self.fields[index]
    }
}

impl ChangeSet {
    pub(crate) fn from_input(input: &DeriveInput) -> syn::Result<ChangeSet> {
        let mut errors = Errors::default();
        let fields = named_fields(input, "VersionedChanges", &mut errors);
        let diesel = diesel_struct_attrs(&input.attrs, &mut errors);
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
                    "model" => Arg::set(&mut model, name, meta.value()?.parse()?, &mut errors),
                    "table" => Arg::set(&mut table, name, meta.value()?.parse()?, &mut errors),
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
        if model.is_none() {
            errors.push_at(&input.ident, "#[derive(VersionedChanges)] needs #[versioned(model = <the #[derive(Versioned)] struct>)]");
        }
        let table = match (table, diesel.table_name) {
            (Some(t), _) => Some(t.value),
            (None, Some(t)) => Some(t),
            (None, None) => {
                errors.push_at(
                    &input.ident,
                    "name the table this changeset writes: #[diesel(table_name = <table>)]",
                );
                None
            }
        };
        if fields.is_empty() && matches!(input.data, Data::Struct(_)) {
            errors.push_at(&input.ident, "a changeset with no fields would only bump the version; give it at least one field");
        }
        let placeholder = || Path::from(Ident::new("__idem_missing", Span::call_site()));
        let changes = ChangeSet {
            ident: input.ident.clone(),
            generics: input.generics.clone(),
            model: model.map(|m| m.value).unwrap_or_else(placeholder),
            table: table.unwrap_or_else(placeholder),
            fields,
        };
        errors.finish(changes)
    }
}
