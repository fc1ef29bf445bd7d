//! Per-downstream bulkheads: at most so many sends to one downstream in flight
//! at once from this process, so that a slow downstream cannot take every
//! engine thread while a replay, a read, a status query of another downstream
//! or an operator action waits in the queue behind it (issue 32 §3).
//!
//! A claim takes a [`Slot`] before it records an attempt and holds it until
//! the attempt's outcome is persisted; a claim that finds the downstream full
//! sends nothing and answers `TOOL_UNAVAILABLE` with a retry hint (the
//! operation waits in the outbox under the same key), as an open circuit does.
//! The limit is the catalog's `downstream.max_in_flight`, else the process's
//! default ([`set_default_limit`]: `serve` sets one less than its engine
//! threads; elsewhere there is none). Slots are in memory: a process that dies
//! holds none.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

/// The process's limit for a downstream whose catalog names none.
static DEFAULT_LIMIT: AtomicUsize = AtomicUsize::new(usize::MAX);

/// How long a caller is told to wait when a downstream is full.
pub const FULL_RETRY_AFTER_MS: u64 = 1_000;

fn in_flight() -> &'static Mutex<HashMap<String, Arc<AtomicUsize>>> {
    static IN_FLIGHT: OnceLock<Mutex<HashMap<String, Arc<AtomicUsize>>>> = OnceLock::new();
    IN_FLIGHT.get_or_init(Mutex::default)
}

/// Sets the limit of every downstream whose catalog names none (at least 1).
pub fn set_default_limit(n: usize) {
    DEFAULT_LIMIT.store(n.max(1), Ordering::SeqCst);
}

/// The limit that applies to a downstream.
pub fn limit_of(max_in_flight: Option<u32>) -> usize {
    max_in_flight.map_or_else(|| DEFAULT_LIMIT.load(Ordering::SeqCst), |n| (n as usize).max(1))
}

/// One send in flight to a downstream; given back when dropped. A downstream
/// with no limit is not counted (the claim's hot path takes no lock).
#[derive(Debug)]
pub struct Slot {
    count: Option<Arc<AtomicUsize>>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(c) = &self.count {
            c.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// A slot for one more send to `downstream`, or `None` when `limit` are in
/// flight already.
pub fn try_acquire(downstream: &str, limit: usize) -> Option<Slot> {
    if limit == usize::MAX {
        return Some(Slot { count: None });
    }
    let count = {
        let mut all = in_flight().lock().unwrap_or_else(PoisonError::into_inner);
        match all.get(downstream) {
            Some(c) => c.clone(),
            None => all.entry(downstream.to_string()).or_default().clone(),
        }
    };
    count
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| (n < limit).then_some(n + 1))
        .ok()
        .map(|_| Slot { count: Some(count) })
}

/// Sends in flight to `downstream` from this process now.
pub fn in_flight_now(downstream: &str) -> usize {
    in_flight().lock().unwrap_or_else(PoisonError::into_inner).get(downstream).map_or(0, |c| c.load(Ordering::SeqCst))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_downstream_refuses_until_a_slot_is_given_back() {
        let a = try_acquire("bulkhead-test-ds", 2).unwrap();
        let b = try_acquire("bulkhead-test-ds", 2).unwrap();
        assert!(try_acquire("bulkhead-test-ds", 2).is_none());
        assert!(try_acquire("bulkhead-test-other", 2).is_some(), "another downstream is not full");
        drop(a);
        let c = try_acquire("bulkhead-test-ds", 2);
        assert!(c.is_some());
        assert_eq!(in_flight_now("bulkhead-test-ds"), 2);
        drop((b, c));
        assert_eq!(in_flight_now("bulkhead-test-ds"), 0);
        let unlimited: Vec<_> = (0..3).map(|_| try_acquire("bulkhead-test-free", usize::MAX).unwrap()).collect();
        assert_eq!(in_flight_now("bulkhead-test-free"), 0, "no limit: not counted");
        drop(unlimited);
    }
}
