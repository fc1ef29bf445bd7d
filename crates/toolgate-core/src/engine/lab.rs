//! The classroom lab (docs/design.md §14): "defenses off" toggles, one at a time, from the
//! source text's failure-injection table ("four changes, and see where the
//! defenses are") and its opening incident ("one timeout, two tickets"). Each toggle breaks one rule so that a class
//! watches what the rule was for: the duplicate-effects counter turns red, or a
//! harness is told something that is not true.
//!
//! Only a database **marked as a demo** (meta `demo` = `1`, set by the demo
//! generator on a file it creates, never on an existing ledger) accepts a
//! toggle; anywhere else it is refused with `LAB_NOT_DEMO`. The toggle lives in
//! the database (meta `lab_toggle`), so every engine and simulated agent on the
//! file, in this process or another, picks it up at its next call; an engine
//! reads it only when the file is a demo, so a real ledger never even looks.
//!
//! Three toggles switch a defense off inside the engine ([`DefensesOff`]); two
//! change what the simulated harness does (`crate::load`), because that is where
//! the source text (docs/design.md §14) puts the mistake.

use serde::Serialize;
use serde_json::json;

use super::canonical::canonical_string;
use super::{DefensesOff, Engine, EngineError};
use crate::store::{AuditRow, StoreError};

/// Meta key of the demo mark.
const DEMO_KEY: &str = "demo";
/// Meta key of the active toggle.
const TOGGLE_KEY: &str = "lab_toggle";
/// Meta key of the simulated agents' fault rate, in basis points.
const FAULT_KEY: &str = "load_fault_bp";

/// One defense switched off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LabToggle {
    /// The idempotency key is minted by the server for every call instead of
    /// coming from the caller: a retry is a new intent to the ledger.
    ServerGeneratedKey,
    /// Same key with different arguments answers the stored result instead of
    /// `IDEMPOTENCY_CONFLICT`: the second request is silently dropped.
    ConflictReturnsOldResult,
    /// The idempotency records live in the dispatcher's memory: a restarted
    /// dispatcher (or another replica) has never heard of the key.
    InMemoryLedger,
    /// The harness gets a generic error without the code: it cannot tell
    /// "unknown, query it" from "not done, retry", so it retries blindly and
    /// then believes the call failed.
    ErrorCodesDropped,
    /// The dispatcher retries on any timeout, including a response timeout after
    /// which the effect may exist, instead of parking it for a status query.
    NaiveTimeoutRetry,
    /// The business rule "amount ≤ remaining" is checked at accept but nothing
    /// is reserved there: the balance changes only when a refund's reply comes
    /// back, so concurrent refunds of one order grant the same money twice.
    BalanceNotReserved,
}

/// Where a toggle acts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LabSide {
    /// Inside the engine (every caller is affected).
    Engine,
    /// In the simulated harness (the load generator's agents).
    Harness,
}

impl LabToggle {
    /// All toggles, in the order the lab panel lists them.
    pub const ALL: [LabToggle; 6] = [
        LabToggle::ServerGeneratedKey,
        LabToggle::ConflictReturnsOldResult,
        LabToggle::InMemoryLedger,
        LabToggle::ErrorCodesDropped,
        LabToggle::NaiveTimeoutRetry,
        LabToggle::BalanceNotReserved,
    ];

