//! toolgate's ground floor: everything that decides what happened to a tool
//! call, and nothing that talks to a person or a network peer. It depends on no
//! terminal, HTTP server, MCP or CLI crate (the workspace's manifests keep it
//! so; `tests/it/architecture.rs` states the table).
//!
//! - [`engine`]: the dispatch pipeline, idempotency ledger, outbox, leases and
//!   the reaper; recovery (explicit status queries, approvals, human review,
//!   audit); contracts, canonical JSON, digests and `status_ref`; the
//!   `ToolDomain` and `Downstream` traits the floors above implement.
//! - [`store`]: the ledger on SQLite (rusqlite, WAL, `BEGIN IMMEDIATE`, STRICT
//!   tables) or PostgreSQL (`postgres`), one set of queries over a neutral
//!   statement layer, numbered migrations per backend; the simulated
//!   providers' own store. The ledger's only SQL (a domain's own tables are
//!   queried through `store::DomainTx` from its own store module).
//! - [`telemetry`]: the trace export, metrics computed from the database, their
//!   Prometheus text format.
//! - [`failpoint`]: named crash points for crash tests.
//! - [`display`]: stored text shown to people safely (digests checked before
//!   they are shortened, control characters escaped, money, durations).

pub mod display;
pub mod engine;
pub mod failpoint;
pub mod store;
pub mod telemetry;

/// An error with a stable code (`DB_BUSY`, `INVALID_ARGUMENTS`, ...): what
/// scripts and agents match on, the same on the CLI, the HTTP API and MCP.
/// Every error type of every floor implements it; its message is for people.
pub trait Coded: std::error::Error {
    /// The stable code.
    fn code(&self) -> &'static str;
}
