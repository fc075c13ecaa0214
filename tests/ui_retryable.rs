//! Compile-time promises of `#[retryable]`: every mistake it promises to reject
//! has a case under `tests/ui/retryable/fail` with the exact message, and the
//! unusual shapes it promises to accept have one under `tests/ui/retryable/pass`.
//!
//! Bless changed messages with `TRYBUILD=overwrite cargo test --test ui_retryable`,
//! then read every `.stderr` that changed: it is what a user will see.

#[test]
fn retryable() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/retryable/pass/*.rs");
    t.compile_fail("tests/ui/retryable/fail/*.rs");
}