    /// Stable name (CLI, meta value).
    pub fn as_str(self) -> &'static str {
        match self {
            LabToggle::ServerGeneratedKey => "server_generated_key",
            LabToggle::ConflictReturnsOldResult => "conflict_returns_old_result",
            LabToggle::InMemoryLedger => "in_memory_ledger",
            LabToggle::ErrorCodesDropped => "error_codes_dropped",
            LabToggle::NaiveTimeoutRetry => "naive_timeout_retry",
            LabToggle::BalanceNotReserved => "balance_not_reserved",
        }
    }

    /// Parses a stable name.
    pub fn parse(s: &str) -> Option<LabToggle> {
        LabToggle::ALL.into_iter().find(|t| t.as_str() == s.trim())
    }

    /// Where it acts.
    pub fn side(self) -> LabSide {
        match self {
            LabToggle::ErrorCodesDropped => LabSide::Harness,
            _ => LabSide::Engine,
        }
    }

    /// The engine defenses it switches off (none for harness-side toggles).
    pub fn defenses_off(self) -> DefensesOff {
        let mut d = DefensesOff::default();
        match self {
            LabToggle::ServerGeneratedKey => d.server_generated_key = true,
            LabToggle::ConflictReturnsOldResult => d.conflict_returns_old_result = true,
            LabToggle::InMemoryLedger => d.in_memory_ledger = true,
            LabToggle::NaiveTimeoutRetry => d.naive_timeout_retry = true,
            LabToggle::BalanceNotReserved => d.balance_not_reserved = true,
            LabToggle::ErrorCodesDropped => {}
        }
        d
    }

    /// The rule this toggle breaks.
    pub fn rule(self) -> &'static str {
        match self {
            LabToggle::ServerGeneratedKey => {
                "The idempotency key is generated by the caller, once per business intent, and sent with every retry."
            }
            LabToggle::ConflictReturnsOldResult => {
                "The same key with different arguments is IDEMPOTENCY_CONFLICT, never the old result."
            }
            LabToggle::InMemoryLedger => {
                "Idempotency records are durable (a UNIQUE key in the database), so a restart or another replica still knows every key."
            }
            LabToggle::ErrorCodesDropped => {
                "Every failure carries its code and recovery (retry_after, query_status, ...): the harness decides from the code."
            }
            LabToggle::NaiveTimeoutRetry => {
                "A timeout after sending is OUTCOME_UNKNOWN: query the status, never retry blindly; whether a retry is safe depends on the effect."
            }
            LabToggle::BalanceNotReserved => {
                "A refund reserves what it grants in the transaction that accepts it: remaining = captured - refunded - held."
            }
        }
    }

    /// What the class should watch.
    pub fn harm(self) -> &'static str {
        match self {
            LabToggle::ServerGeneratedKey => {
                "Every retry and replay becomes a new operation with a new downstream key: the provider commits again. Watch the duplicate-effects counter turn red."
            }
            LabToggle::ConflictReturnsOldResult => {
                "A re-sent intent with another amount comes back `succeeded` with the first amount: the second request was silently dropped (masked conflicts)."
            }
            LabToggle::InMemoryLedger => {
                "The agents' dispatchers restart now and then: a replay after a restart finds no record and runs again. Duplicates appear."
            }
            LabToggle::ErrorCodesDropped => {
                "Agents see a bare error: they retry what must be queried and give up on what is merely queued. They report failures for refunds that happened (wrong beliefs), and the unknown queue is never queried."
            }
            LabToggle::NaiveTimeoutRetry => {
                "Lost replies are re-sent. Payments honours the downstream key (no harm there); notifications do not de-duplicate, so customers get the message twice. Duplicates appear."
            }
            LabToggle::BalanceNotReserved => {
                "Agents refunding one order at once all see the same remaining amount and ask for more than it captured. The payments provider refuses what the charge no longer covers; without that check the money is paid and only the audit finds it."
            }
        }
    }

    /// The failure-injection row of the source text this toggle comes from, in
    /// English (the original Chinese is quoted in `docs/design.md`, "The
    /// classroom lab").
    pub fn keel(self) -> &'static str {
        match self {
            LabToggle::ServerGeneratedKey => {
                "the idempotency key is generated by the server → a retry carries another key: two tickets"
            }
            LabToggle::ConflictReturnsOldResult => {
                "idempotency_conflict answers with the old result → the second request's content is silently dropped"
            }
            LabToggle::InMemoryLedger => {
                "idempotency state kept in an in-memory map → the protection is gone after a process restart"
            }
            LabToggle::ErrorCodesDropped => {
                "ToolExecutionError raised as a plain exception → the code is lost; the model has nothing to decide on"
            }
            LabToggle::NaiveTimeoutRetry => "create_ticket -> timeout, the runner retries as a fallback → two tickets",
            LabToggle::BalanceNotReserved => {
                "the rule is read when the call is accepted, the balance changes when the reply comes back → two agents refund the last 10 € twice"
            }
        }
    }
}

