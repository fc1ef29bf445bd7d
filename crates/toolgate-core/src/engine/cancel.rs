//! Cancellation: a result that arrives after a cancel never flips the state back to success.
//!
//! An operator cancels an operation that has not finished (`accepted` or
//! `in_flight`). What cancelling can mean depends on one fact, read in the same
//! `BEGIN IMMEDIATE` transaction as the change:
//!
//! - **nothing was sent** (no attempt carries a sent-marker, or every one was
//!   provably refused): the operation is cancelled. It is represented as state
//!   `failed` with code `CANCELLED` (outcome `not_started`, recovery `none`), so
//!   no state list anywhere changes; a retry of the intent replays that failure.
//! - **an attempt may have reached the provider**: the effect cannot be undone,
//!   so the operation moves to the unknown queue (`unknown`, `OUTCOME_UNKNOWN`):
//!   only a status query or a human decides it from there.
//!
//! Either way the outbox row is closed, which drops the lease: a worker still
//! holding it fails its fence, so its send is aborted (before send) or its late
//! reply is recorded as trace evidence only (after send). Nothing flips a
//! cancelled or unknown operation to success by itself. Every attempt, applied or
//! refused, is written to the operator log with the evidence the operator saw.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use serde_json::json;

use super::canonical::canonical_string;
use super::envelope::Code;
use super::trace::TraceEvent;
use super::{Engine, EngineError, OperatorOutcome};
use crate::store::Reason;
use crate::store::Scope;
use crate::store::Step;
use crate::store::{AttemptOutcome, AttemptRow, AuditRow, OpState, OutboxState, StoreError, SENDER_DETACHED};

/// A caller's cancellation of one call it has made, shared between the
/// thread that runs the call ([`Engine::dispatch_cancellable`]) and the one
/// that hears the cancellation (an MCP `notifications/cancelled`). Whichever
/// comes first wins: a call cancelled before its accept is accepted and
/// cancelled in one transaction (before send: `CANCELLED`, no effect); a call
/// past its accept is the operation's to cancel ([`Engine::cancel_own_call`]).
#[derive(Debug, Clone, Default)]
pub struct CancelSignal(Arc<AtomicU8>);

const WAITING: u8 = 0;
const CANCELLED: u8 = 1;
const ACCEPTING: u8 = 2;

impl CancelSignal {
    /// The caller cancelled. `true` when the call had not reached its
    /// accept: it cancels itself there. `false` when it had: cancel its
    /// operation instead (it may not be committed yet: look until it is).
    pub fn cancel(&self) -> bool {
        match self.0.compare_exchange(WAITING, CANCELLED, Ordering::SeqCst, Ordering::SeqCst) {
            Ok(_) | Err(CANCELLED) => true,
            Err(_) => false,
        }
    }

    /// At the accept, under the ledger's write lock: `true` when the caller
    /// cancelled first.
    pub(crate) fn accepting(&self) -> bool {
        matches!(self.0.compare_exchange(WAITING, ACCEPTING, Ordering::SeqCst, Ordering::SeqCst), Err(CANCELLED))
    }
}

/// An operator's cancellation of one operation.
#[derive(Debug, Clone, Default)]
pub struct CancelRequest {
    /// Operation.
    pub operation_id: String,
    /// Who.
    pub operator: String,
    /// Why (mandatory).
    pub note: String,
    /// The version the operator saw; refused if the row changed since.
    pub seen_version: Option<i64>,
    /// The action's own id: repeating it returns the first outcome.
    pub action_id: Option<String>,
}

fn outcome(applied: bool, code: &'static str, message: String, op: Option<&str>) -> OperatorOutcome {
    OperatorOutcome { applied, code, message, operation_id: op.map(str::to_string), approval_id: None }
}

/// Whether an attempt may have reached the provider.
fn possibly_sent(a: &AttemptRow) -> bool {
    !a.proven_not_received()
}

impl Engine {
    /// Cancels an operation: before send it is cancelled (no effect, terminal);
    /// after send it moves to the unknown queue. Refusals are outcomes too, and
    /// are logged.
    pub fn cancel(&mut self, r: &CancelRequest) -> Result<OperatorOutcome, EngineError> {
        if !r.operator.trim().is_empty() {
            super::check_operator(&r.operator)?;
        }
        super::check_operator_note(&r.note)?;
        let now = self.clock.now_ms();
        let salt = self.salt.clone();
        let contracts = self.contracts.clone();
        let scope = self.operator_scope.clone();
        Ok(self.store.write(|tx| cancel_in(tx, r, now, &salt, &contracts, scope.as_deref()))?)
    }

    /// The caller's own cancellation of its call in flight (an MCP client's
    /// `notifications/cancelled`): the operation its key names in its own
    /// scope, cancelled as [`Engine::cancel`] does, recorded under `who` (the
    /// channel it came by). `None` while the call has no operation yet (not
    /// accepted, or refused before accept): there is nothing to cancel.
    pub fn cancel_own_call(
        &mut self,
        scope: Scope<'_>,
        who: &str,
        note: &str,
    ) -> Result<Option<OperatorOutcome>, EngineError> {
        let defenses = self.defenses()?;
        let key = super::lab::scope_key(scope.key, defenses, &self.instance, &self.ids);
        let Some(op) = self.store.read(|tx| tx.operation_by_scope(Scope { key: &key, ..scope }))? else {
            return Ok(None);
        };
        let r = CancelRequest {
            operation_id: op.id,
            operator: who.to_string(),
            note: note.to_string(),
            seen_version: None,
            action_id: None,
        };
        self.cancel(&r).map(Some)
    }
}

