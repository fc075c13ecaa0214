//! The ledger example over real HTTP against a real PostgreSQL, one server
//! and database per test.
//!
//! * `books`: concurrency, idempotency and If-Match keep the books right.
//! * `limits`: amounts, currencies and metadata are bounded and validated
//!   before anything is written; no balance overflows.
//! * `problems`: a 500 is logged with its cause.

#[path = "../../examples/ledger/app/mod.rs"]
#[allow(dead_code)]
mod app;
#[path = "../../examples/ledger/testkit.rs"]
#[allow(dead_code)]
mod testkit;

mod books;
mod limits;
mod problems;

const EUR: &str = "EUR";