/// The lab's state on one database.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct LabState {
    /// Marked as a demo (only then can a toggle be set).
    pub demo: bool,
    /// The defense switched off, if any.
    pub toggle: Option<LabToggle>,
    /// The simulated agents' fault rate, in basis points (500 = 5%).
    pub fault_bp: u32,
    /// Conflicts the engine answered with the old result (all time).
    pub masked_conflicts: i64,
}

/// The ledger scope key for a caller's key under the active defenses. With every
/// defense on it is the caller's key. A lab suffix is separated by a space,
/// which a valid caller key can never contain, so the caller's key (the business
/// intent the provider's effects are counted by) is always the part before it.
pub(crate) fn scope_key(key: &str, d: DefensesOff, instance: &str, ids: &super::ids::Ids) -> String {
    if d.server_generated_key {
        format!("{key} srv:{}", hex::encode(ids.bytes::<8>()))
    } else if d.in_memory_ledger {
        format!("{key} mem:{instance}")
    } else {
        key.to_string()
    }
}

/// The caller's key inside a ledger scope key (see [`scope_key`]).
pub(crate) fn caller_key(scope_key: &str) -> &str {
    scope_key.split(' ').next().unwrap_or(scope_key)
}

impl Engine {
    /// Whether the file is marked as a demo (read once at open: the mark is
    /// only ever set on a file the demo generator creates).
    pub fn is_demo(&self) -> bool {
        self.demo
    }

    /// The defenses in force for the next step: the options this engine was
    /// opened with, plus the lab toggle of a demo database.
    pub(crate) fn defenses(&mut self) -> Result<DefensesOff, EngineError> {
        if !self.demo {
            return Ok(self.defenses_off);
        }
        let toggle = self.store.read(|tx| tx.meta(TOGGLE_KEY))?;
        let lab = toggle.as_deref().and_then(LabToggle::parse).map(LabToggle::defenses_off).unwrap_or_default();
        Ok(self.defenses_off.or(lab))
    }

    /// The lab's state.
    pub fn lab_state(&mut self) -> Result<LabState, EngineError> {
        let demo = self.demo;
        Ok(self.store.read(|tx| -> Result<LabState, StoreError> {
            Ok(LabState {
                demo,
                toggle: if demo { tx.meta(TOGGLE_KEY)?.as_deref().and_then(LabToggle::parse) } else { None },
                fault_bp: tx.meta(FAULT_KEY)?.and_then(|v| v.parse().ok()).unwrap_or(0),
                masked_conflicts: tx.trace_reason_total(crate::store::Reason::LabConflictMasked)?,
            })
        })?)
    }

    /// The two controls the simulated agents follow, read at every intent: the
    /// active toggle (demo databases only) and the fault rate in basis points.
    pub fn lab_controls(&mut self) -> Result<(Option<LabToggle>, u32), EngineError> {
        let demo = self.demo;
        Ok(self.store.read(|tx| -> Result<_, StoreError> {
            let toggle = if demo { tx.meta(TOGGLE_KEY)?.as_deref().and_then(LabToggle::parse) } else { None };
            Ok((toggle, tx.meta(FAULT_KEY)?.and_then(|v| v.parse().ok()).unwrap_or(0)))
        })?)
    }

    /// Money the downstreams paid out per order, summed over those that pay
    /// money (empty when none does).
    pub fn paid_by_order(&mut self) -> Result<std::collections::BTreeMap<String, i64>, EngineError> {
        let mut all = std::collections::BTreeMap::new();
        for d in self.downstreams.values_mut() {
            for (order, amount) in d.paid_by_order()?.unwrap_or_default() {
                *all.entry(order).or_default() += amount;
            }
        }
        Ok(all)
    }

