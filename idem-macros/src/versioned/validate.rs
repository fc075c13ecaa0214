//! Checks what `parse` read against the struct: every name must be a field, a
//! field plays one role, and the struct has the shape a table row needs. The
//! result is what could be established; whatever could not was reported, at
//! the user's token, with what to write instead.

use syn::{Ident, Path};

use super::parse::{ChangesInput, Field, ModelInput, OnceArgs, TenantArg};
use crate::errors::Errors;

/// A struct deriving `Versioned`, every role resolved to a field.
pub(crate) struct Model {
    pub(crate) ident: Ident,
    pub(crate) table: Path,
    pub(crate) fields: Vec<Field>,
    /// Index into `fields`; `None` for `tenant = none`.
    pub(crate) tenant: Option<usize>,
    pub(crate) version: usize,
    /// Indexes into `fields`, in key order; never empty.
    pub(crate) key: Vec<usize>,
    pub(crate) state: Option<usize>,
    /// `create_once(..)`, when declared.
    pub(crate) once: Option<Once>,
}

/// `create_once(..)`, resolved.
pub(crate) struct Once {
    /// Indexes into `fields`, in key order; never empty.
    pub(crate) key: Vec<usize>,
    /// Indexes into `fields`, in declaration order.
    pub(crate) fingerprint: Vec<usize>,
    /// The fingerprint's names as written, for spans.
    pub(crate) fingerprint_names: Vec<Ident>,
}

impl Model {
    pub(crate) fn field(&self, index: usize) -> &Field {
        &self.fields[index]
    }
}

/// A struct deriving `VersionedChanges`, with its model and table known.
pub(crate) struct ChangeSet {
    pub(crate) ident: Ident,
    pub(crate) generics: syn::Generics,
    pub(crate) model: Path,
    pub(crate) table: Path,
    pub(crate) fields: Vec<Field>,
}

/// The tenant role, once known.
#[derive(Clone, Copy)]
pub(crate) enum Tenant {
    /// `tenant = none`.
    None,
    /// Index into the fields.
    Field(usize),
}

/// What validation established about a model's roles; `None` where it could
/// not (and said why). Indexes are into `ModelInput::fields`.
pub(crate) struct Roles {
    pub(crate) tenant: Option<Tenant>,
    pub(crate) version: Option<usize>,
    /// Never empty when known.
    pub(crate) key: Option<Vec<usize>>,
    /// `Some(None)`: the model declares no state.
    pub(crate) state: Option<Option<usize>>,
    /// `Some(None)`: the model declares no `create_once`.
    pub(crate) once: Option<Option<Once>>,
}

