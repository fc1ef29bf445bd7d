//! Admission (docs/design.md §5): the accept transaction, from the call
//! identity and scope lookup through business rules and the approval gate to
//! the operation, its outbox row and its binding.

use serde_json::{json, Value};

use super::worker::Running;
use super::{Decision, DispatchRequest};
use crate::engine::canonical::CallIdentity;
use crate::engine::contracts::{ApprovalPolicy, Contract};
use crate::engine::envelope::{Code, Delivery, ProtectedAudit, Status};
use crate::engine::operation::{
    authorize, business_rules, new_operation_for, op_envelope, reserve, verify_row, APPROVAL_TTL_MS,
};
use crate::engine::policy::{self};
use crate::engine::tool::ToolDomain;
use crate::engine::trace::TraceEvent;
use crate::engine::{error_envelope, with_detail, with_retry_after, DefensesOff, EngineError};
use crate::failpoint;
use crate::store::Reason;
use crate::store::Scope;
use crate::store::Step;
use crate::store::{
    ApprovalRow, ApprovalState, CallIdentityRow, CallKey, OpState, OperationRow, OutboxState, StoreError, Tx,
};

#[derive(Clone, Copy)]
pub(super) struct AcceptCtx<'a> {
    pub(super) req: &'a DispatchRequest,
    pub(super) contract: &'a Contract,
    pub(super) domain: &'a dyn ToolDomain,
    pub(super) args: &'a Value,
    pub(super) call: &'a CallIdentity,
    /// The engine minted `call` for this call (the caller gave none).
    pub(super) minted_call: bool,
    pub(super) key: &'a str,
    pub(super) key_sha256: &'a str,
    pub(super) request_json: &'a str,
    pub(super) request_sha256: &'a str,
    pub(super) now: i64,
    pub(super) deadline_ms: u64,
    pub(super) principal_ref: &'a str,
    pub(super) refs: &'a crate::engine::canonical::StatusRefKey,
    pub(super) ids: &'a crate::engine::ids::Ids,
    /// The ledger's salt (the downstream key is derived under it).
    pub(super) salt: &'a str,
    pub(super) defenses: DefensesOff,
    /// The ledger (what this process's running operations are keyed by).
    pub(super) ledger: &'a std::path::Path,
}