/// [`Engine::cancel`] inside a write transaction the caller holds: the
/// dispatch's own accept uses it for a call its client cancelled before it
/// was sent, so the accept and the cancellation commit together.
pub(crate) fn cancel_in(
    tx: &crate::store::Tx<'_>,
    r: &CancelRequest,
    now: i64,
    salt: &str,
    contracts: &super::contracts::Contracts,
    scope: Option<&[String]>,
) -> Result<OperatorOutcome, StoreError> {
    if let Some(id) = &r.action_id {
        if let Some(prev) = tx.audit_by_action_id(id)? {
            let applied = prev.result == "applied";
            return Ok(outcome(
                applied,
                if applied { "OK" } else { "REFUSED" },
                format!("action already recorded: {}", prev.reason),
                prev.operation_id.as_deref(),
            ));
        }
    }
    // Another tenant's operation, for a tenant-scoped operator: as if none.
    let cur = tx.operation(&r.operation_id)?.filter(|o| Engine::in_operator_scope(scope, &o.tenant));
    let attempts = if cur.is_some() { tx.attempts(&r.operation_id)? } else { Vec::new() };
    let outbox = tx.outbox(&r.operation_id)?;
    let sent = attempts.iter().any(possibly_sent);
    let snapshot = cur.as_ref().map(|o| {
        json!({
            "state": o.state, "version": o.version, "code": o.code, "attempts": attempts.len(),
            "possibly_sent": sent, "outbox": outbox.as_ref().map(|b| b.state),
        })
    });
    let audit = |applied: bool, reason: &str, evidence: &serde_json::Value| -> Result<(), StoreError> {
        tx.insert_audit(&AuditRow {
            seq: 0,
            at: now,
            action_id: r.action_id.clone(),
            actor: r.operator.clone(),
            action: "cancel".into(),
            operation_id: cur.as_ref().map(|o| o.id.clone()),
            approval_id: None,
            result: if applied { "applied" } else { "refused" }.into(),
            reason: reason.to_string(),
            evidence: canonical_string(evidence),
            chain_sha256: None,
        })
    };
    let refuse = |code: &'static str, why: String| -> Result<OperatorOutcome, StoreError> {
        // The operator's own note is kept with the refusal: what they meant to do.
        audit(false, &why, &json!({"seen_version": r.seen_version, "current": snapshot, "note": r.note}))?;
        if let Some(op) = &cur {
            let mut t = TraceEvent::of_operation(Step::Cancel, op, salt, now);
            t.note = Some(format!("refused: {}", code.to_ascii_lowercase()));
            t.because(Reason::Refused).write(tx, now)?;
        }
        Ok(outcome(false, code, why, Some(&r.operation_id)))
    };
    if r.operator.trim().is_empty() {
        return refuse("OPERATOR_REQUIRED", "an operator identity is required".into());
    }
    if r.note.trim().is_empty() {
        return refuse("NOTE_REQUIRED", "a cancellation needs a note".into());
    }
    let Some(mut op) = cur.clone() else {
        return refuse("NO_SUCH_OPERATION", "no such operation".into());
    };
    if !matches!(op.state, OpState::Accepted | OpState::InFlight) {
        let why = match op.state {
            OpState::Unknown | OpState::NeedsReview => {
                format!("operation is {}: it is already in the unknown queue; query its status or resolve it", op.state)
            }
            s => format!("operation is {s}: only accepted or in-flight operations can be cancelled"),
        };
        return refuse("NOT_CANCELLABLE", why);
    }
    if let Some(seen) = r.seen_version {
        if seen != op.version {
            return refuse(
                "STALE_VERSION",
                format!("operation changed since you saw it (you saw version {seen}, it is now {})", op.version),
            );
        }
    }
    // The attempt a worker may hold right now ends here; its lease goes
    // with the outbox row, so the worker's next fenced write fails.
    let open = attempts.iter().find(|a| a.outcome.is_none());
    let (state, code, outbox_state, reason, message) = if sent {
        (
            contracts.get(&op.tool).map_or(OpState::Unknown, |c| c.downstream.unknown_state()),
            Code::OutcomeUnknown,
            OutboxState::Parked,
            Reason::CancelledAfterSend,
            "an attempt may have reached the provider, so the effect cannot be undone: \
                 moved to the unknown queue (query its status), or to human review where the provider cannot be asked",
        )
    } else {
        (
            OpState::Failed,
            Code::Cancelled,
            OutboxState::Done,
            Reason::CancelledBeforeSend,
            "cancelled before anything was sent: no effect",
        )
    };
    op.state = state;
    op.code = Some(code.as_str().into());
    op.updated_at = now;
    // The version check comes before any other write of this step: a
    // refusal must leave the attempt and the outbox row as they were.
    if tx.update_operation(&op)?.is_stale() {
        return refuse("STALE_VERSION", "operation changed while cancelling".into());
    }
    if let Some(a) = open {
        // A sent attempt's sender may still be inside the call: detached, not ended.
        let (o, c) = if a.sent_at.is_some() {
            (AttemptOutcome::Unknown, SENDER_DETACHED)
        } else {
            (AttemptOutcome::NotSent, code.as_str())
        };
        tx.finish_attempt(&op.id, a.attempt, o, Some(c), now)?;
    }
    tx.close_outbox(&op.id, outbox_state, Some(code.as_str()))?;
    audit(true, &r.note, &json!({"seen_version": r.seen_version, "before": snapshot, "after": state}))?;
    let mut t = TraceEvent::of_operation(Step::Cancel, &op, salt, now);
    t.code = Some(code);
    t.outcome = Some(if sent { "unknown" } else { "not_started" });
    t.note = Some(message.into());
    t.because(reason).write(tx, now)?;
    Ok(outcome(true, "OK", message.to_string(), Some(&op.id)))
}
