//! The ledger's one clock: every instant the engine writes or compares
//! (leases, deadlines, due times, approval expiries, retention, breaker
//! windows, token expiries, trace and tombstone times) is *ledger time*, never
//! the host's wall clock read afresh.
//!
//! Ledger time is a reference instant carried forward by the host's boot-time
//! monotonic clock (`CLOCK_BOOTTIME`: it counts suspend and is never stepped,
//! and every process of a host reads the same one):
//!
//! - **PostgreSQL** (many hosts, one database): the reference is the database
//!   server's clock (`clock_timestamp()`), measured when the engine opens and
//!   again every [`MEASURE_EVERY_MS`]; its uncertainty is half the round trip.
//!   Hosts sharing a database share its clock, whatever their own says.
//! - **SQLite** (one host, many processes): the reference is the ledger's
//!   anchor (meta `clock_anchor`: boot id, boot-time and ledger time), written
//!   by the first process of a boot; every later process of that boot derives
//!   ledger time from it, so a process whose wall clock was moved (a step, a
//!   `faketime`) still writes and judges true instants. A new boot anchors at
//!   the wall clock, but never before the newest instant the ledger recorded
//!   (`seen`): ledger time does not run backwards.
//!
//! The host's wall clock is compared with ledger time at every reading. Beyond
//! [`CLOCK_BOUND_MS`] the disagreement is reported (`counts`, metrics, the
//! console header, a log line), and where it can make the engine act on a wrong
//! instant it stops the actions that cannot be undone: on SQLite a wall clock
//! that disagrees with the anchor (a jump) pauses the reaper and the purge
//! until it agrees again or an operator accepts it (`toolgate clock --accept`);
//! on PostgreSQL, where the instants are the server's, a skewed host keeps
//! working and says so, and what pauses the reaper and the purge is a clock it
//! cannot read well: no measurement for three periods, or an uncertainty beyond
//! the bound.
//!
//! A [`super::clock::ManualClock`] (tests, scenarios, `--now`) is used as given.

use std::sync::{Arc, Mutex};

use super::clock::Clock;
use crate::store::{Backend, Store, StoreError, Tx};

/// The largest disagreement between two clocks that toolgate tolerates
/// without acting on it: a host's wall clock against ledger time, the
/// uncertainty of a measurement of the database clock, and the slack on a
/// lease that looks taken in the future.
pub const CLOCK_BOUND_MS: i64 = 2_000;

/// How often a host re-measures the database clock (PostgreSQL).
pub const MEASURE_EVERY_MS: i64 = 30_000;

/// The host's own clocks, injected so every comparison can be tested.
pub trait HostClocks: Send + Sync {
    /// The wall clock (ms since the epoch); may be stepped.
    fn wall_ms(&self) -> i64;
    /// Monotonic time including suspend, shared by the host's processes (ms).
    fn boot_ms(&self) -> i64;
    /// Which boot `boot_ms` counts from: anchors of another boot do not apply.
    fn boot_id(&self) -> String;
}

/// The real host clocks.
#[derive(Debug, Default, Clone, Copy)]
pub struct RealHost;

impl HostClocks for RealHost {
    fn wall_ms(&self) -> i64 {
        chrono::Utc::now().timestamp_millis()
    }

    #[cfg(target_os = "linux")]
    fn boot_ms(&self) -> i64 {
        let ts = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
        ts.tv_sec * 1000 + ts.tv_nsec / 1_000_000
    }

    #[cfg(not(target_os = "linux"))]
    fn boot_ms(&self) -> i64 {
        process_ms()
    }

    fn boot_id(&self) -> String {
        static PROCESS_BOOT_ID: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        #[cfg(target_os = "linux")]
        if let Ok(id) = std::fs::read_to_string("/proc/sys/kernel/random/boot_id") {
            return id.trim().to_string();
        }
        // Elsewhere the monotonic clock is this process's own: no other
        // process's anchor can be compared with it.
        PROCESS_BOOT_ID.get_or_init(|| format!("process-{}-{}", std::process::id(), rand::random::<u64>())).clone()
    }
}

#[cfg(not(target_os = "linux"))]
fn process_ms() -> i64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START.get_or_init(std::time::Instant::now).elapsed().as_millis() as i64
}

/// Where ledger time comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ClockSource {
    /// The database server's clock (PostgreSQL).
    Database,
    /// The ledger's anchor on this host (SQLite).
    Anchor,
}

