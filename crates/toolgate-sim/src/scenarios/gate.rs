//! A manual clock with a gate, so that a scenario can hold one call *inside* the
//! provider while other steps run.
//!
//! The simulated providers wait through the engine's clock (`latency(ms)` calls
//! `sleep_ms` before committing). With a plain [`ManualClock`] that wait is
//! instant. Here, the one thread registered as the background call parks in its
//! first wait until the scenario opens the gate; every other wait (and every
//! other thread) just moves the clock. The call is really in flight meanwhile:
//! claimed, leased, its sent-marker committed, on its own engine and connections.

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::ThreadId;
use std::time::Duration;

use crate::engine::clock::{Clock, ManualClock};
use crate::engine::envelope::Envelope;

/// What the background call did, as far as the gate knows.
#[derive(Debug, Default)]
struct GateState {
    /// The thread whose first wait parks.
    holder: Option<ThreadId>,
    /// Waits pass through.
    open: bool,
    /// The holder is parked in a wait.
    parked: bool,
    /// The holder finished: its envelope, or why it failed.
    done: Option<Result<Envelope, String>>,
}

/// The scenario clock: manual time plus the gate.
#[derive(Debug)]
pub(crate) struct ScenarioClock {
    manual: ManualClock,
    state: Mutex<GateState>,
    cv: Condvar,
}

/// How a wait for the background call ended.
#[derive(Debug)]
pub(crate) enum Waited {
    /// It is parked inside the provider call.
    Parked,
    /// It finished (without parking, or after the gate opened).
    Done(Result<Envelope, String>),
    /// Neither happened in time.
    TimedOut,
}

impl ScenarioClock {
    pub(crate) fn new(start_ms: i64) -> Self {
        Self { manual: ManualClock::new(start_ms), state: Mutex::new(GateState::default()), cv: Condvar::new() }
    }

    pub(crate) fn manual(&self) -> &ManualClock {
        &self.manual
    }

    fn lock(&self) -> MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Closes the gate for a new background call (run by the scenario thread).
    pub(crate) fn arm(&self) {
        *self.lock() = GateState::default();
    }

    /// Registers the calling thread as the background call.
    pub(crate) fn hold_current_thread(&self) {
        self.lock().holder = Some(std::thread::current().id());
        self.cv.notify_all();
    }

    /// Records the background call's result.
    pub(crate) fn finish(&self, result: Result<Envelope, String>) {
        let mut s = self.lock();
        s.done = Some(result);
        s.parked = false;
        self.cv.notify_all();
    }

    /// Waits until the background call parks or finishes.
    pub(crate) fn wait_parked(&self, timeout: Duration) -> Waited {
        let s = self.lock();
        let (mut s, _) = self
            .cv
            .wait_timeout_while(s, timeout, |s| !s.parked && s.done.is_none())
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(r) = s.done.take() {
            Waited::Done(r)
        } else if s.parked {
            Waited::Parked
        } else {
            Waited::TimedOut
        }
    }

    /// Opens the gate and waits for the background call to finish.
    pub(crate) fn open_and_wait(&self, timeout: Duration) -> Waited {
        let mut s = self.lock();
        s.open = true;
        self.cv.notify_all();
        let (mut s, _) =
            self.cv.wait_timeout_while(s, timeout, |s| s.done.is_none()).unwrap_or_else(PoisonError::into_inner);
        s.done.take().map_or(Waited::TimedOut, Waited::Done)
    }

    /// Opens the gate for good (when a run is dropped mid-call).
    pub(crate) fn release(&self) {
        self.lock().open = true;
        self.cv.notify_all();
    }
}

impl Clock for ScenarioClock {
    fn now_ms(&self) -> i64 {
        self.manual.now_ms()
    }

    fn sleep_ms(&self, ms: u64) {
        {
            let mut s = self.lock();
            if !s.open && s.holder == Some(std::thread::current().id()) {
                s.parked = true;
                self.cv.notify_all();
                while !s.open {
                    s = self.cv.wait(s).unwrap_or_else(PoisonError::into_inner);
                }
                s.parked = false;
            }
        }
        self.manual.sleep_ms(ms);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn only_the_holder_parks_and_only_until_the_gate_opens() {
        let clock = Arc::new(ScenarioClock::new(0));
        // Another thread's wait just moves time.
        clock.sleep_ms(5);
        assert_eq!(clock.now_ms(), 5);
        clock.arm();
        let c = clock.clone();
        let h = std::thread::spawn(move || {
            c.hold_current_thread();
            c.sleep_ms(100);
            c.sleep_ms(10); // the gate is open now: passes
            c.finish(Err("done".into()));
        });
        assert!(matches!(clock.wait_parked(Duration::from_secs(10)), Waited::Parked));
        assert_eq!(clock.now_ms(), 5, "parked before its wait moved the clock");
        assert!(matches!(clock.open_and_wait(Duration::from_secs(10)), Waited::Done(Err(_))));
        h.join().unwrap();
        assert_eq!(clock.now_ms(), 115);
    }
}
