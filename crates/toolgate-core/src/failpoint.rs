//! Failpoints for crash tests: `TOOLGATE_FAILPOINT=NAME` makes the process abort
//! (no unwinding, no destructors) when execution reaches the named point.
//!
//! Points, in pipeline order: `inside_accept` (the accept transaction is open),
//! `after_claim` (lease held, nothing sent), `after_sent` (sent-marker committed,
//! downstream not called), `after_provider_commit` (inside the simulated provider,
//! its effect committed), `before_persist` (reply in hand, not stored),
//! `inside_reconcile` (a status query's backfill transaction is open). The
//! variable is read once per process. `NAME:stop` stops the process there
//! instead of aborting it (a hung host, for the PostgreSQL bounds tests).

use std::sync::OnceLock;

static ARMED: OnceLock<Option<String>> = OnceLock::new();

/// Aborts the process if the failpoint `name` is armed; with `NAME:stop`,
/// stops it instead (SIGSTOP: a host that hangs, its sockets open and its
/// locks held, until a SIGCONT).
pub fn hit(name: &str) {
    let armed = ARMED.get_or_init(|| std::env::var("TOOLGATE_FAILPOINT").ok().filter(|s| !s.is_empty()));
    match armed.as_deref() {
        Some(a) if a == name => std::process::abort(),
        Some(a) if a.strip_suffix(":stop") == Some(name) => {
            let _ = std::process::Command::new("kill").args(["-STOP", &std::process::id().to_string()]).status();
        }
        _ => {}
    }
}
