//! The procedural macros of `idem`. Use them through the `idem` crate, whose
//! documentation describes what each one guarantees.
//!
//! Every macro keeps parsing, validation and generation apart: `parse` turns
//! tokens into a typed description (keeping the user's tokens for spans),
//! reporting every mistake at once; `expand` only reads that description.

mod attrs;
mod errors;
mod idempotent;
mod retryable;
mod states;
#[cfg(test)]
mod test_support;
mod versioned;

use proc_macro::TokenStream;

/// Makes a Diesel model's every write a compare-and-set on its version column.
///
/// ```text
/// #[derive(Queryable, Selectable, Versioned)]
/// #[diesel(table_name = documents)]
/// #[versioned(tenant = tenant_id, version = version, key = document_id, state = status)]
/// struct Document { tenant_id: i64, document_id: i64, body: Value, status: String, version: i64 }
/// ```
///
/// Keys of `#[versioned(..)]`: `tenant` (required: a field, or `none`),
/// `version` (default: the field `version`; `i16`, `i32` or `i64`), `key`
/// (a field or `(a, b)`; default `#[diesel(primary_key(..))]`, else `id`),
/// `state` (optional, for guarded transitions). It implements
/// `idem::Versioned`, whose `find`, `update`, `delete` and `insert` are the
/// whole API; the `idem` crate's documentation has a compiled example.
#[proc_macro_derive(Versioned, attributes(versioned, diesel))]
pub fn derive_versioned(input: TokenStream) -> TokenStream {
    versioned::derive_model(input.into()).into()
}

/// The columns one versioned update assigns:
/// `#[versioned(model = Document)] #[diesel(table_name = documents)]` on a
/// struct whose fields are named like the model's. Every field is assigned
/// (so the statement has one fixed shape and is prepared once); the version,
/// tenant and key columns cannot be; and the struct is deliberately not a
/// diesel `AsChangeset`, so `diesel::update(..).set(&changes)` does not compile.
#[proc_macro_derive(VersionedChanges, attributes(versioned, diesel))]
pub fn derive_versioned_changes(input: TokenStream) -> TokenStream {
    versioned::derive_changes(input.into()).into()
}

/// Declares a state enum's allowed transitions once, on the enum.
///
/// ```text
/// #[derive(Debug, Clone, Copy, PartialEq, Eq, States)]
/// #[states(Pending => [Paid, Cancelled], Paid => [Shipped])]
/// enum OrderStatus { Pending, Paid, Shipped, Cancelled }
/// ```
///
/// Implements `idem::versioned::StateMachine` (the states, the transitions,
/// `allowed(from, to)`, the stored text: the variant's name in snake case)
/// and maps the enum to a diesel `Text` column, so that it can be a
/// `#[derive(Versioned)]` model's `state = ..` field, where
/// `Model::update(key)...transition(from, to)` refuses an edge the table does
/// not list before any SQL. The enum must be fieldless and not generic, and
/// derive `Clone`, `Debug` and `PartialEq`; `From => To` is a one-target rule.
#[proc_macro_derive(States, attributes(states))]
pub fn derive_states(input: TokenStream) -> TokenStream {
    states::derive_states(input.into()).into()
}

/// Turns an `async fn` whose body is one attempt of a transaction into a retry
/// loop over a pool.
///
/// ```text
/// #[retryable(max = 4, deadline_ms = 800)]
/// async fn transfer(conn: &mut AsyncPgConnection, cmd: &Transfer) -> Result<Receipt, AppError> { .. }
/// // called as transfer(&pool, &cmd): the connection parameter takes an `&idem::Pool`
/// ```
///
/// Keys: `max` (attempts, default 4), `deadline_ms` (default 800),
/// `backoff_base_ms` (10), `backoff_cap_ms` (150), `isolation`
/// (`read_committed`, `repeatable_read`, `serializable`), `on_conflict`
/// (`retry`, `lock`), `retry_lock_not_available` (false),
/// `commit_timeout_ms` (10 000), `hot_row_memory_ms` (10 000, with
/// `on_conflict = lock`) and `policy = <expr>` (an
/// `idem::RetryPolicy` built at run time, the other keys applied on top). The
/// error type implements `From<idem::Error>` (which failures are replayed is
/// decided by what failed on the attempt, not by the error type);
/// by-value arguments must be `Clone`, `&mut` arguments are refused, since the
/// body runs again on every attempt. See `idem::retry` for the semantics.
#[proc_macro_attribute]
pub fn retryable(args: TokenStream, item: TokenStream) -> TokenStream {
    retryable::retryable(args.into(), item.into()).into()
}

/// Gives a request one effect however often it arrives: claim the key before
/// acting, replay the first result, refuse a different request under the
/// same key.
///
/// ```text
/// #[idempotent(key = cmd.idempotency_key, scope = (ctx.tenant_id, ctx.user_id),
///              fingerprint(cmd.amount, cmd.currency, cmd.merchant))]
/// #[retryable(max = 4, deadline_ms = 800)]
/// async fn create_payment(conn: &mut AsyncPgConnection, ctx: &Ctx, cmd: &PaymentCmd) -> Result<Payment, AppError> { .. }
/// // called as create_payment(&pool, &ctx, &cmd) -> Result<idem::Idempotent<Payment>, AppError>
/// ```
///
/// Keys: `key = <expr>` (a string or `Option`; derived from scope, operation
/// and fingerprint when left out), `scope = <expr>`, `fingerprint(a, b.c, ..)`
/// (parameters or their fields; default every parameter), `operation = "name"`
/// (default the function's path), `mode = local | external`, `ttl_s`
/// (86 400), `lease_ms` (30 000), `wait_ms` (0), `max_response_bytes`
/// (65 536), `config = <expr>` (an `idem::IdempotencyConfig`) and, with
/// feature `redis`, `cache = <expr>` (an `idem::idempotency::ReplayCache`,
/// a reference, `Arc` or `Option` of one). Stacks with
/// `#[retryable]` in either order. The error type implements
/// `idem::IdempotentError`. See `idem::idempotency` for the semantics.
#[proc_macro_attribute]
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    idempotent::idempotent(args.into(), item.into()).into()
}

/// The settings each attribute's documentation lists are the ones its parser
/// takes: a key added to a parser and not to the documentation fails here.
#[cfg(test)]
mod documented_keys {
    /// The documentation of the entry point `name`.
    fn doc_of(name: &str) -> &'static str {
        let source = include_str!("lib.rs");
        let entry = source
            .find(&format!("pub fn {name}("))
            .expect("the entry point");
        let start = source[..entry].rfind("}\n\n").expect("the item before");
        &source[start..entry]
    }

    /// The keys a parser's `KEYS` list names, as backticked words.
    fn keys(list: &str) -> Vec<&str> {
        list.split('`')
            .skip(1)
            .step_by(2)
            .map(|key| key.trim_end_matches("(..)"))
            .collect()
    }

    fn check(name: &str, list: &str) {
        let doc = doc_of(name);
        for key in keys(list) {
            assert!(
                doc.contains(&format!("`{key}")),
                "#[{name}] takes `{key}`, which its documentation does not list"
            );
        }
    }

    #[test]
    fn retryable_lists_every_key() {
        check("retryable", crate::retryable::parse::KEYS);
    }

    #[test]
    fn idempotent_lists_every_key() {
        check("idempotent", crate::idempotent::parse::KEYS);
    }
}
