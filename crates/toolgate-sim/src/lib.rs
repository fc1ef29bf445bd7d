//! toolgate's simulations, above the adapters: runs of the engine over the
//! demo tools that the tests, the CLI and the console share.
//!
//! - [`scenarios`]: the `create_refund` scenarios of docs/design.md §13 as
//!   data (`assets/scenarios/`, embedded) and a stepper that runs them on a
//!   fresh database, crashes included.
//! - [`load`]: simulated agents that dispatch like real harnesses (in process
//!   or over HTTP), and the referee that counts their effects.
//! - [`demo`]: the deterministic demo database and its re-based working copy.

pub mod demo;
pub mod load;
pub mod scenarios;

// The floors below under the names the files above use (`crate::engine::…`).
use toolgate_adapters::{downstream, tools};
use toolgate_core::{display, engine, store};
