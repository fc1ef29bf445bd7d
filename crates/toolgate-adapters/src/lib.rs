//! toolgate's adapters, one floor above the core: what implements the core's
//! `Downstream` and `ToolDomain` traits for the tools toolgate ships.
//!
//! - [`downstream`]: the simulated, durable payments and notifications
//!   providers with their fault plans; the HTTP adapter (a real service, its
//!   key header and lookup); `toolgate provider serve`, the simulated
//!   providers as a separate HTTP service.
//! - [`tools`]: the demo catalog (`assets/catalog/`, embedded) with its domain,
//!   and the toolsets that put a catalog together with its domains and
//!   adapters (`tools::load_toolset`, `tools::demo_options`).

pub mod downstream;
pub mod tools;

// The core's modules under the names the files above use (`crate::engine::…`).
use toolgate_core::{display, engine, failpoint, store};