/// The ledger's anchor on a SQLite host (meta `clock_anchor`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Anchor {
    /// The boot the anchor's boot-time counts from.
    pub boot_id: String,
    /// Boot-time at the anchor.
    pub boot_ms: i64,
    /// Ledger time at the anchor.
    pub ledger_ms: i64,
    /// The newest ledger time recorded by a reaper pass.
    pub seen_ms: i64,
}

impl Anchor {
    /// The stored form: `boot_id boot_ms ledger_ms seen_ms`.
    pub fn to_meta(&self) -> String {
        format!("{} {} {} {}", self.boot_id, self.boot_ms, self.ledger_ms, self.seen_ms)
    }

    /// Parses the stored form; `None` for anything else.
    pub fn from_meta(s: &str) -> Option<Self> {
        let mut it = s.split(' ');
        let a = Anchor {
            boot_id: it.next()?.to_string(),
            boot_ms: it.next()?.parse().ok()?,
            ledger_ms: it.next()?.parse().ok()?,
            seen_ms: it.next()?.parse().ok()?,
        };
        it.next().is_none().then_some(a)
    }
}

/// What `counts`, the metrics and the console say about the clock.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ClockStatus {
    /// Where ledger time comes from.
    pub source: ClockSource,
    /// This host's wall clock minus ledger time, at the last reading.
    pub offset_ms: i64,
    /// How far ledger time may be off the reference (half the round trip of
    /// the last database measurement; 0 for an anchor).
    pub uncertainty_ms: i64,
    /// Why the reaper and the purge are paused; `None` while they run.
    pub paused: Option<String>,
}

#[derive(Debug)]
struct State {
    /// Ledger time at `reference_boot_ms`.
    reference_ms: i64,
    reference_boot_ms: i64,
    /// Boot-time of the last good database measurement.
    measured_boot_ms: i64,
    uncertainty_ms: i64,
    offset_ms: i64,
    /// The offset was beyond the bound at the last reading (logged once per change).
    skewed: bool,
}

/// Ledger time (see the module docs).
pub struct LedgerClock {
    host: Arc<dyn HostClocks>,
    source: ClockSource,
    state: Mutex<State>,
}

impl std::fmt::Debug for LedgerClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LedgerClock").field("source", &self.source).finish_non_exhaustive()
    }
}

impl LedgerClock {
    /// Ledger time from a measurement of the database clock: `server_ms` read
    /// between boot-times `before` and `after`.
    pub fn from_database(host: Arc<dyn HostClocks>, server_ms: i64, before: i64, after: i64) -> Self {
        let mid = before + (after - before) / 2;
        let state = State {
            reference_ms: server_ms,
            reference_boot_ms: mid,
            measured_boot_ms: mid,
            uncertainty_ms: (after - before + 1) / 2,
            offset_ms: 0,
            skewed: false,
        };
        let c = Self { host, source: ClockSource::Database, state: Mutex::new(state) };
        c.now_ms();
        c
    }

    /// Ledger time from the ledger's anchor; returns the anchor to store when
    /// this process made a new one (no anchor yet, or one of another boot).
    pub fn from_anchor(host: Arc<dyn HostClocks>, stored: Option<Anchor>) -> (Self, Option<Anchor>) {
        let boot_id = host.boot_id();
        let boot = host.boot_ms();
        let (anchor, new) = match stored {
            Some(a) if a.boot_id == boot_id && a.boot_ms <= boot => (a, false),
            other => {
                // A new boot: the wall clock, but never before what the ledger saw.
                let seen = other.map_or(i64::MIN, |a| a.seen_ms.max(a.ledger_ms));
                let ledger_ms = host.wall_ms().max(seen);
                (Anchor { boot_id, boot_ms: boot, ledger_ms, seen_ms: ledger_ms }, true)
            }
        };
        let state = State {
            reference_ms: anchor.ledger_ms,
            reference_boot_ms: anchor.boot_ms,
            measured_boot_ms: boot,
            uncertainty_ms: 0,
            offset_ms: 0,
            skewed: false,
        };
        let c = Self { host, source: ClockSource::Anchor, state: Mutex::new(state) };
        c.now_ms();
        (c, new.then_some(anchor))
    }

    /// The host clocks it reads.
    pub fn host(&self) -> &Arc<dyn HostClocks> {
        &self.host
    }

    /// Where ledger time comes from.
    pub fn source(&self) -> ClockSource {
        self.source
    }