/// Steps 2–5 of the pipeline in one `BEGIN IMMEDIATE` transaction.
///
/// `relaxed`: the transaction does not wait for the disk, so it may only record
/// an answer; any path that would change state returns [`Decision::Synced`]
/// before writing anything.
pub(super) fn accept(
    tx: &Tx<'_>,
    c: &AcceptCtx<'_>,
    audit: ProtectedAudit,
    mut ev: TraceEvent,
    relaxed: bool,
) -> Result<Decision, EngineError> {
    let r = c.req;
    if let Some(id) = &r.token_id {
        // The token again, under the write lock: authentication read it in a
        // transaction of its own, and a revocation may have committed since.
        match tx.token(id)? {
            Some(t) if t.revoked_at.is_some() => {
                return Err(EngineError::invalid(
                    "TOKEN_REVOKED",
                    "the token was revoked before the call was accepted",
                ));
            }
            Some(t) if t.expires_at.is_none_or(|at| c.now < at) => {}
            _ => return Err(EngineError::invalid("TOKEN_EXPIRED", "the token expired before the call was accepted")),
        }
    }
    let answer = |code: Code, audit: ProtectedAudit, ev: TraceEvent| Decision::Answer(error_envelope(code, audit), ev);
    // 2. Authorization of the current subject (also for replays).
    if let Some(code) = authorize(tx, c.domain, &r.tenant, &r.subject, &r.tool, c.args)? {
        ev.step = Step::Authorization;
        ev.reason = Some(Reason::CurrentAuthorization);
        return Ok(answer(code, audit, ev));
    }
    ev.checks.push("authorization");
    // 3. Call identity, then the scope.
    let ck = c.call.key(&r.tenant, &r.subject);
    // An identity the engine minted for this call (`fresh_call_identity`, 192
    // bits from the OS-seeded generator) is in no row yet: nothing to read.
    let bound = if c.minted_call { None } else { tx.call_identity(&ck)? };
    if let Some(bound) = bound {
        if bound.purpose != "dispatch" || bound.request_sha256 != c.request_sha256 || bound.key_sha256 != c.key_sha256 {
            ev.step = Step::CallIdentity;
            ev.reason = Some(Reason::CallIdConflict);
            return Ok(answer(Code::CallIdConflict, audit, ev));
        }
    }
    ev.checks.push("call_identity");
    let existing = tx.operation_by_scope(Scope::new(&r.tenant, &r.subject, &r.tool, c.key))?;
    ev.step = Step::Idempotency;
    if let Some(op) = existing {
        ev.operation_id = Some(op.id.clone());
        // A damaged row answers STATUS_CONFLICT (the ledger is at fault), never
        // IDEMPOTENCY_CONFLICT (which blames the caller), never a new execution.
        if let Err(why) = verify_row(&op, c.salt) {
            ev.step = Step::TamperDetected;
            ev.note = Some(why.into());
            ev.reason = Some(Reason::Tampered);
            let env = with_detail(
                error_envelope(Code::StatusConflict, audit),
                json!({"reason": "stored record failed its integrity check"}),
            );
            return Ok(Decision::Answer(env, ev));
        }
        if op.request_sha256 != c.request_sha256 {
            if c.defenses.conflict_returns_old_result {
                // Lab only: the defense is off, the second request is silently dropped.
                ev.note = Some("lab: same key, different request, answered with the stored result".into());
                ev.reason = Some(Reason::LabConflictMasked);
                let delivery =
                    if op.state == OpState::Resolved { Delivery::HumanResolved } else { Delivery::LocalReplay };
                return Ok(Decision::Answer(op_envelope(&op, delivery, c.principal_ref.to_string(), None), ev));
            }
            ev.note = Some("same key, different request".into());
            ev.reason = Some(Reason::Conflict);
            return Ok(answer(Code::IdempotencyConflict, audit, ev));
        }
        if relaxed && op.state == OpState::Accepted {
            // Possibly executable again (proven unsent): a state change.
            return Ok(Decision::Synced);
        }
        bind_call(tx, &ck, c, Some(&op.id))?;
        ev.status_ref = Some(op.status_ref.clone());
        match op.state {
            OpState::Succeeded | OpState::Failed => {
                ev.note = Some("replay".into());
                ev.reason = Some(Reason::Replay);
                return Ok(Decision::Answer(
                    op_envelope(&op, Delivery::LocalReplay, c.principal_ref.to_string(), None),
                    ev,
                ));
            }
            OpState::Resolved => {
                ev.note = Some("replay of a human resolution".into());
                ev.reason = Some(Reason::ReplayResolved);
                return Ok(Decision::Answer(
                    op_envelope(&op, Delivery::HumanResolved, c.principal_ref.to_string(), None),
                    ev,
                ));
            }
            _ => {}
        }
        // Not terminal. Only an operation whose every attempt is proven not sent may run again.
        let outbox = tx.outbox(&op.id)?;
        let last_code = outbox.as_ref().and_then(|o| o.last_code.clone());
        let attempts = tx.attempts(&op.id)?;
        let proven_unsent = attempts.iter().all(crate::store::AttemptRow::proven_not_received);
        let pending = outbox.as_ref().is_some_and(|o| o.state == OutboxState::Pending);
        if op.state == OpState::Accepted && proven_unsent && pending {
            let due_at = outbox.as_ref().map_or(c.now, |o| o.available_at);
            if due_at <= c.now {
                // A new call refreshes the operation deadline: the old caller gave up.
                let mut op = op;
                op.deadline_at = c.now + c.deadline_ms as i64;
                op.updated_at = c.now;
                tx.update_operation(&op)?.or_stale()?;
                ev.note = Some("proven not sent and due: execute with the same downstream key".into());
                ev.reason = Some(Reason::ProvenUnsentExecute);
                ev.deadline_left_ms = Some(c.deadline_ms as i64);
                ev.write(tx, c.now)?;
                return Ok(Decision::Execute { op_id: op.id, built: None });
            }
            ev.note = Some("proven not sent, retry time not reached".into());
            ev.reason = Some(Reason::ProvenUnsentNotDue);
            let env = op_envelope(&op, Delivery::Fresh, c.principal_ref.to_string(), last_code.as_deref());
            return Ok(Decision::Answer(with_retry_after(env, (due_at - c.now) as u64), ev));
        }
        // Running right now in this process, under a live lease: say so,
        // with when to look again and the status reference, instead of
        // OUTCOME_UNKNOWN, which sends a model to human review for a call
        // that is merely running.
        let live = outbox.as_ref().and_then(|o| o.lease_until).filter(|&until| {
            until > c.now
                && matches!(op.state, OpState::Accepted | OpState::InFlight)
                && Running::holds(c.ledger, &op.id)
        });
        if let Some(until) = live {
            ev.note = Some("running under a live lease: in progress, never re-executed".into());
            ev.reason = Some(Reason::InProgress);
            let mut env = op_envelope(&op, Delivery::LocalReplay, c.principal_ref.to_string(), None);
            let info = in_progress_info(&op, (until - c.now).clamp(100, 1_000) as u64);
            env.model_result.status = Status::Unknown;
            env.model_result.error = Some(info);
            return Ok(Decision::Answer(env, ev));
        }
        ev.note = Some("not terminal and possibly sent: unknown, never re-executed".into());
        ev.reason = Some(Reason::InProgress);
        return Ok(Decision::Answer(op_envelope(&op, Delivery::LocalReplay, c.principal_ref.to_string(), None), ev));
    }
    if relaxed {
        // A new intent (the row was purged since the read): accept is a state change.
        return Ok(Decision::Synced);
    }
    // No row under this scope. If a row under the same key whose bound request
    // names this very scope sits elsewhere, its tenant, subject or tool column
    // was edited by hand: the intent is not new, and running it would be a
    // second effect.
    for other in tx.operations_sharing_key(Scope::new(&r.tenant, &r.subject, &r.tool, c.key))? {
        let bound = serde_json::from_str::<Value>(&other.request_json).ok();
        let says = |f: &str| bound.as_ref().and_then(|v| v.get(f)).and_then(Value::as_str).map(str::to_string);
        let ours = says("tenant").as_deref() == Some(r.tenant.as_str())
            && says("subject").as_deref() == Some(r.subject.as_str())
            && says("tool").as_deref() == Some(r.tool.as_str());
        if ours && verify_row(&other, c.salt).is_err() {
            ev.step = Step::TamperDetected;
            ev.operation_id = Some(other.id.clone());
            ev.note = Some("a row of this scope was moved out of it by hand".into());
            ev.reason = Some(Reason::Tampered);
            let env = with_detail(
                error_envelope(Code::StatusConflict, audit),
                json!({"reason": "stored record failed its integrity check"}),
            );
            return Ok(Decision::Answer(env, ev));
        }
    }
    // A key whose operation was purged stays taken: its tombstone keeps the
    // scope digest, so a retry long after is told how the first one ended,
    // never run a second time (a purge on a host whose clock ran ahead, or a
    // retry after retention, would otherwise pay twice).
    let scope = crate::engine::retention::scope_sha256(&r.tenant, &r.subject, &r.tool, c.key);
    if let Some(t) = tx.tombstone_by_scope(&scope)? {
        ev.operation_id = Some(t.operation_id.clone());
        ev.note = Some(format!("key used by {}, purged when its retention ended: not run again", t.operation_id));
        ev.reason = Some(Reason::KeyExpired);
        let env = with_detail(
            error_envelope(Code::IdempotencyKeyExpired, audit),
            crate::engine::retention::expired_key_detail(&t, c.request_sha256),
        );
        return Ok(Decision::Answer(env, ev));
    }
    ev.checks.push("idempotency");
    // A new execution whose deadline was spent before it was accepted (it
    // waited in a server's queue): refused before accept, nothing sent.
    if c.deadline_ms == 0 {
        ev.step = Step::Deadline;
        ev.reason = Some(Reason::DeadlineBeforeAccept);
        ev.note = Some("the caller's deadline passed before the call was accepted: nothing was stored or sent".into());
        return Ok(Decision::Answer(error_envelope(Code::TimeoutBeforeExecute, audit), ev));
    }
    // A new execution while the downstream's circuit is open: refused before
    // accept, nothing stored but this call's trace event.
    if let Some(wait) = policy::admit_new(tx, &c.contract.downstream.name, c.now)? {
        ev.step = Step::Circuit;
        ev.reason = Some(Reason::CircuitOpen);
        ev.note = Some(format!("circuit of {} is open: refused before accept", c.contract.downstream.as_str()));
        return Ok(Decision::Answer(with_retry_after(error_envelope(Code::ToolUnavailable, audit), wait), ev));
    }
    // 4. Business rules, then approval for a new execution.
    if let Some(rule) = business_rules(tx, c.domain, [&r.tenant, &r.subject, &r.tool], c.args, None)? {
        ev.step = Step::BusinessRules;
        ev.note = Some(rule.into());
        ev.reason = Some(Reason::Rule(rule));
        let env = with_detail(error_envelope(Code::BusinessRuleViolation, audit), json!({"rule": rule}));
        return Ok(Decision::Answer(env, ev));
    }
    ev.checks.push("business_rules");
    if let Some(d) = approval_gate(tx, c, &audit, &mut ev)? {
        return Ok(d);
    }
    ev.checks.push("approval");
    // 5. Accept: operation + outbox + call binding, all or nothing.
    let op = new_operation(c, None);
    tx.insert_operation(&op)?;
    if !c.defenses.balance_not_reserved {
        // What the rules just granted is held from now on (the same transaction).
        reserve(tx, c.domain, &op, c.args, c.now)?;
    }
    tx.insert_outbox(&op.id, i64::from(c.contract.retry.max_attempts), c.now)?;
    bind_call(tx, &ck, c, Some(&op.id))?;
    failpoint::hit("inside_accept");
    ev.step = Step::Accepted;
    ev.operation_id = Some(op.id.clone());
    ev.call_binding_sha256 = Some(op.call_binding_sha256.clone());
    ev.status_ref = Some(op.status_ref.clone());
    ev.deadline_left_ms = Some(c.deadline_ms as i64);
    ev.write(tx, c.now)?;
    Ok(Decision::Execute { op_id: op.id.clone(), built: Some(Box::new(op)) })
}

