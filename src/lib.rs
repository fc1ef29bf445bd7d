//! toolgate: a durable tool-call dispatcher that executes an AI agent's
//! side-effecting tool calls exactly once in business effect, with an
//! operations console and a CLI over it.
//!
//! This package is the `toolgate` binary and a facade: the work lives in the
//! workspace's crates, one per floor (ARCHITECTURE.md, "Bird's-eye view"), and
//! is re-exported here under the paths the tests, benches, examples and fuzz
//! targets use.
//!
//! - `toolgate-core`: [`engine`], [`store`], [`telemetry`] (the metric model,
//!   exports and Prometheus text), [`failpoint`], [`display`]. Embed this.
//! - `toolgate-adapters`: [`downstream`] (simulated providers, the HTTP
//!   adapter, `provider serve`) and [`tools`] (the demo catalog and domain).
//! - `toolgate-sim`: [`scenarios`], [`load`], [`demo`].
//! - `toolgate-server`: [`api`] (`toolgate serve`) and [`mcp`] (`toolgate mcp`).
//! - `toolgate-console`: [`tui`].
//! - here: [`cli`] (the command line: the binary's only dependency),
//!   [`bench`] (`toolgate bench`) and `telemetry::logging` (the diagnostic log).

pub use toolgate_adapters::{downstream, tools};
pub use toolgate_console::tui;
pub use toolgate_core::{display, failpoint, store, Coded};

/// The core's engine, with the demo world beside its world module under the
/// path it had before the demo domain left the core
/// (`toolgate::engine::world::DEMO_WORLD`).
pub mod engine {
    pub use toolgate_core::engine::*;

    /// The core's world file, and the demo world.
    pub mod world {
        pub use toolgate_adapters::tools::demo::DEMO_WORLD;
        pub use toolgate_core::engine::world::*;
    }
}
pub use toolgate_server::{api, mcp};
pub use toolgate_sim::{demo, load, scenarios};

/// The core's telemetry, with the binary's diagnostic log beside it.
pub mod telemetry {
    pub use toolgate_core::telemetry::*;
    pub mod logging;
}

pub mod bench;
pub mod cli;
