//! The one integration-test binary: one module per capability.

// This whole crate is test code: helpers unwrap like tests do.
#![allow(clippy::unwrap_used, clippy::many_single_char_names, clippy::items_after_statements)]

mod architecture;
mod bench;
mod canonical;
mod catalog;
mod cli;
mod clock;
mod console;
mod crash;
mod demo;
mod dispatch;
mod failpoints;
mod gateway;
mod holds;
mod hostile;
mod http;
mod invariants;
mod lab;
mod late;
mod mcp;
mod observability;
mod partition;
mod pg;
mod props;
mod race;
mod recovery;
mod resend;
mod resilience;
mod retention;
mod scenarios;
mod serve;
mod support;
mod tamper;