    /// The lab's referee: how many downstream effects exist for one business
    /// intent (the caller's key in its scope). More than one is a duplicate; one,
    /// for an intent its harness believes failed, is a wrong belief.
    pub fn effects_for_intent(&mut self, scope: crate::store::Scope<'_>) -> Result<i64, EngineError> {
        let intent = super::operation::intent_of(scope);
        for d in self.downstreams.values_mut() {
            if let Some(n) = d.effects_for_intent(&intent)? {
                return Ok(n);
            }
        }
        Ok(0)
    }

    /// Switches one defense off (or, with `None`, every defense back on), on a
    /// demo database only; recorded in the operator log. Anywhere else:
    /// `LAB_NOT_DEMO`, and nothing changes.
    pub fn set_lab_toggle(&mut self, toggle: Option<LabToggle>, operator: &str) -> Result<(), EngineError> {
        super::check_operator(operator)?;
        let now = self.clock.now_ms();
        let demo = self.demo;
        self.store.write(|tx| -> Result<(), EngineError> {
            // Re-read under the write lock: the mark is the authority, not our cache.
            if !demo || tx.meta(DEMO_KEY)?.as_deref() != Some("1") {
                return Err(EngineError::invalid(
                    "LAB_NOT_DEMO",
                    "lab toggles switch defenses off and are refused on a database not marked as a demo \
                     (create one with `toolgate demo-db --out PATH`, or use `toolgate demo`)",
                ));
            }
            let before = tx.meta(TOGGLE_KEY)?;
            let after = toggle.map_or("", LabToggle::as_str);
            tx.meta_set(TOGGLE_KEY, after)?;
            let evidence = json!({"before": before.filter(|b| !b.is_empty()), "after": toggle.map(LabToggle::as_str)});
            tx.insert_audit(&AuditRow {
                seq: 0,
                at: now,
                action_id: None,
                actor: operator.to_string(),
                action: "lab".into(),
                operation_id: None,
                approval_id: None,
                result: "applied".into(),
                reason: toggle
                    .map_or_else(|| "every defense back on".to_string(), |t| format!("defense off: {}", t.as_str())),
                evidence: canonical_string(&evidence),
                chain_sha256: None,
            })?;
            Ok(())
        })
    }

    /// Sets the fault rate the simulated agents inject (basis points, at most
    /// 10000). It only drives the simulated providers of `crate::load`'s agents.
    pub fn set_load_fault_rate(&mut self, bp: u32) -> Result<(), EngineError> {
        if bp > 10_000 {
            return Err(EngineError::invalid("BAD_FAULT_RATE", "a fault rate is between 0% and 100%"));
        }
        Ok(self.store.write(|tx| tx.meta_set(FAULT_KEY, &bp.to_string()))?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_user_facing_lab_string_is_english() {
        let cjk = |c: char| ('\u{2e80}'..='\u{9fff}').contains(&c) || ('\u{ff00}'..='\u{ffef}').contains(&c);
        for t in LabToggle::ALL {
            for text in [t.rule(), t.harm(), t.keel()] {
                assert!(!text.chars().any(cjk), "{text}");
            }
        }
    }

    #[test]
    fn names_round_trip() {
        for t in LabToggle::ALL {
            assert_eq!(LabToggle::parse(t.as_str()), Some(t));
        }
        assert_eq!(LabToggle::parse("nope"), None);
    }

    #[test]
    fn each_toggle_breaks_one_thing() {
        for t in LabToggle::ALL {
            let d = t.defenses_off();
            let n = [
                d.server_generated_key,
                d.conflict_returns_old_result,
                d.in_memory_ledger,
                d.naive_timeout_retry,
                d.balance_not_reserved,
            ]
            .iter()
            .filter(|b| **b)
            .count();
            assert_eq!(n, usize::from(t.side() == LabSide::Engine), "{t:?}");
        }
    }

    #[test]
    fn the_caller_key_survives_every_scope_key() {
        let ids = super::super::ids::Ids::seeded(1);
        for d in LabToggle::ALL.map(LabToggle::defenses_off) {
            let s = scope_key("refund-0001", d, "inst", &ids);
            assert_eq!(caller_key(&s), "refund-0001");
        }
        assert_eq!(scope_key("refund-0001", DefensesOff::default(), "i", &ids), "refund-0001");
    }
}
