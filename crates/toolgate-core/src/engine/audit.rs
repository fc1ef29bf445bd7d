//! The integrity audit (`toolgate audit`): every stored row re-checked
//! against its digests and bindings, the operator log's chain and the
//! decisions it must hold, and the providers asked whether what the ledger
//! says happened did. Read-only; references in findings are opaque.

use serde::Serialize;
use serde_json::Value;

use super::envelope::Code;
use super::operation::{args_of, domain_call, verify_approval, verify_row};
use super::tool::Lookup;
use super::tool::ToolCall;
use super::{Engine, EngineError};
use crate::store::{AuditRow, OpState, OperationRow, OutboxState, StoreError, Tx};

/// One finding of the integrity audit. References are opaque (operation or
/// receipt ids); no tenant, subject or key appears.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AuditFinding {
    /// Which check.
    pub check: String,
    /// Opaque reference.
    pub reference: String,
    /// What is wrong.
    pub detail: String,
}

impl Engine {
    /// The operator log, newest first.
    pub fn audit_log(&mut self, limit: i64) -> Result<Vec<AuditRow>, EngineError> {
        Ok(self.store.read(|tx| tx.audit_log(limit))?)
    }

    /// What the audit reports beside its findings, without calling the
    /// ledger damaged: trace events dated before their operation was created
    /// by more than the clocks' bound (one of the two was written on a wrong
    /// clock: a host's, or a fixed `--now`). At most 20, then how many more.
    pub fn audit_warnings(&mut self) -> Result<Vec<AuditFinding>, EngineError> {
        Ok(self.store.read(|tx| -> Result<Vec<AuditFinding>, StoreError> {
            let (wrong, n) = tx.trace_times_before_creation(super::ledger_clock::CLOCK_BOUND_MS, 20)?;
            let mut out: Vec<AuditFinding> = wrong
                .iter()
                .map(|(seq, op, at, created)| AuditFinding {
                    check: "trace_time".into(),
                    reference: format!("trace_events {seq}"),
                    detail: format!(
                        "time {} is {} s before its operation {op} was created ({}): written on a wrong clock",
                        super::clock::rfc3339(*at),
                        (created - at) / 1000,
                        super::clock::rfc3339(*created)
                    ),
                })
                .collect();
            if n > wrong.len() as i64 {
                out.push(AuditFinding {
                    check: "trace_time".into(),
                    reference: "trace_events".into(),
                    detail: format!("{} more events dated before their operation", n - wrong.len() as i64),
                });
            }
            Ok(out)
        })?)
    }

