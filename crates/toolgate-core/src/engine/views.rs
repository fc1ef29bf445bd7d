//! Read-only views for clients that show the ledger (the console): paged,
//! index-backed, only what is visible.

use super::{Engine, EngineError};
use crate::store::{ApprovalRow, AuditRow, Cursor, Filter, LiveRow, OperationRow, OpsView, Order, StoreError};

/// The numbers in the console's header.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeaderCounts {
    /// Operations per state.
    pub by_state: Vec<(String, i64)>,
    /// Pending approvals.
    pub pending_approvals: i64,
    /// Intents with more than one effect.
    pub side_effect_duplicates: i64,
    /// Time of the oldest unknown / needs-review operation.
    pub oldest_unknown_at: Option<i64>,
    /// Each tenant's approver allowlist (the console checks an approval
    /// before it opens the dialog, and shows who may approve).
    pub approvers: std::collections::BTreeMap<String, Vec<String>>,
    /// Why the ledger's clock pauses reaping and purging on this host, if it does.
    pub clock_paused: Option<String>,
    /// The circuit breakers that are not closed (open or half-open), by downstream.
    pub breakers: Vec<crate::store::CircuitRow>,
}

impl Engine {
    /// A page of the ledger or of the unknown queue, in `order` (a column of
    /// [`crate::store::OPS_SORT`]).
    pub fn ops_page(
        &mut self,
        view: OpsView,
        filter: &Filter,
        order: Order,
        cursor: Option<&Cursor>,
        limit: i64,
    ) -> Result<Vec<OperationRow>, EngineError> {
        let now = self.clock.now_ms();
        Ok(self.store.read(|tx| tx.ops_page(view, filter, now, order, cursor, limit))?)
    }

    /// A page of in-flight and waiting outbox rows.
    pub fn live_page(
        &mut self,
        filter: &Filter,
        order: Order,
        cursor: Option<&Cursor>,
        limit: i64,
    ) -> Result<Vec<LiveRow>, EngineError> {
        let now = self.clock.now_ms();
        Ok(self.store.read(|tx| tx.live_page(filter, now, order, cursor, limit))?)
    }

    /// A page of pending approvals.
    pub fn approvals_page(
        &mut self,
        filter: &Filter,
        order: Order,
        cursor: Option<&Cursor>,
        limit: i64,
    ) -> Result<Vec<ApprovalRow>, EngineError> {
        let now = self.clock.now_ms();
        Ok(self.store.read(|tx| tx.approvals_page(filter, now, order, cursor, limit))?)
    }

    /// A page of the operator log, filtered like the other panes.
    pub fn audit_page(
        &mut self,
        filter: &Filter,
        order: Order,
        cursor: Option<&Cursor>,
        limit: i64,
    ) -> Result<Vec<AuditRow>, EngineError> {
        let now = self.clock.now_ms();
        Ok(self.store.read(|tx| tx.audit_page(filter, now, order, cursor, limit))?)
    }

    /// Operations whose id starts with `prefix`, at most `limit`, in id order.
    pub fn operation_ids_with_prefix(&mut self, prefix: &str, limit: i64) -> Result<Vec<String>, EngineError> {
        Ok(self.store.read(|tx| tx.operation_ids_with_prefix(prefix, limit))?)
    }

    /// Operations holding idempotency key `key` in `tenant`, at most `limit`.
    pub fn operation_ids_with_key(&mut self, key: &str, tenant: &str, limit: i64) -> Result<Vec<String>, EngineError> {
        Ok(self.store.read(|tx| tx.operation_ids_with_key(key, tenant, limit))?)
    }

    /// Header counts.
    pub fn header_counts(&mut self) -> Result<HeaderCounts, EngineError> {
        let now = self.clock.now_ms();
        let duplicates = self.effect_counts()?.duplicates;
        let clock_paused = self.clock_status().and_then(|c| c.paused);
        Ok(self.store.read(|tx| -> Result<HeaderCounts, StoreError> {
            let mut approvers: std::collections::BTreeMap<String, Vec<String>> = std::collections::BTreeMap::new();
            for (tenant, approver) in tx.approver_lists()? {
                approvers.entry(tenant).or_default().push(approver);
            }
            Ok(HeaderCounts {
                by_state: tx.count_operations_by_state()?,
                pending_approvals: tx.count_pending_approvals(now)?,
                side_effect_duplicates: duplicates,
                oldest_unknown_at: tx.oldest_unknown_at()?,
                approvers,
                clock_paused: clock_paused.clone(),
                breakers: tx
                    .circuits()?
                    .into_iter()
                    .filter(|c| c.state != crate::store::CircuitState::Closed)
                    .collect(),
            })
        })?)
    }

    /// Of `ids`, the operations a person acted on: never purged (the console's
    /// "kept" column says so instead of a retention countdown).
    pub fn acted_on_by_a_person(&mut self, ids: &[String]) -> Result<Vec<String>, EngineError> {
        Ok(self.store.read(|tx| tx.acted_on_by_a_person(ids))?)
    }

    /// SQLite's data version: changes when any other connection commits.
    pub fn data_version(&mut self) -> Result<i64, EngineError> {
        Ok(self.store.data_version()?)
    }
}
