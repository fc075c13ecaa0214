//! Compile-time promises of `#[idempotent]`: every mistake in its attribute or
//! its function is rejected with a message at the place of the mistake (cases
//! under `tests/ui/idempotent/fail`, with the exact message), and the shapes it
//! promises to accept compile without a warning (`tests/ui/idempotent/pass`).
//!
//! Bless changed messages with `TRYBUILD=overwrite cargo test --test ui_idempotent`,
//! then read every `.stderr` that changed: it is what a user will see.

#[test]
fn idempotent() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/idempotent/pass/*.rs");
    t.compile_fail("tests/ui/idempotent/fail/*.rs");
}
