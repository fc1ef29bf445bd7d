//! Identifier and randomness source. Seeded for deterministic runs (the demo
//! database, scenario walkthroughs), from OS entropy otherwise.

use std::sync::{Arc, Mutex};

use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};

/// A shared random source for ids, nonces and jitter.
#[derive(Clone)]
pub struct Ids(Arc<Mutex<StdRng>>);

impl std::fmt::Debug for Ids {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Ids(..)")
    }
}

impl Default for Ids {
    fn default() -> Self {
        Self(Arc::new(Mutex::new(StdRng::from_entropy())))
    }
}

impl Ids {
    /// A deterministic source.
    pub fn seeded(seed: u64) -> Self {
        Self(Arc::new(Mutex::new(StdRng::seed_from_u64(seed))))
    }

    /// `N` random bytes.
    pub fn bytes<const N: usize>(&self) -> [u8; N] {
        let mut out = [0u8; N];
        if let Ok(mut r) = self.0.lock() {
            r.fill_bytes(&mut out);
        }
        out
    }

    /// `prefix_` + 24 hex digits.
    pub fn id(&self, prefix: &str) -> String {
        super::canonical::prefixed_hex(prefix, &self.bytes::<12>())
    }

    /// `prefix_` + `2·n` hex digits.
    pub fn id_n<const N: usize>(&self, prefix: &str) -> String {
        super::canonical::prefixed_hex(prefix, &self.bytes::<N>())
    }

    /// `prefix_` + 24 hex digits from this thread's OS-seeded generator
    /// (`rand::thread_rng`, a ChaCha generator reseeded from the OS): an
    /// unpredictable one-off id without seeding a generator per call (two
    /// `getrandom` system calls per dispatch, before).
    pub fn unseeded_id(prefix: &str) -> String {
        let mut b = [0u8; 12];
        rand::thread_rng().fill_bytes(&mut b);
        super::canonical::prefixed_hex(prefix, &b)
    }

    /// Uniform in `0..=max`.
    pub fn up_to(&self, max: u64) -> u64 {
        self.0.lock().map_or(0, |mut r| r.gen_range(0..=max))
    }
}
