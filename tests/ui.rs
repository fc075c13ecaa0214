//! Compile-time promises of the macros: every mistake they promise to reject has
//! a case under `tests/ui/<macro>/fail` with the exact message, and the unusual
//! shapes they promise to accept have one under `tests/ui/<macro>/pass`.
//!
//! Bless changed messages with `TRYBUILD=overwrite cargo test --test ui`, then
//! read every `.stderr` that changed: it is what a user will see.

#[test]
fn versioned() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/versioned/pass/*.rs");
    t.compile_fail("tests/ui/versioned/fail/*.rs");
}

#[test]
fn states() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/states/pass/*.rs");
    t.compile_fail("tests/ui/states/fail/*.rs");
}
