//! The one integration-test binary: one module per capability.

mod canonical;
mod cli;
mod dispatch;
mod recovery;
mod support;
