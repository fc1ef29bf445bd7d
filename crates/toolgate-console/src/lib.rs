//! toolgate's operations console, the top floor but the binary: a ratatui
//! application in The Elm Architecture (`tui::app` is the model and its
//! update, `tui::ui` the view, `tui::backend` the engine threads it talks to).
//! A client of the engine: it reads views and asks the engine to act, and
//! never writes the database itself.

pub mod tui;

// The floors below under the names the files above use (`crate::engine::…`).
use toolgate_adapters::tools;
use toolgate_core::{display, engine, store, telemetry};
use toolgate_sim::{load, scenarios};