    /// The integrity and semantic audit (`toolgate audit`).
    pub fn audit(&mut self) -> Result<Vec<AuditFinding>, EngineError> {
        let toolset = self.toolset.clone();
        let refs = self.refs.clone();
        let salt = self.salt.clone();
        // Counted by the providers, never read from their storage here.
        let dups = self.effect_counts()?.duplicates;
        let mut settled = Vec::new();
        let mut out = self.store.read(|tx| -> Result<Vec<AuditFinding>, StoreError> {
            let mut out = Vec::new();
            let mut find = |check: &str, reference: &str, detail: &str| {
                out.push(AuditFinding { check: check.into(), reference: reference.into(), detail: detail.into() });
            };
            for p in tx.sqlite_checks()? {
                find("sqlite", "database", &p);
            }
            for (table, row, value) in tx.invalid_states()? {
                find("state", &format!("{table} {row}"), &format!("{value} is not a state {table} allows"));
            }
            let ops = tx.all_operations()?;
            for op in &ops {
                check_operation(tx, op, &refs, &salt, &mut find)?;
            }
            for (state, counted, held) in tx.state_count_drift()? {
                let detail = format!("the header counts {counted} {state}, the ledger holds {held}");
                find("counts", "state_counts", &detail);
            }
            for id in tx.legacy_keys_after_migration()? {
                find("digest", &id, "downstream_key is not the key derived for this operation");
            }
            for r in tx.orphan_receipts()? {
                find("orphan_receipt", &r, "receipt does not belong to the operation it names");
            }
            // A hold lives exactly as long as its operation may still take effect.
            let by_id: std::collections::HashMap<&str, &OperationRow> =
                ops.iter().map(|o| (o.id.as_str(), o)).collect();
            for (op_id, resource, amount) in tx.holds()? {
                match by_id.get(op_id.as_str()) {
                    Some(o) if o.state.is_terminal() => {
                        find(
                            "hold",
                            &op_id,
                            &format!("{amount} still held on {resource} by an operation that is {}", o.state),
                        );
                    }
                    Some(_) => {}
                    None => find("hold", &op_id, &format!("{amount} held on {resource} by no operation")),
                }
            }
            for a in tx.all_approvals()? {
                if let Err(why) = verify_approval(&a) {
                    find("approval", &a.id, why);
                }
            }
            // Each domain checks its local state against the calls the ledger holds as succeeded.
            let succeeded: Vec<(&OperationRow, Value, Value)> = ops
                .iter()
                .filter(|o| o.state == OpState::Succeeded)
                .map(|o| {
                    let result = o.result_json.as_deref().and_then(|r| serde_json::from_str(r).ok());
                    (o, args_of(&o.request_json), result.unwrap_or(Value::Null))
                })
                .collect();
            for (tools, domain) in toolset.domain_groups() {
                let calls: Vec<(ToolCall<'_>, Value)> = succeeded
                    .iter()
                    .filter(|(o, ..)| tools.contains(&o.tool))
                    .map(|(o, a, r)| (domain_call(o, a), r.clone()))
                    .collect();
                domain.audit(&tx.domain(), &calls, &mut find)?;
            }
            let (bad, gaps) = tx.trace_damage()?;
            for seq in bad {
                find("trace", &format!("trace_events {seq}"), "fields are not valid JSON");
            }
            for (from, to) in gaps {
                find("trace", &format!("trace_events {from}..{to}"), "events missing (the trace is never pruned)");
            }
            let log = tx.audit_log_ascending()?;
            check_audit_chain(tx, &log, &mut find)?;
            check_decisions_are_logged(&log, &ops, &mut find);
            if dups > 0 {
                find("side_effect_duplicates", "downstream", &format!("{dups} intent(s) with more than one effect"));
            }
            let no_effect: std::collections::HashSet<String> = tx.sent_without_effect()?.into_iter().collect();
            settled = ops
                .into_iter()
                .filter(|o| (o.state == OpState::Succeeded && o.receipt_id.is_some()) || no_effect.contains(&o.id))
                .map(|o| {
                    // The receipt a succeeded operation holds; `None` for one the ledger says had no effect.
                    let receipt = if o.state == OpState::Succeeded { o.receipt_id } else { None };
                    (o.id, o.tool, o.downstream_key, receipt, o.updated_at)
                })
                .collect();
            Ok(out)
        })?;
        // The downstream's side, through its adapter (the engine never reads its
        // tables): every succeeded operation's effect is still there.
        let contracts = self.contracts.clone();
        let now = self.clock.now_ms();
        for (id, tool, key, receipt, settled_at) in settled {
            // A provider shows an effect from when it landed: an audit whose
            // clock is before the operation settled (`--now` in the past) cannot ask.
            if settled_at > now {
                continue;
            }
            let Some(contract) = contracts.get(&tool) else { continue };
            // A read-only engine that could not open this downstream cannot
            // ask it: not checked (the CLI lists it), like an unavailable one.
            if self.unopened.contains_key(&contract.downstream.name) {
                continue;
            }
            let lookup = self.downstream(&contract.downstream.name)?.lookup(&key, contract.retry.attempt_timeout_ms)?;
            let Some(receipt) = receipt else {
                // The ledger says "no effect" after a send: money the provider
                // paid anyway (a late commit, a person's wrong "failed") shows here.
                if let Lookup::Found(r) = lookup {
                    out.push(AuditFinding {
                        check: "money".into(),
                        reference: id,
                        detail: format!(
                            "the provider holds receipt {} for an operation the ledger says had no effect",
                            r.receipt_id
                        ),
                    });
                }
                continue;
            };
            match lookup {
                Lookup::Found(r) if r.receipt_id == receipt => {}
                Lookup::Found(r) => out.push(AuditFinding {
                    check: "downstream".into(),
                    reference: id,
                    detail: format!("the provider's receipt is {}, the ledger holds {receipt}", r.receipt_id),
                }),
                Lookup::NotFound => out.push(AuditFinding {
                    check: "downstream".into(),
                    reference: id,
                    detail: "the provider has no effect for this succeeded operation".into(),
                }),
                // Cannot ask (now, or ever): no finding either way.
                Lookup::Unavailable | Lookup::Unsupported | Lookup::Conflict(_) => {}
            }
        }
        Ok(out)
    }
}

/// Every human decision the ledger holds has its entry in the operator log:
/// a resolution (state `resolved`), a cancellation (code `CANCELLED`) and an
/// approval (an operation accepted from an approval). The chain alone cannot
/// tell a log emptied whole (triggers disabled, the head deleted) from one
/// never written; the decisions still on the operations can.
fn check_decisions_are_logged(log: &[AuditRow], ops: &[OperationRow], find: &mut impl FnMut(&str, &str, &str)) {
    let mut by_op: std::collections::HashSet<(&str, &str)> = std::collections::HashSet::new();
    let mut by_approval: std::collections::HashSet<(&str, &str)> = std::collections::HashSet::new();
    for r in log.iter().filter(|r| r.result == "applied") {
        if let Some(op) = r.operation_id.as_deref() {
            by_op.insert((r.action.as_str(), op));
        }
        if let Some(a) = r.approval_id.as_deref() {
            by_approval.insert((r.action.as_str(), a));
        }
    }
    for op in ops {
        if op.state == OpState::Resolved && !by_op.contains(&("resolve", op.id.as_str())) {
            find("audit_log", &op.id, "resolved by a person, but the operator log has no applied resolve for it");
        }
        if op.code.as_deref() == Some(Code::Cancelled.as_str()) && !by_op.contains(&("cancel", op.id.as_str())) {
            find("audit_log", &op.id, "cancelled, but the operator log has no applied cancel for it");
        }
        if let Some(a) = op.approval_id.as_deref() {
            if !by_approval.contains(&("approve", a)) {
                find(
                    "audit_log",
                    &op.id,
                    "accepted from an approval, but the operator log has no applied approve for it",
                );
            }
        }
    }
}

/// The operator log's hash chain (migration 0007): every linked row carries the
/// hash of the row before it, and meta `audit_head` the hash of the newest.
fn check_audit_chain(
    tx: &Tx<'_>,
    rows: &[AuditRow],
    find: &mut impl FnMut(&str, &str, &str),
) -> Result<(), StoreError> {
    let mut prev: Option<String> = None;
    let mut linked = false;
    for row in rows {
        let expect = prev.clone().unwrap_or_else(|| crate::store::AUDIT_GENESIS.to_string());
        match &row.chain_sha256 {
            Some(link) => {
                linked = true;
                if *link != expect {
                    find(
                        "audit_chain",
                        &format!("audit_log {}", row.seq),
                        "link does not match the row before it (a row was deleted, changed or inserted)",
                    );
                }
            }
            None if linked => {
                find("audit_chain", &format!("audit_log {}", row.seq), "row without a link after linked rows");
            }
            None => {}
        }
        prev = Some(row.chain_hash());
    }
    // Each row an entry touched carries the head that entry made (migration
    // 0017): a head the log no longer holds means rows were removed, even
    // when the log was emptied whole and meta `audit_head` deleted with it.
    let heads: std::collections::HashSet<String> = rows.iter().map(AuditRow::chain_hash).collect();
    for (kind, id, anchor) in tx.audit_anchors()? {
        if !heads.contains(&anchor) {
            find(
                "audit_chain",
                &id,
                &format!("the {kind} names an operator-log entry the log no longer holds (log rows removed)"),
            );
        }
    }
    let head = tx.meta("audit_head")?;
    if linked && head != prev {
        find("audit_chain", "audit_log", "the newest row is not the one the head records (rows removed at the end)");
    }
    if !linked && head.is_some() {
        find("audit_chain", "audit_log", "the log is empty or unlinked but a head was recorded (rows removed)");
    }
    Ok(())
}

fn check_operation(
    tx: &Tx<'_>,
    op: &OperationRow,
    refs: &super::canonical::StatusRefKey,
    salt: &str,
    find: &mut impl FnMut(&str, &str, &str),
) -> Result<(), StoreError> {
    let r = op.id.as_str();
    if let Err(why) = verify_row(op, salt) {
        find("digest", r, why);
    }
    if refs.verify(&op.status_ref).is_err() {
        find("status_ref", r, "status_ref does not verify under this database's secret");
    }
    let ob = tx.outbox(&op.id)?;
    let attempts = tx.attempts(&op.id)?;
    let queued = |s: OutboxState| matches!(s, OutboxState::Leased | OutboxState::Pending);
    match (op.state, ob.as_ref().map(|o| o.state)) {
        (_, None) => find("outbox", r, "operation has no outbox row"),
        (OpState::Succeeded, _) if op.result_json.is_none() || op.receipt_id.is_none() => {
            find("shape", r, "succeeded without result or receipt");
        }
        (OpState::InFlight, Some(s)) if queued(s) => {}
        (OpState::Accepted, Some(OutboxState::Pending)) => {}
        (OpState::InFlight | OpState::Accepted, Some(s)) => {
            find("lease", r, &format!("{} operation with outbox {s}", op.state));
        }
        (s, Some(q)) if s.is_terminal() && queued(q) => find("lease", r, "terminal operation still queued"),
        (s, Some(q)) if s.is_unknown_queue() && queued(q) => find("lease", r, "unknown operation still queued"),
        _ => {}
    }
    if let Some(o) = &ob {
        if o.state == OutboxState::Leased {
            let holder = attempts.iter().find(|a| a.attempt == o.attempt);
            if holder.is_none_or(|a| Some(&a.owner) != o.lease_owner.as_ref()) {
                find("lease", r, "lease has no matching attempt row");
            }
        }
        if o.attempt != attempts.len() as i64 {
            find("lease", r, "attempt count disagrees with attempt rows");
        }
    }
    if op.state == OpState::Succeeded && op.code.is_some() {
        find("shape", r, "succeeded with an error code");
    }
    // A succeeded operation's receipt came from the provider and was recorded;
    // a resolution's receipt id is the operator's evidence and need not be.
    if let (Some(receipt), "succeeded") = (&op.receipt_id, op.state.as_str()) {
        match tx.receipt_owner(receipt)? {
            None => find("receipt", r, "the receipt the operation names is not in receipts"),
            Some(owner) if owner != op.id => find(
                "receipt_bound_twice",
                r,
                &format!("succeeded on receipt {receipt}, which the ledger recorded for operation {owner}: resolve this operation against its recorded success (resolve --against-evidence)"),
            ),
            Some(_) => {}
        }
    }
    let call = super::operation::call_of(op);
    match tx.call_identity(&call.key(&op.tenant, &op.subject))? {
        None => find("call_identity", r, "the call identity that created the operation is not bound"),
        Some(b) if b.request_sha256 != op.request_sha256 || b.purpose != "dispatch" => {
            find("call_identity", r, "the creating call identity is bound to another request or purpose");
        }
        Some(_) => {}
    }
    if tx.trace_count_for(&op.id)? == 0 {
        find("trace", r, "the operation has no trace events");
    }
    Ok(())
}
