//! Time: the system clock, or a manual clock for tests, scenarios and `--now`.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

/// A source of time in milliseconds since the Unix epoch.
pub trait Clock: Send + Sync {
    /// Now.
    fn now_ms(&self) -> i64;
    /// Waits (a manual clock just moves forward).
    fn sleep_ms(&self, ms: u64);
    /// Whether this is the host's wall clock, which the engine replaces with
    /// the ledger's one clock ([`super::ledger_clock`]) when it opens a ledger.
    fn is_host_wall(&self) -> bool {
        false
    }
}

/// The real clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> i64 {
        chrono::Utc::now().timestamp_millis()
    }
    fn sleep_ms(&self, ms: u64) {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
    fn is_host_wall(&self) -> bool {
        true
    }
}

/// A clock that only moves when told (or when something sleeps on it).
#[derive(Debug, Clone)]
pub struct ManualClock {
    now: Arc<AtomicI64>,
}

impl ManualClock {
    /// A clock at `now_ms`.
    pub fn new(now_ms: i64) -> Self {
        Self { now: Arc::new(AtomicI64::new(now_ms)) }
    }
    /// Moves forward.
    pub fn advance(&self, ms: i64) {
        self.now.fetch_add(ms, Ordering::SeqCst);
    }
    /// Jumps to an instant.
    pub fn set(&self, now_ms: i64) {
        self.now.store(now_ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> i64 {
        self.now.load(Ordering::SeqCst)
    }
    fn sleep_ms(&self, ms: u64) {
        self.advance(ms as i64);
    }
}

/// Formats milliseconds as RFC 3339 UTC.
pub fn rfc3339(ms: i64) -> String {
    chrono::DateTime::<chrono::Utc>::from_timestamp_millis(ms)
        .map_or_else(|| ms.to_string(), |t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
}

/// Parses RFC 3339 into milliseconds.
pub fn parse_rfc3339(s: &str) -> Option<i64> {
    chrono::DateTime::parse_from_rfc3339(s).ok().map(|t| t.timestamp_millis())
}
