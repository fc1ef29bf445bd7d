//! toolgate: a durable tool-call dispatcher that executes an AI agent's
//! side-effecting tool calls exactly once in business effect, with an
//! operations console and a CLI over it.
//!
//! # Layout
//! - [`engine`]: the dispatch pipeline, idempotency ledger, outbox, leases and the
//!   reaper; recovery (explicit status queries, approvals, human review, audit);
//!   contracts, canonical JSON, digests and `status_ref`. UI-free.
//! - [`store`]: the ledger on SQLite (rusqlite, WAL, `BEGIN IMMEDIATE`, STRICT
//!   tables) or PostgreSQL (`postgres`, `SERIALIZABLE`, retried), one set of
//!   queries over a neutral statement layer, numbered migrations per backend;
//!   the simulated providers' own store. The only module with SQL.
//! - [`downstream`]: the adapter trait and the simulated, durable payments and
//!   notifications providers with their fault plans.
//! - [`telemetry`]: the trace export, metrics computed from the database (and
//!   their Prometheus format and `/metrics` endpoint), the diagnostic log.
//! - [`failpoint`]: named crash points for crash tests.
//! - [`scenarios`]: the `create_refund` scenarios of docs/design.md §13 as data
//!   (`assets/scenarios/`), and a stepper that runs them on a fresh database.
//! - [`tui`]: the operations console (ratatui): panes, keys, popups, the
//!   walkthrough; a client of the engine that never writes the database itself.
//! - [`demo`]: the deterministic demo database and its re-based working copy.
//! - [`load`]: simulated agents that dispatch like real harnesses.
//! - [`bench`]: `toolgate bench`, the engine against bare loops doing the same
//!   commits on the same backend, side by side.
//! - [`display`]: stored text shown to people safely (digests checked before
//!   they are shortened, control characters escaped, durations in days).
//! - [`api`]: `toolgate serve`, the authenticated HTTP API (axum): bearer
//!   tokens resolved at every request, engine threads, the envelope's status table.
//! - [`mcp`]: `toolgate mcp`, the Model Context Protocol server (rmcp, stdio):
//!   catalog tools with an idempotency key, `query_operation_status`.
//! - [`cli`]: the command line (the binary's only dependency on this crate).

pub use toolgate_adapters::{downstream, tools};
pub use toolgate_console::tui;
pub use toolgate_core::{display, engine, failpoint, store};
pub use toolgate_server::{api, mcp};
pub use toolgate_sim::{demo, load, scenarios};

/// The core's telemetry, with the binary's diagnostic log beside it.
pub mod telemetry {
    pub use toolgate_core::telemetry::*;
    pub mod logging;
}

pub mod bench;
pub mod cli;
