//! Checks what `parse` read: the item is a non-generic enum of fieldless
//! variants, every name in the table is one of them, and no transition is
//! declared twice. Whatever is wrong is reported at the user's token, with
//! what to write instead.

use syn::spanned::Spanned;
use syn::Ident;

use super::parse::{Shape, StatesInput};
use crate::errors::Errors;

/// A valid state enum: its states and the transitions between them.
pub(crate) struct Machine {
    pub(crate) ident: Ident,
    /// Each variant and the text it is stored as, in declaration order.
    pub(crate) states: Vec<(Ident, String)>,
    /// `(from, to)` as indexes into `states`, in declaration order.
    pub(crate) transitions: Vec<(usize, usize)>,
}

const EXAMPLE: &str = "#[states(Pending => [Paid, Cancelled], Paid => [Shipped])]";

/// `PendingPayment` → `pending_payment`: how a state is stored.
pub(crate) fn state_text(ident: &Ident) -> String {
    let name = ident.to_string();
    let mut text = String::new();
    let mut prev_lower = false;
    for ch in name.chars() {
        if ch.is_uppercase() {
            if prev_lower {
                text.push('_');
            }
            text.extend(ch.to_lowercase());
            prev_lower = false;
        } else {
            text.push(ch);
            prev_lower = ch.is_lowercase() || ch.is_ascii_digit();
        }
    }
    text
}

pub(crate) fn states(input: &StatesInput, errors: &mut Errors) -> Option<Machine> {
    let ident = &input.ident;
    let variants = match &input.shape {
        Shape::Enum(variants) => variants,
        Shape::Other { keyword, span } => {
            errors.push(syn::Error::new(
                *span,
                format!("#[derive(States)] needs a fieldless enum, one variant per state, not {keyword}; write `enum {ident} {{ Pending, Paid, .. }}`"),
            ));
            return None;
        }
    };
    if !input.generics.params.is_empty() {
        errors.push_at(
            &input.generics,
            format!("a #[derive(States)] enum cannot be generic: its states are stored as fixed texts; remove the parameters from `{ident}`"),
        );
    }
    if variants.is_empty() {
        errors.push_at(
            ident,
            format!("`{ident}` has no variants, but a #[derive(States)] enum needs one per state: `enum {ident} {{ Pending, Paid, .. }}`"),
        );
        return None;
    }
    let mut complete = true;
    let mut states: Vec<(Ident, String)> = Vec::new();
    for v in variants {
        if !v.fields.is_empty() {
            let name = &v.ident;
            errors.push(syn::Error::new(
                v.fields.span(),
                format!("state `{name}` carries data, but a state is stored as its name in one text column; make it a plain variant: `{name},`"),
            ));
            complete = false;
        }
        let text = state_text(&v.ident);
        if let Some((other, _)) = states.iter().find(|(_, t)| *t == text) {
            errors.push_at(
                &v.ident,
                format!(
                    "states `{other}` and `{}` would both be stored as \"{text}\"; rename one",
                    v.ident
                ),
            );
            complete = false;
        }
        states.push((v.ident.clone(), text));
    }

    if input.attr.is_none() {
        errors.push_at(
            ident,
            format!("#[derive(States)] needs the allowed transitions, declared once on the enum: {EXAMPLE}"),
        );
        return None;
    }
    let mut transitions: Vec<(usize, usize)> = Vec::new();
    let find = |name: &Ident, errors: &mut Errors| {
        let found = states.iter().position(|(s, _)| s == name);
        if found.is_none() {
            let names: Vec<String> = states.iter().map(|(s, _)| format!("`{s}`")).collect();
            errors.push_at(
                name,
                format!(
                    "`{name}` is not a state of `{ident}`; its states are {}",
                    names.join(", ")
                ),
            );
        }
        found
    };
    for rule in &input.rules {
        let from = find(&rule.from, errors);
        if rule.targets.is_empty() {
            errors.push_at(
                &rule.from,
                format!("`{} => []` allows nothing; leave a state without transitions out of #[states(..)]", rule.from),
            );
            complete = false;
        }
        for target in &rule.targets {
            let to = find(target, errors);
            let (Some(from), Some(to)) = (from, to) else {
                complete = false;
                continue;
            };
            if transitions.contains(&(from, to)) {
                errors.push_at(
                    target,
                    format!("the transition `{} => {target}` is declared twice; declare each transition once", rule.from),
                );
                complete = false;
            } else {
                transitions.push((from, to));
            }
        }
    }
    let empty = |a: &syn::Attribute| matches!(&a.meta, syn::Meta::List(l) if l.tokens.is_empty());
    if let Some(attr) = input
        .attr
        .as_ref()
        .filter(|a| input.rules.is_empty() && empty(a))
    {
        errors.push_at(
            attr,
            format!("#[states()] allows no transition; list them: {EXAMPLE}"),
        );
        complete = false;
    }
    complete.then(|| Machine {
        ident: ident.clone(),
        states,
        transitions,
    })
}