impl Roles {
    /// The complete model, when every role is known and the struct has fields.
    pub(crate) fn into_model(self, input: ModelInput) -> Option<Model> {
        let key = self.key.filter(|k| !k.is_empty())?;
        Some(Model {
            ident: input.ident,
            table: input.table,
            fields: input.fields?,
            tenant: match self.tenant? {
                Tenant::None => None,
                Tenant::Field(i) => Some(i),
            },
            version: self.version?,
            key,
            state: self.state?,
            once: self.once?,
        })
    }
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

/// Resolves `names` to field indexes; `None` if any is missing or repeated.
fn find_key(
    fields: &[Field],
    names: &[Ident],
    owner: &Ident,
    errors: &mut Errors,
) -> Option<Vec<usize>> {
    let mut indexes = Vec::new();
    let mut complete = true;
    for (n, name) in names.iter().enumerate() {
        if names[..n].contains(name) {
            errors.push_at(
                name,
                format!("`{name}` is named twice in the key; name each key field once"),
            );
            complete = false;
        } else if let Some(i) = find_field(fields, name, owner, errors) {
            indexes.push(i);
        } else {
            complete = false;
        }
    }
    (complete && !indexes.is_empty()).then_some(indexes)
}

pub(crate) fn model(input: &ModelInput, errors: &mut Errors) -> Roles {
    let ident = &input.ident;
    if !input.generics.params.is_empty() {
        errors.push_at(
            &input.generics,
            format!("a #[derive(Versioned)] model cannot be generic: its fields have the fixed types of the table's columns; remove the parameters from `{ident}`"),
        );
    }
    if input.attr.is_none() {
        errors.push_at(
            ident,
            "#[derive(Versioned)] needs #[versioned(tenant = <field>, version = <field>, key = <field>)] on the struct (`tenant = none` for a table without tenants)",
        );
    } else if input.tenant.is_none() {
        errors.push_at(
            &input.attr,
            "#[versioned(..)] must name the tenant: add `tenant = <field>`, or `tenant = none` for a table that has no tenants",
        );
    }
    // What needs no field.
    let mut roles = Roles {
        tenant: match input.tenant.as_ref().map(|t| &t.value) {
            Some(TenantArg::None) => Some(Tenant::None),
            _ => None,
        },
        version: None,
        key: None,
        state: if input.state.is_none() {
            Some(None)
        } else {
            None
        },
        once: if input.create_once.is_none() {
            Some(None)
        } else {
            None
        },
    };
    let Some(fields) = &input.fields else {
        // Not a struct with named fields: that one error says it all.
        return roles;
    };
    if fields.is_empty() {
        errors.push(syn::Error::new(
            input.fields_span,
            format!("`{ident}` has no fields, but a #[derive(Versioned)] model needs one per column, at least its key and its version: `struct {ident} {{ id: i64, version: i64, .. }}`"),
        ));
        return roles;
    }
    // Without the attribute, the one error above is enough: no defaults are checked.
    let seen_attr = input.attr.is_some();

    if let Some(TenantArg::Field(name)) = input.tenant.as_ref().map(|t| &t.value) {
        roles.tenant = find_field(fields, name, ident, errors).map(Tenant::Field);
    }
    roles.version = match &input.version {
        Some(v) => find_field(fields, &v.value, ident, errors),
        None => {
            let found = fields.iter().position(|f| f.ident == "version");
            if found.is_none() && seen_attr {
                errors.push_at(ident, "name the version column: #[versioned(version = <field>)] (no field is called `version`)");
            }
            found
        }
    };
    roles.key = match (&input.key, &input.primary_key) {
        (Some(k), _) => find_key(fields, &k.value, ident, errors),
        (None, Some(pk)) if pk.value.is_empty() => {
            errors.push_at(&pk.key, "`primary_key()` names no column; name the row's key here or with #[versioned(key = <field>)]");
            None
        }
        (None, Some(pk)) => find_key(fields, &pk.value, ident, errors),
        (None, None) => {
            let found = fields.iter().position(|f| f.ident == "id");
            if found.is_none() && seen_attr {
                errors.push_at(ident, "name the row's key: #[versioned(key = <field>)] or key = (a, b) (there is no #[diesel(primary_key(..))] and no field `id`)");
            }
            found.map(|i| vec![i])
        }
    };
    if let Some(s) = &input.state {
        roles.state = find_field(fields, &s.value, ident, errors).map(Some);
    }
    check_roles(input, fields, &roles, errors);
    if let Some(once) = &input.create_once {
        roles.once = create_once(input, fields, &roles, &once.key, &once.value, errors).map(Some);
    }
    roles
}

/// Resolves `create_once(key = .., fingerprint(..))`: the key names fields
/// other than the version and the tenant (which the key includes by itself),
/// and the fingerprint names fields fixed at creation that the key does not
/// already compare.
fn create_once(
    input: &ModelInput,
    fields: &[Field],
    roles: &Roles,
    at: &Ident,
    args: &OnceArgs,
    errors: &mut Errors,
) -> Option<Once> {
    let ident = &input.ident;
    let Some(key) = &args.key else {
        errors.push_at(at, "create_once needs the key: `create_once(key = <field>, fingerprint(..))`, the column(s) under which a repeated create is refused");
        return None;
    };
    let Some(fingerprint) = &args.fingerprint else {
        errors.push_at(at, "create_once needs `fingerprint(<fields>)`: the fields a repeat must match, so that a key reused for another request is refused instead of answered with the first row (write `fingerprint()` if the key alone names the request)");
        return None;
    };
    let key_fields = find_key(fields, &key.value, ident, errors);
    let tenant = match roles.tenant {
        Some(Tenant::Field(i)) => Some(i),
        _ => None,
    };
    let mut complete = key_fields.is_some();
    for (name, &i) in key.value.iter().zip(key_fields.iter().flatten()) {
        let role = if Some(i) == roles.version {
            Some("the version: it is 0 for every new row")
        } else if Some(i) == tenant {
            Some("the tenant, which the key includes already: name only the key column(s)")
        } else if roles.state.flatten() == Some(i) {
            Some("the state, which transitions change: after the first one, a repeat would create a second row")
        } else {
            None
        };
        if let Some(role) = role {
            errors.push_at(
                name,
                format!("`{name}` cannot be a create_once key field: it is {role}"),
            );
            complete = false;
        }
    }
    let mut compared = Vec::new();
    let mut names = Vec::new();
    for (n, name) in fingerprint.value.iter().enumerate() {
        if fingerprint.value[..n].contains(name) {
            errors.push_at(
                name,
                format!("`{name}` is named twice in the fingerprint; name each field once"),
            );
            complete = false;
            continue;
        }
        let Some(i) = find_field(fields, name, ident, errors) else {
            complete = false;
            continue;
        };
        let role = if Some(i) == roles.version {
            Some("the version, which a new row always has at 0 and every update changes")
        } else if Some(i) == tenant {
            Some("the tenant, which the key compares already")
        } else if key_fields.iter().flatten().any(|&k| k == i) {
            Some("a key field, which the key compares already")
        } else if roles.state.flatten() == Some(i) {
            Some("the state, which transitions change: a repeat after the first transition would be refused")
        } else {
            None
        };
        match role {
            Some(role) => {
                errors.push_at(name, format!("`{name}` cannot be in the fingerprint: it is {role}; name the fields the request fixes at creation"));
                complete = false;
            }
            None => {
                compared.push(i);
                names.push(name.clone());
            }
        }
    }
    complete.then(|| Once {
        key: key_fields.unwrap_or_default(),
        fingerprint: compared,
        fingerprint_names: names,
    })
}

/// One column cannot play two roles: the version would then be part of the
/// key, or the tenant assignable as a state.
fn check_roles(input: &ModelInput, fields: &[Field], roles: &Roles, errors: &mut Errors) {
    let mut taken: Vec<(usize, &str)> = Vec::new();
    if let Some(Tenant::Field(i)) = roles.tenant {
        taken.push((i, "tenant"));
    }
    taken.extend(roles.version.map(|i| (i, "version")));
    taken.extend(roles.key.iter().flatten().map(|&i| (i, "key")));
    taken.extend(roles.state.flatten().map(|i| (i, "state")));
    for (n, (index, role)) in taken.iter().enumerate() {
        let Some((_, other)) = taken[..n].iter().find(|(i, _)| i == index) else {
            continue;
        };
        let at = match *role {
            "version" => input.version.as_ref().map(|v| v.value.span()),
            "state" => input.state.as_ref().map(|s| s.value.span()),
            "key" => input.key.as_ref().map(|k| k.key.span()),
            _ => None,
        }
        .unwrap_or_else(|| input.ident.span());
        let field = fields
            .get(*index)
            .map_or("?".to_string(), |f| f.ident.to_string());
        errors.push(syn::Error::new(
            at,
            format!("field `{field}` cannot be both the {other} and the {role}"),
        ));
    }
}

pub(crate) fn changes(input: &ChangesInput, errors: &mut Errors) -> Option<ChangeSet> {
    let ident = &input.ident;
    if input.model.is_none() {
        errors.push_at(ident, "#[derive(VersionedChanges)] needs #[versioned(model = <the #[derive(Versioned)] struct>)]");
    }
    if input.table.is_none() {
        errors.push_at(
            ident,
            "name the table this changeset writes: #[diesel(table_name = <table>)]",
        );
    }
    if input.fields.as_ref().is_some_and(|f| f.is_empty()) {
        errors.push_at(
            ident,
            "a changeset with no fields would only bump the version; give it at least one field",
        );
    }
    Some(ChangeSet {
        ident: ident.clone(),
        generics: input.generics.clone(),
        model: input.model.clone()?,
        table: input.table.clone()?,
        fields: input.fields.clone()?,
    })
}
