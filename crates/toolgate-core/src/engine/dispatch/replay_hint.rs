//! The replay hint: scopes this engine has seen sent, so a replay of one goes
//! straight to the relaxed transaction (see [`SeenSent`]).

/// Scopes (tenant, subject, tool, ledger key) on which this engine answered
/// with an operation: a later call on one is most likely a replay, and at FULL
/// it goes straight to the relaxed transaction (`Store::write_relaxed`)
/// without the read transaction that would tell, one fewer per replay. A hint
/// only, never trusted: `accept` re-checks under the write lock and asks for a
/// synced transaction when the call changes state after all (the operation is
/// still `accepted`, or gone: reaped, or never made because the call was
/// refused), and the scope is then forgotten; a wrong hint costs one relaxed
/// try. 16,384 slots of a 64-bit hash, 128 KiB per engine.
pub(crate) struct SeenSent(Box<[u64]>);

pub(super) const SEEN_SENT_SLOTS: usize = 16384;

impl Default for SeenSent {
    fn default() -> Self {
        Self(vec![0; SEEN_SENT_SLOTS].into_boxed_slice())
    }
}

impl SeenSent {
    /// Never 0, the empty slot.
    pub(super) fn hash(scope: crate::store::Scope<'_>) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (scope.tenant, scope.subject, scope.tool, scope.key).hash(&mut h);
        h.finish() | 1
    }

    pub(super) fn slot(h: u64) -> usize {
        (h % SEEN_SENT_SLOTS as u64) as usize
    }

    pub(super) fn holds(&self, h: u64) -> bool {
        self.0[Self::slot(h)] == h
    }

    pub(super) fn remember(&mut self, h: u64) {
        self.0[Self::slot(h)] = h;
    }

    pub(super) fn forget(&mut self, h: u64) {
        if self.holds(h) {
            self.0[Self::slot(h)] = 0;
        }
    }
}