    /// This host's boot-time now.
    pub fn boot_ms(&self) -> i64 {
        self.host.boot_ms()
    }

    /// Whether the database clock is due for another measurement.
    pub fn measurement_due(&self) -> bool {
        self.source == ClockSource::Database
            && self.state.lock().is_ok_and(|s| self.host.boot_ms() - s.measured_boot_ms >= MEASURE_EVERY_MS)
    }

    /// A new measurement of the database clock (see [`Self::from_database`]).
    /// One whose uncertainty is beyond the bound is not used (the previous
    /// reference stands; [`Self::status`] says so once it is stale).
    pub fn measured(&self, server_ms: i64, before: i64, after: i64) {
        let uncertainty = (after - before + 1) / 2;
        let Ok(mut s) = self.state.lock() else { return };
        if uncertainty > CLOCK_BOUND_MS {
            s.uncertainty_ms = uncertainty;
            return;
        }
        let mid = before + (after - before) / 2;
        let predicted = s.reference_ms + (mid - s.reference_boot_ms);
        if (server_ms - predicted).abs() > CLOCK_BOUND_MS {
            tracing::warn!(
                moved_ms = server_ms - predicted,
                "the database clock moved against this host's monotonic clock; ledger time follows the database"
            );
        }
        s.reference_ms = server_ms;
        s.reference_boot_ms = mid;
        s.measured_boot_ms = mid;
        s.uncertainty_ms = uncertainty;
    }

    /// A new anchor at this host's wall clock (`toolgate clock --accept`, after
    /// an operator checked it): ledger time becomes the wall clock.
    pub fn accept_wall(&self) -> Option<Anchor> {
        if self.source != ClockSource::Anchor {
            return None;
        }
        let (boot, wall) = (self.host.boot_ms(), self.host.wall_ms());
        let mut s = self.state.lock().ok()?;
        s.reference_ms = wall;
        s.reference_boot_ms = boot;
        s.offset_ms = 0;
        s.skewed = false;
        Some(Anchor { boot_id: self.host.boot_id(), boot_ms: boot, ledger_ms: wall, seen_ms: wall })
    }

    /// Keeps the stored anchor and this clock in step (a reaper pass, on
    /// SQLite): returns the anchor to store. The stored one of this boot wins
    /// (an operator may have accepted a new wall clock in another process),
    /// with `seen` moved to ledger time now; one of another boot, or none, is
    /// replaced by this clock's.
    pub fn refresh_anchor(&self, stored: Option<Anchor>) -> Option<Anchor> {
        if self.source != ClockSource::Anchor {
            return None;
        }
        let boot_id = self.host.boot_id();
        if let Some(a) = stored.as_ref().filter(|a| a.boot_id == boot_id) {
            if let Ok(mut s) = self.state.lock() {
                s.reference_ms = a.ledger_ms;
                s.reference_boot_ms = a.boot_ms;
            }
        }
        let now = self.now_ms();
        let s = self.state.lock().ok()?;
        let seen = stored.filter(|a| a.boot_id == boot_id).map_or(now, |a| a.seen_ms.max(now));
        Some(Anchor { boot_id, boot_ms: s.reference_boot_ms, ledger_ms: s.reference_ms, seen_ms: seen })
    }

    /// The clock's state now.
    pub fn status(&self) -> ClockStatus {
        self.now_ms();
        let boot = self.host.boot_ms();
        let Ok(s) = self.state.lock() else {
            return ClockStatus {
                source: self.source,
                offset_ms: 0,
                uncertainty_ms: 0,
                paused: Some("the clock's state is unreadable".into()),
            };
        };
        let paused = match self.source {
            ClockSource::Anchor if s.offset_ms.abs() > CLOCK_BOUND_MS => Some(format!(
                "this host's wall clock is {} ledger time (the ledger's anchor, carried by the boot-time clock): \
                 a jump; reaping and purging wait until it agrees again or an operator accepts it (toolgate clock --accept)",
                describe_offset(s.offset_ms)
            )),
            ClockSource::Database if boot - s.measured_boot_ms > 3 * MEASURE_EVERY_MS => Some(format!(
                "the database clock was last measured {} s ago: reaping and purging wait for a measurement",
                (boot - s.measured_boot_ms) / 1000
            )),
            ClockSource::Database if s.uncertainty_ms > CLOCK_BOUND_MS => Some(format!(
                "the database clock cannot be read within {CLOCK_BOUND_MS} ms (half the round trip was {} ms): \
                 reaping and purging wait",
                s.uncertainty_ms
            )),
            _ => None,
        };
        ClockStatus { source: self.source, offset_ms: s.offset_ms, uncertainty_ms: s.uncertainty_ms, paused }
    }
}