pub(super) fn bind_call(tx: &Tx<'_>, ck: &CallKey<'_>, c: &AcceptCtx<'_>, op: Option<&str>) -> Result<(), StoreError> {
    tx.bind_call_identity(
        ck,
        &CallIdentityRow {
            purpose: "dispatch".into(),
            request_sha256: c.request_sha256.to_string(),
            key_sha256: c.key_sha256.to_string(),
            operation_id: op.map(str::to_string),
        },
        c.now,
    )
}

/// The model's answer for an intent running elsewhere: `IN_PROGRESS`, when
/// to look again, and what a status query needs (in the model's own result:
/// most MCP adapters never pass `_meta` on to the model).
pub(super) fn in_progress_info(op: &OperationRow, retry_after_ms: u64) -> crate::engine::envelope::ErrorInfo {
    let mut e = crate::engine::envelope::ErrorInfo::new(Code::InProgress);
    e.retry_after_ms = Some(retry_after_ms);
    e.detail = Some(json!({"status_ref": op.status_ref, "expected_request_sha256": op.request_sha256}));
    e
}

/// A fresh ledger row for an accepted dispatch.
pub(super) fn new_operation(c: &AcceptCtx<'_>, approval_id: Option<&str>) -> OperationRow {
    new_operation_for(
        [&c.req.tenant, &c.req.subject, &c.req.tool],
        c.contract,
        c.call,
        c.key,
        c.key_sha256,
        c.request_json,
        c.request_sha256,
        c.now,
        c.deadline_ms,
        c.refs,
        c.ids,
        approval_id,
        c.salt,
    )
}

