//! toolgate's servers, above the core: the doors agents and operators come
//! through, over the engine-thread pool.
//!
//! - [`api`]: `toolgate serve`, the authenticated HTTP API (axum on hyper):
//!   bearer tokens resolved at every request, engine threads, `/metrics`, and
//!   MCP's streamable HTTP transport mounted at `/mcp`.
//! - [`mcp`]: `toolgate mcp`, the Model Context Protocol server (rmcp, stdio
//!   or HTTP): catalog tools with an idempotency key, `query_operation_status`.
//! - [`pool`]: the engine threads both servers hand their work to.
//! - [`status`]: the envelope's HTTP status table and the servers' own codes.
//!
//! `api` mounts `mcp`; `mcp` reaches only the shared modules here, never
//! `api`.

pub mod api;
pub mod mcp;
pub mod pool;
pub mod shutdown;
pub mod status;

/// Largest request body: the engine's own limit on a call's arguments.
pub const MAX_BODY_BYTES: usize = toolgate_core::engine::canonical::MAX_INPUT_BYTES;

// The core's modules under the names the files above use (`crate::engine::…`).
use toolgate_core::{engine, store, telemetry};