/// The meta key of the SQLite host's anchor.
pub(crate) const ANCHOR_KEY: &str = "clock_anchor";

/// Ledger time for a ledger just opened (see the module docs).
pub(crate) fn open(store: &mut Store, host: Arc<dyn HostClocks>) -> Result<LedgerClock, StoreError> {
    if store.backend() == Backend::Postgres {
        let (ms, before, after) = measure(store, &*host)?;
        return Ok(LedgerClock::from_database(host, ms, before, after));
    }
    let read = |tx: &Tx<'_>| -> Result<Option<Anchor>, StoreError> {
        Ok(tx.meta(ANCHOR_KEY)?.as_deref().and_then(Anchor::from_meta))
    };
    let stored = store.read(read)?;
    let (clock, new) = LedgerClock::from_anchor(host.clone(), stored);
    if new.is_none() || store.is_read_only() {
        return Ok(clock);
    }
    // No anchor of this boot yet: decide again under the write lock, so two
    // processes starting at once agree on one.
    store.write(|tx| -> Result<LedgerClock, StoreError> {
        let (clock, new) = LedgerClock::from_anchor(host.clone(), read(tx)?);
        if let Some(a) = new {
            tx.meta_set(ANCHOR_KEY, &a.to_meta())?;
        }
        Ok(clock)
    })
}

/// One reading of the database clock between two boot-time readings.
pub(crate) fn measure(store: &mut Store, host: &dyn HostClocks) -> Result<(i64, i64, i64), StoreError> {
    store.read(|tx| -> Result<(i64, i64, i64), StoreError> {
        let before = host.boot_ms();
        let ms = tx.database_now_ms()?;
        let after = host.boot_ms();
        Ok((ms.unwrap_or_else(|| host.wall_ms()), before, after))
    })
}

/// "3 s ahead of", "2 d 1 h behind".
fn describe_offset(ms: i64) -> String {
    let side = if ms >= 0 { "ahead of" } else { "behind" };
    let s = ms.unsigned_abs() / 1000;
    // Rounded to the unit shown: a host 31 days ahead whose offset was
    // measured a few milliseconds short reads "31 d 0 h", not "30 d 23 h".
    let text = match s {
        0..=119 => format!("{s} s"),
        120..=7199 => format!("{} min", (s + 30) / 60),
        7200..=172_799 => format!("{} h", (s + 1800) / 3600),
        _ => {
            let hours = (s + 1800) / 3600;
            format!("{} d {} h", hours / 24, hours % 24)
        }
    };
    format!("{text} {side}")
}

impl Clock for LedgerClock {
    fn now_ms(&self) -> i64 {
        let boot = self.host.boot_ms();
        let wall = self.host.wall_ms();
        let Ok(mut s) = self.state.lock() else { return wall };
        let now = s.reference_ms + (boot - s.reference_boot_ms);
        s.offset_ms = wall - now;
        let skewed = s.offset_ms.abs() > CLOCK_BOUND_MS;
        if skewed != s.skewed {
            s.skewed = skewed;
            if skewed {
                tracing::warn!(
                    offset_ms = s.offset_ms,
                    source = ?self.source,
                    "this host's wall clock disagrees with ledger time beyond {CLOCK_BOUND_MS} ms; instants use ledger time"
                );
            } else {
                tracing::info!("this host's wall clock agrees with ledger time again");
            }
        }
        now
    }

    fn sleep_ms(&self, ms: u64) {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
}

impl super::Engine {
    /// The ledger's one clock now; `None` under a manual clock.
    pub fn clock_status(&self) -> Option<ClockStatus> {
        self.ledger_clock.as_ref().map(|c| c.status())
    }

    /// Measures the database clock when it is due (PostgreSQL; a dispatch and
    /// a worker pass call this, so a process that never reaps, `toolgate mcp`
    /// say, keeps its measurement fresh): one read every 30 s at most. A
    /// failed measurement is logged; the previous one stands.
    pub(crate) fn clock_tick(&mut self) {
        let Some(lc) = self.ledger_clock.clone() else { return };
        if lc.measurement_due() {
            match measure(&mut self.store, &**lc.host()) {
                Ok((ms, before, after)) => lc.measured(ms, before, after),
                Err(e) => tracing::warn!(error = %e, "the database clock could not be measured"),
            }
        }
    }