/// Approval for a new execution (docs/design.md §9). `Some` answers the call now.
pub(super) fn approval_gate(
    tx: &Tx<'_>,
    c: &AcceptCtx<'_>,
    audit: &ProtectedAudit,
    ev: &mut TraceEvent,
) -> Result<Option<Decision>, EngineError> {
    let r = c.req;
    let Some(tenant) = tx.tenant(&r.tenant)? else {
        return Ok(Some(Decision::Answer(error_envelope(Code::PolicyDenied, audit.clone()), ev.clone())));
    };
    let amount = c.args.get("amount_minor").and_then(Value::as_i64);
    let needed = match c.contract.approval {
        ApprovalPolicy::Never => false,
        ApprovalPolicy::Always => true,
        ApprovalPolicy::AboveThreshold => amount.is_some_and(|a| a > tenant.approval_threshold_minor),
    };
    if !needed {
        return Ok(None);
    }
    ev.step = Step::Approval;
    ev.policy_revision = Some(tenant.policy_revision);
    let base = crate::engine::operation::approval_base_sha256(
        &r.tenant,
        &r.subject,
        &r.tool,
        c.request_sha256,
        c.key_sha256,
        c.call,
        c.contract.revisions,
        tenant.policy_revision,
    );
    let latest = tx.latest_approval(Scope::new(&r.tenant, &r.subject, &r.tool, c.key))?;
    if let Some(given) = &r.approval_id {
        if latest.as_ref().map(|a| &a.id) != Some(given) {
            ev.note = Some("approval id does not belong to this call".into());
            ev.reason = Some(Reason::ApprovalMismatch);
            return Ok(Some(Decision::Answer(error_envelope(Code::ApprovalInvalid, audit.clone()), ev.clone())));
        }
    }
    // A new request, unless one below answers; `approval_expired` when it
    // replaces a request that lapsed unapproved.
    ev.reason = Some(Reason::ApprovalRequired);
    if let Some(a) = latest {
        ev.approval_id = Some(a.id.clone());
        if a.request_sha256 != c.request_sha256 {
            ev.note = Some("key already holds an approval request for a different request".into());
            ev.reason = Some(Reason::Conflict);
            return Ok(Some(Decision::Answer(error_envelope(Code::IdempotencyConflict, audit.clone()), ev.clone())));
        }
        let detail =
            |a: &ApprovalRow| json!({"approval_id": a.id, "expires_at": crate::engine::clock::rfc3339(a.expires_at)});
        match a.state {
            ApprovalState::Pending if c.now < a.expires_at => {
                let env = with_detail(error_envelope(Code::ApprovalRequired, audit.clone()), detail(&a));
                let mut env = env;
                env.protected_audit.approval_id = Some(a.id.clone());
                ev.note = Some("approval still pending".into());
                ev.reason = Some(Reason::ApprovalPending);
                return Ok(Some(Decision::Answer(env, ev.clone())));
            }
            ApprovalState::Denied => {
                let mut env = with_detail(
                    error_envelope(Code::ApprovalInvalid, audit.clone()),
                    json!({"approval_id": a.id, "reason": "denied"}),
                );
                env.protected_audit.approval_id = Some(a.id.clone());
                ev.note = Some("approval was denied".into());
                ev.reason = Some(Reason::ApprovalDenied);
                return Ok(Some(Decision::Answer(env, ev.clone())));
            }
            ApprovalState::Pending => {
                // Expired unapproved: mark it, then a new request below.
                let mut expired = a.clone();
                expired.state = crate::store::ApprovalState::Expired;
                expired.decided_at = Some(c.now);
                expired.decided_by = Some("system".into());
                tx.decide_approval(&expired)?.or_stale()?;
                ev.reason = Some(Reason::ApprovalExpired);
            }
            _ => {}
        }
    }
    let approval = ApprovalRow {
        id: c.ids.id("apr"),
        tenant: r.tenant.clone(),
        subject: r.subject.clone(),
        tool: r.tool.clone(),
        idem_key: c.key.to_string(),
        key_sha256: c.key_sha256.to_string(),
        request_sha256: c.request_sha256.to_string(),
        request_json: c.request_json.to_string(),
        input_rev: c.contract.revisions.input,
        output_rev: c.contract.revisions.output,
        effect_rev: c.contract.revisions.effect,
        policy_revision: tenant.policy_revision,
        call_provider: c.call.provider.clone(),
        call_api_family: c.call.api_family.clone(),
        call_response_id: c.call.response_id.clone(),
        call_id: c.call.call_id.clone(),
        adapter_revision: c.call.adapter_revision.clone(),
        amount_minor: amount,
        base_sha256: base,
        approval_sha256: None,
        state: ApprovalState::Pending,
        decided_by: None,
        decided_at: None,
        note: None,
        operation_id: None,
        deadline_ms: c.deadline_ms as i64,
        created_at: c.now,
        expires_at: c.now + APPROVAL_TTL_MS,
    };
    tx.insert_approval(&approval)?;
    let ck = c.call.key(&r.tenant, &r.subject);
    bind_call(tx, &ck, c, None)?;
    ev.approval_id = Some(approval.id.clone());
    ev.note = Some(if ev.reason == Some(Reason::ApprovalExpired) {
        "previous request expired unapproved: new approval requested".into()
    } else {
        "approval requested".into()
    });
    let mut env = with_detail(
        error_envelope(Code::ApprovalRequired, audit.clone()),
        json!({"approval_id": approval.id, "expires_at": crate::engine::clock::rfc3339(approval.expires_at)}),
    );
    env.protected_audit.approval_id = Some(approval.id);
    Ok(Some(Decision::Answer(env, ev.clone())))
}
