//! Failpoints for crash tests: `TOOLGATE_FAILPOINT=NAME` makes the process abort
//! (no unwinding, no destructors) when execution reaches the named point.
//!
//! Points: `inside_accept`, `after_claim`, `after_sent`, `before_persist`,
//! `inside_reconcile`. The variable is read once per process.

use std::sync::OnceLock;

static ARMED: OnceLock<Option<String>> = OnceLock::new();

/// Aborts the process if the failpoint `name` is armed.
pub fn hit(name: &str) {
    let armed = ARMED.get_or_init(|| std::env::var("TOOLGATE_FAILPOINT").ok().filter(|s| !s.is_empty()));
    if armed.as_deref() == Some(name) {
        std::process::abort();
    }
}