    /// Keeps the clock in step before an action that cannot be undone (a
    /// reaper pass, a purge): measures the database clock when due, moves the
    /// SQLite anchor's `seen` forward (adopting an anchor accepted by another
    /// process). Returns why such actions must wait, if they must.
    pub(crate) fn clock_check(&mut self) -> Result<Option<String>, super::EngineError> {
        let Some(lc) = self.ledger_clock.clone() else { return Ok(None) };
        match lc.source() {
            ClockSource::Database => self.clock_tick(),
            ClockSource::Anchor if !self.store.is_read_only() => {
                self.store.write(|tx| -> Result<(), StoreError> {
                    let stored = tx.meta(ANCHOR_KEY)?.as_deref().and_then(Anchor::from_meta);
                    if let Some(a) = lc.refresh_anchor(stored) {
                        tx.meta_set(ANCHOR_KEY, &a.to_meta())?;
                    }
                    Ok(())
                })?;
            }
            ClockSource::Anchor => {}
        }
        let paused = lc.status().paused;
        if let Some(why) = &paused {
            tracing::warn!("{why}");
        }
        Ok(paused)
    }

    /// `toolgate clock --accept`: on SQLite, this host's wall clock becomes
    /// ledger time (a new anchor), after an operator checked that it is right.
    pub fn accept_host_clock(&mut self) -> Result<ClockStatus, super::EngineError> {
        let Some(lc) = self.ledger_clock.clone() else {
            return Err(super::EngineError::invalid("CLOCK_MANUAL", "this engine runs on a manual clock (--now)"));
        };
        let Some(a) = lc.accept_wall() else {
            return Err(super::EngineError::invalid(
                "CLOCK_IS_DATABASE",
                "on PostgreSQL ledger time is the database server's clock: correct this host's clock (NTP) instead",
            ));
        };
        self.store.write(|tx| tx.meta_set(ANCHOR_KEY, &a.to_meta()))?;
        Ok(lc.status())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_offset_is_said_rounded_to_the_unit_shown() {
        const DAY: i64 = 86_400_000;
        assert_eq!(describe_offset(31 * DAY - 3), "31 d 0 h ahead of");
        assert_eq!(describe_offset(-(2 * DAY + 3_600_000 - 1)), "2 d 1 h behind");
        assert_eq!(describe_offset(3 * 3_600_000 - 1_000), "3 h ahead of");
        assert_eq!(describe_offset(600_000 - 1_000), "10 min ahead of");
        assert_eq!(describe_offset(3_000), "3 s ahead of");
    }
    use std::sync::atomic::{AtomicI64, Ordering};

    /// Host clocks a test moves by hand.
    #[derive(Default)]
    struct Fake {
        wall: AtomicI64,
        boot: AtomicI64,
        boot_id: Mutex<String>,
    }

    impl Fake {
        fn at(wall: i64, boot: i64) -> Arc<Self> {
            let f = Fake::default();
            f.wall.store(wall, Ordering::SeqCst);
            f.boot.store(boot, Ordering::SeqCst);
            *f.boot_id.lock().unwrap() = "boot-1".into();
            Arc::new(f)
        }
        /// Real time passes: both clocks move.
        fn pass(&self, ms: i64) {
            self.wall.fetch_add(ms, Ordering::SeqCst);
            self.boot.fetch_add(ms, Ordering::SeqCst);
        }
        /// The wall clock alone is stepped.
        fn step(&self, ms: i64) {
            self.wall.fetch_add(ms, Ordering::SeqCst);
        }
    }

    impl HostClocks for Fake {
        fn wall_ms(&self) -> i64 {
            self.wall.load(Ordering::SeqCst)
        }
        fn boot_ms(&self) -> i64 {
            self.boot.load(Ordering::SeqCst)
        }
        fn boot_id(&self) -> String {
            self.boot_id.lock().unwrap().clone()
        }
    }

    const T: i64 = 1_800_000_000_000;
    const DAY: i64 = 86_400_000;

    #[test]
    fn the_first_process_of_a_boot_anchors_at_its_wall_clock_and_later_ones_follow_the_anchor() {
        let host = Fake::at(T, 5_000);
        let (c, new) = LedgerClock::from_anchor(host.clone(), None);
        let anchor = new.expect("no anchor yet: this process makes one");
        assert_eq!(c.now_ms(), T);
        host.pass(1_000);
        assert_eq!(c.now_ms(), T + 1_000);
        // Another process of the same boot whose wall clock is 31 days ahead
        // (faketime) reads true time from the anchor, and pauses.
        let skewed = Fake::at(T + 1_000 + 31 * DAY, 6_000);
        let (other, new) = LedgerClock::from_anchor(skewed.clone(), Some(anchor.clone()));
        assert!(new.is_none(), "the boot's anchor is used, not replaced");
        assert_eq!(other.now_ms(), T + 1_000);
        let st = other.status();
        assert_eq!(st.offset_ms, 31 * DAY);
        assert!(st.paused.as_deref().unwrap().contains("31 d 0 h ahead of"), "{st:?}");
        // One 60 s behind: the same.
        let behind = Fake::at(T + 1_000 - 60_000, 6_000);
        let (other, _) = LedgerClock::from_anchor(behind, Some(anchor));
        assert_eq!(other.now_ms(), T + 1_000);
        assert!(other.status().paused.unwrap().contains("60 s behind"));
        assert_eq!(c.status().paused, None);
    }

    #[test]
    fn a_wall_clock_step_inside_a_process_does_not_move_ledger_time_and_pauses_until_it_agrees() {
        let host = Fake::at(T, 0);
        let (c, _) = LedgerClock::from_anchor(host.clone(), None);
        host.pass(10_000);
        host.step(-90_000);
        assert_eq!(c.now_ms(), T + 10_000, "a step back during a wait: ledger time goes on");
        assert!(c.status().paused.is_some());
        host.step(90_000);
        assert_eq!(c.status().paused, None, "agrees again: the reaper runs again");
        // Within the bound is no jump.
        host.step(CLOCK_BOUND_MS);
        assert_eq!(c.status().paused, None);
    }

    #[test]
    fn a_new_boot_never_starts_before_what_the_ledger_saw_and_an_accepted_wall_clock_becomes_ledger_time() {
        let old = Anchor { boot_id: "boot-0".into(), boot_ms: 1, ledger_ms: T, seen_ms: T + DAY };
        let host = Fake::at(T + DAY - 3_600_000, 100);
        let (c, new) = LedgerClock::from_anchor(host.clone(), Some(old));
        let new = new.unwrap();
        assert_eq!((new.boot_id.as_str(), new.ledger_ms), ("boot-1", T + DAY));
        assert_eq!(c.now_ms(), T + DAY);
        assert!(c.status().paused.unwrap().contains("60 min behind"));
        let accepted = c.accept_wall().unwrap();
        assert_eq!(accepted.ledger_ms, T + DAY - 3_600_000);
        assert_eq!(c.now_ms(), T + DAY - 3_600_000);
        assert_eq!(c.status().paused, None);
        assert_eq!(Anchor::from_meta(&accepted.to_meta()), Some(accepted));
        assert_eq!(Anchor::from_meta("boot 1 2"), None);
        assert_eq!(Anchor::from_meta("boot 1 2 x"), None);
    }

    #[test]
    fn on_the_database_clock_a_skewed_host_keeps_true_time_and_a_stale_or_vague_measurement_pauses() {
        let host = Fake::at(T + 2 * DAY, 0);
        // The server says T; the round trip took 4 ms.
        let c = LedgerClock::from_database(host.clone(), T, 0, 4);
        assert_eq!(c.now_ms(), T - 2);
        let st = c.status();
        assert_eq!((st.source, st.uncertainty_ms, st.paused.clone()), (ClockSource::Database, 2, None));
        assert!(st.offset_ms > DAY, "the skew is reported, not acted on");
        host.pass(MEASURE_EVERY_MS + 2);
        assert!(c.measurement_due());
        let b = MEASURE_EVERY_MS + 2;
        c.measured(T + b + 8, b, b + 2);
        assert!(!c.measurement_due());
        assert_eq!(c.now_ms(), T + b + 7);
        // A measurement too vague to use is not taken; stale, the clock pauses.
        c.measured(0, b, b + 3 * CLOCK_BOUND_MS);
        assert_eq!(c.now_ms(), T + b + 7);
        assert!(c.status().paused.unwrap().contains("cannot be read within"));
        host.pass(4 * MEASURE_EVERY_MS);
        assert!(c.status().paused.unwrap().contains("last measured"));
    }
}
