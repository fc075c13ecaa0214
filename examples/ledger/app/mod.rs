//! The ledger service: shared by `examples/ledger.rs` and the ledger tests.

pub mod admin;
pub mod api;
pub mod errors;
pub mod guard;
pub mod limits;
pub mod ops;
pub mod schema;
