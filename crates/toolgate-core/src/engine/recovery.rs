//! Recovery: explicit status queries (docs/design.md §8), approvals (docs/design.md §9), human review and
//! the operator log (docs/design.md §10), and the integrity audit.

use serde::Serialize;
use serde_json::{json, Value};

use super::canonical::{canonical_string, digest_value, sha256_hex, CallIdentity, Revisions, StatusRefError};
use super::envelope::{Code, Delivery, Envelope, ProtectedAudit};
use super::operation::{
    apply_business_effect, approval_amount, args_of, authorize, binding_of, business_rules, domain_call, op_envelope,
    receipt_binds, reserve, revisions_of, verify_approval, verify_row,
};
use super::tool::{Lookup, Reply};
use super::trace::{Answering, TraceEvent};
use super::{error_envelope, fresh_call_identity, with_detail, with_retry_after, Engine, EngineError};
use crate::failpoint;
use crate::store::AnswerKind;
use crate::store::Reason;
use crate::store::Step;
use crate::store::{
    ApprovalState, AttemptOutcome, AuditRow, CallIdentityRow, OpState, OperationRow, OutboxState, ReceiptRow,
    StoreError,
};

/// An explicit status query (docs/design.md §8).
#[derive(Debug, Clone, Default)]
pub struct QueryRequest {
    /// Tenant of the caller.
    pub tenant: String,
    /// Subject of the caller.
    pub subject: String,
    /// The opaque handle from the envelope.
    pub status_ref: String,
    /// The request digest the caller expects the operation to have.
    pub expected_request_sha256: String,
    /// The idempotency key, when the caller wants the scope checked too.
    pub idempotency_key: Option<String>,
    /// The query's own call identity (purpose `query_status`).
    pub call: Option<CallIdentity>,
    /// The operator who asked, when a human triggered it (recorded in the operator log).
    pub operator: Option<String>,
}

/// A human resolution.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Resolution {
    /// The effect happened (evidence: a receipt id).
    Succeeded,
    /// No effect.
    Failed,
    /// The effect happened and was undone.
    Compensated,
}

impl Resolution {
    /// Stable string.
    pub fn as_str(self) -> &'static str {
        match self {
            Resolution::Succeeded => "succeeded",
            Resolution::Failed => "failed",
            Resolution::Compensated => "compensated",
        }
    }

    /// The trace reason of a resolution's event.
    pub fn reason(self) -> Reason {
        match self {
            Resolution::Succeeded => Reason::Succeeded,
            Resolution::Failed => Reason::Failed,
            Resolution::Compensated => Reason::Compensated,
        }
    }
}

/// An operator's resolution of an unknown or needs-review operation.
#[derive(Debug, Clone)]
pub struct ResolveRequest {
    /// Operation.
    pub operation_id: String,
    /// Decision.
    pub resolution: Resolution,
    /// Who.
    pub operator: String,
    /// Why (mandatory).
    pub note: String,
    /// Receipt id (mandatory for `succeeded`).
    pub evidence: Option<String>,
    /// The version the operator saw; refused if the row changed since.
    pub seen_version: Option<i64>,
    /// The action's own id: repeating it returns the first outcome.
    pub action_id: Option<String>,
    /// The operator states that there is no evidence either way: required to
    /// resolve as failed an operation whose downstream cannot be asked (no
    /// lookup), and recorded as such in the operator log.
    pub no_evidence: bool,
}

/// Who acts on a late reply's receipt, in the operator log.
const LATE_REPLY_ACTOR: &str = "toolgate-late-reply";
pub use crate::store::SETTLE_ACTOR;

/// The outcome of an operator action (deny, resolve).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OperatorOutcome {
    /// Whether it was applied.
    pub applied: bool,
    /// `OK` or the refusal code (a stable code, never free text).
    pub code: &'static str,
    /// What happened.
    pub message: String,
    /// Operation concerned.
    pub operation_id: Option<String>,
    /// Approval concerned.
    pub approval_id: Option<String>,
}

/// Everything known about one operation (`ops show`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OperationDetail {
    /// The ledger row.
    pub operation: OperationRow,
    /// The outbox row.
    pub outbox: Option<crate::store::OutboxRow>,
    /// Attempts.
    pub attempts: Vec<crate::store::AttemptRow>,
    /// The trace timeline.
    pub trace: Vec<crate::store::TraceRow>,
    /// Operator-log rows.
    pub audit: Vec<AuditRow>,
    /// Until when a sent attempt may still land downstream (its sender is in
    /// the call or was detached from it, and the attempt's bound has not
    /// passed): "no effect" cannot be decided before then. `None` otherwise.
    pub may_land_until: Option<i64>,
    /// Until when a receipt may still appear in a lookup (a send that may
    /// have been received, plus the tool's attempt timeout and its
    /// downstream's `receipt_visible_within_ms`): a `not_found` before then
    /// is not proof of absence. `None` when that has passed.
    pub receipt_window_until: Option<i64>,
    /// What the resource the call touches looks like now, as its tool's domain
    /// describes it ((label, value) lines; an order's capture, refunds, holds).
    pub context: Vec<(String, String)>,
}

/// Until when a receipt of the operation may still appear in a lookup (its
/// attempts that may have been received, plus the attempt timeout and the
/// downstream's `receipt_visible_within_ms`), when that is after `now`.
fn receipt_window(
    attempts: &[crate::store::AttemptRow],
    contract: &super::contracts::Contract,
    now: i64,
) -> Option<i64> {
    let (timeout, visible) = (contract.retry.attempt_timeout_ms, contract.downstream.receipt_visible_within_ms());
    attempts.iter().filter_map(|a| a.receipt_may_appear_until(timeout, visible)).max().filter(|until| *until > now)
}

fn refused(
    code: &'static str,
    message: impl Into<String>,
    op: Option<&str>,
    approval: Option<&str>,
) -> OperatorOutcome {
    OperatorOutcome {
        applied: false,
        code,
        message: message.into(),
        operation_id: op.map(str::to_string),
        approval_id: approval.map(str::to_string),
    }
}

#[allow(clippy::too_many_arguments)]
fn audit_row(
    at: i64,
    action_id: Option<&str>,
    actor: &str,
    action: &str,
    op: Option<&str>,
    approval: Option<&str>,
    applied: bool,
    reason: &str,
    evidence: &Value,
) -> AuditRow {
    AuditRow {
        seq: 0,
        at,
        action_id: action_id.map(str::to_string),
        actor: actor.to_string(),
        action: action.to_string(),
        operation_id: op.map(str::to_string),
        approval_id: approval.map(str::to_string),
        result: if applied { "applied" } else { "refused" }.to_string(),
        reason: reason.to_string(),
        evidence: canonical_string(evidence),
        chain_sha256: None,
    }
}

enum QueryStep {
    Answer(Envelope),
    Lookup(Box<OperationRow>),
}

impl Engine {
    /// `query_operation_status(status_ref, expected_request_sha256)`, in the order
    /// of docs/design.md §8. It never executes the tool.
    pub fn query_operation_status(&mut self, q: &QueryRequest) -> Result<Envelope, EngineError> {
        let toolset = self.toolset.clone();
        if let Some(op) = &q.operator {
            super::check_operator(op)?;
        }
        let started = Some(Answering::now(AnswerKind::Query));
        let now = self.clock.now_ms();
        let salt = self.salt.clone();
        let call = q.call.clone().unwrap_or_else(fresh_call_identity);
        // The same validation and answer as a dispatch's.
        super::check_call_identity(&call).map_err(|(part, why)| {
            EngineError::invalid(Code::InvalidArguments.as_str(), format!("/call/{part}: {why}"))
        })?;
        let pref = self.principal_ref(&q.tenant, &q.subject);
        let audit =
            ProtectedAudit { principal_ref: pref.clone(), provider: Some(call.clone()), ..ProtectedAudit::default() };
        let mut ev = TraceEvent::step(Step::Query);
        ev.call = Some(call.clone());
        ev.tenant_ref = Some(self.hashed("tenant", &q.tenant));
        ev.subject_ref = Some(self.hashed("subject", &q.subject));
        // 1. Strict status_ref check, before any lookup.
        if let Err(e) = self.refs.verify(&q.status_ref) {
            let env = match e {
                StatusRefError::Malformed => with_detail(
                    error_envelope(Code::InvalidArguments, audit),
                    json!({"pointer": "/status_ref", "reason": "malformed status_ref"}),
                ),
                StatusRefError::Forged => error_envelope(Code::NotFound, audit),
            };
            ev.note = Some(e.to_string());
            ev.reason = Some(match e {
                StatusRefError::Malformed => Reason::StatusRefMalformed,
                StatusRefError::Forged => Reason::StatusRefForged,
            });
            let ev = ev.from_envelope(&env).answering(started);
            self.store.write_relaxed(|tx| ev.write(tx, now))?;
            return Ok(env);
        }
        let expected = q.expected_request_sha256.as_str();
        if expected.len() != 64 || !expected.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
            let env = with_detail(
                error_envelope(Code::InvalidArguments, audit),
                json!({"pointer": "/expected_request_sha256", "reason": "must be 64 lower-case hex digits"}),
            );
            let ev = ev.because(Reason::BadExpectedDigest).from_envelope(&env).answering(started);
            self.store.write_relaxed(|tx| ev.write(tx, now))?;
            return Ok(env);
        }
        let contracts = self.contracts.clone();
        let status_ref_sha = sha256_hex(q.status_ref.as_bytes());
        // This transaction changes no state: it binds the query's call identity
        // and records the answer, or hands over to the lookup. Its commit need
        // not wait for the disk; the backfill below is synced.
        let step = self.store.write_relaxed(|tx| -> Result<QueryStep, EngineError> {
            let answer = |env: Envelope, mut ev: TraceEvent| -> Result<QueryStep, EngineError> {
                ev = ev.from_envelope(&env).answering(started);
                ev.write(tx, now)?;
                Ok(QueryStep::Answer(env))
            };
            // 2. Current authorization.
            // Refusals before authorization name no operation: nothing leaks to the trace either.
            let Some(op) = tx.operation_by_status_ref(&q.status_ref)? else {
                return answer(
                    error_envelope(Code::NotFound, audit.clone()),
                    ev.clone().because(Reason::NoSuchOperation),
                );
            };
            if op.tenant != q.tenant || op.subject != q.subject {
                return answer(
                    error_envelope(Code::NotFound, audit.clone()),
                    ev.clone().because(Reason::OtherPrincipal),
                );
            }
            if let Some(code) = authorize(
                tx,
                &*toolset.domain(&op.tool),
                &op.tenant,
                &op.subject,
                &op.tool,
                &args_of(&op.request_json),
            )? {
                let ev = ev.clone().because(Reason::CurrentAuthorization);
                return answer(error_envelope(code, audit.clone()), ev);
            }
            // From here on the event carries the operation's fields and the query's own call identity.
            let mut ev =
                TraceEvent { call: Some(call.clone()), ..TraceEvent::of_operation(Step::Query, &op, &salt, now) };
            // 3. Digest, scope, provider profile, contract revisions.
            let contract_rev = contracts.get(&op.tool).map(|c| c.revisions);
            let mismatch = if expected != op.request_sha256 {
                Some("expected request digest does not match")
            } else if q.idempotency_key.as_deref().is_some_and(|k| k != op.idem_key) {
                Some("idempotency key does not match the operation's scope")
            } else if call.provider != op.call_provider || call.api_family != op.call_api_family {
                Some("provider profile does not match")
            } else if contract_rev != Some(revisions_of(&op)) {
                Some("contract revisions changed since the operation was accepted")
            } else {
                None
            };
            if let Some(why) = mismatch {
                ev.note = Some(why.into());
                ev.reason = Some(Reason::ScopeMismatch);
                let env = with_detail(error_envelope(Code::StatusConflict, audit.clone()), json!({"reason": why}));
                return answer(env, ev);
            }
            // The query's own call identity, bound to the purpose query_status.
            let ck = call.key(&q.tenant, &q.subject);
            if let Some(bound) = tx.call_identity(&ck)? {
                if bound.purpose != "query_status"
                    || bound.request_sha256 != expected
                    || bound.key_sha256 != status_ref_sha
                {
                    return answer(
                        error_envelope(Code::CallIdConflict, audit.clone()),
                        ev.because(Reason::CallIdConflict),
                    );
                }
            }
            tx.bind_call_identity(
                &ck,
                &CallIdentityRow {
                    purpose: "query_status".into(),
                    request_sha256: expected.to_string(),
                    key_sha256: status_ref_sha.clone(),
                    operation_id: Some(op.id.clone()),
                },
                now,
            )?;
            if let Err(why) = verify_row(&op, &salt) {
                ev.step = Step::TamperDetected;
                ev.note = Some(why.into());
                let env = with_detail(
                    error_envelope(Code::StatusConflict, audit.clone()),
                    json!({"reason": "stored record failed its integrity check"}),
                );
                return answer(env, ev.because(Reason::Tampered));
            }
            match op.state {
                OpState::Succeeded | OpState::Failed => {
                    let reconciled = op.last_query_result.as_deref() == Some(Reason::Reconciled.as_str());
                    let d = if reconciled { Delivery::ReceiptReconciled } else { Delivery::LocalReplay };
                    answer(op_envelope(&op, d, pref.clone(), None), ev.because(Reason::Replay))
                }
                OpState::Resolved => answer(
                    op_envelope(&op, Delivery::HumanResolved, pref.clone(), None),
                    ev.because(Reason::ReplayResolved),
                ),
                _ => Ok(QueryStep::Lookup(Box::new(op))),
            }
        })?;
        let op = match step {
            QueryStep::Answer(env) => return Ok(env),
            QueryStep::Lookup(op) => op,
        };
        // 4. Downstream lookup, outside any ledger transaction.
        let Some(contract) = contracts.get(&op.tool) else {
            return Err(EngineError::invalid("UNKNOWN_TOOL", "operation names a tool not in the catalog"));
        };
        // A status query carries no deadline of its own: the lookup is bounded
        // like one attempt of the tool.
        let (lookup, asked) = self.ask_downstream(&op, contract, now)?;
        let actor = q.operator.clone().unwrap_or_else(|| pref.clone());
        let out = self.store.write(|tx| -> Result<Envelope, EngineError> {
            let Some(mut cur) = tx.operation(&op.id)? else {
                return Err(EngineError::invalid("NO_SUCH_OPERATION", "no such operation"));
            };
            let mut ev = TraceEvent { call: Some(call.clone()), ..TraceEvent::of_operation(Step::Query, &cur, &salt, now) };
            if cur.version != op.version {
                // Changed while we looked (a worker or another query finished it): report what it is now.
                let env = op_envelope(&cur, Delivery::LocalReplay, pref.clone(), None);
                ev.note = Some("changed during lookup".into());
                ev.because(Reason::ChangedDuringLookup).from_envelope(&env).answering(started).write(tx, now)?;
                return Ok(env);
            }
            cur.updated_at = now;
            cur.last_query_at = Some(now);
            let mut anomaly = None;
            let mut query_again_at = None;
            let (result, env, reason): (Reason, Option<Code>, std::borrow::Cow<'static, str>) = match lookup.clone() {
                Lookup::Found(r) => {
                    ev.receipt_id = Some(r.receipt_id.clone());
                    ev.downstream_request_id = Some(r.request_id.clone());
                    // Evidence only when bound to this request, recorded for no
                    // other operation, and within the output contract.
                    let owner = tx.receipt_owner(&r.receipt_id)?;
                    let why_not = receipt_binds(contract, &cur, &r)
                        .err()
                        .or_else(|| {
                            owner.as_ref().filter(|o| **o != cur.id).map(|_| "the receipt is another operation's")
                        })
                        .or_else(|| {
                            contract.check_output(&r.result).err().map(|_| "the receipt breaks the output contract")
                        });
                    if why_not.is_none() {
                        failpoint::hit("inside_reconcile");
                        let result_json = canonical_string(&r.result);
                        cur.result_sha256 = Some(sha256_hex(result_json.as_bytes()));
                        cur.result_json = Some(result_json);
                        cur.downstream_request_id = Some(r.request_id.clone());
                        cur.receipt_id = Some(r.receipt_id.clone());
                        cur.state = crate::store::OpState::Succeeded;
                        cur.code = None;
                        cur.call_binding_sha256 = binding_of(&cur);
                        tx.insert_receipt(&ReceiptRow {
                            receipt_id: r.receipt_id.clone(),
                            operation_id: cur.id.clone(),
                            request_id: r.request_id.clone(),
                            // A provider that records no digest: the key links it to what we sent.
                            body_sha256: r.body_sha256.clone().unwrap_or_else(|| cur.request_sha256.clone()),
                            result_sha256: cur.result_sha256.clone().unwrap_or_default(),
                            source: "query".into(),
                            recorded_at: now,
                        })?;
                        anomaly = apply_business_effect(tx, &*toolset.domain(&cur.tool), &cur)?;
                        if let Some(ob) = tx.outbox(&cur.id)? {
                            if ob.attempt > 0 {
                                tx.finish_attempt(&cur.id, ob.attempt, AttemptOutcome::Committed, None, now)?;
                            }
                        }
                        tx.close_outbox(&cur.id, OutboxState::Done, None)?;
                        (Reason::Reconciled, None, "receipt matches: backfilled".into())
                    } else {
                        cur.state = crate::store::OpState::NeedsReview;
                        cur.code = Some(Code::StatusConflict.as_str().into());
                        tx.close_outbox(&cur.id, OutboxState::Parked, Some(Code::StatusConflict.as_str()))?;
                        (
                            Reason::Mismatch,
                            Some(Code::StatusConflict),
                            why_not.unwrap_or("receipt does not match the request").into(),
                        )
                    }
                }
                Lookup::NotFound => {
                    match receipt_window(&tx.attempts(&cur.id)?, contract, now) {
                        // Receipts can lag: within the window "none" is not
                        // "no effect", and the answer says when to ask again.
                        Some(until) => {
                            query_again_at = Some(until);
                            (
                                Reason::NotFound,
                                None,
                                "no receipt yet, and one may still appear: query again after the receipt window".into(),
                            )
                        }
                        None => (Reason::NotFound, None, "no receipt (yet): still unknown".into()),
                    }
                }
                Lookup::Unavailable => {
                    (Reason::Unavailable, None, "lookup unavailable: still unknown".into())
                }
                // Nothing can be asked of this downstream: only a person can tell.
                Lookup::Unsupported => {
                    cur.state = OpState::NeedsReview;
                    tx.close_outbox(&cur.id, OutboxState::Parked, Some(Code::OutcomeUnknown.as_str()))?;
                    (Reason::Unsupported, None, "the downstream cannot be asked: a person must check and decide".into())
                }
                // It holds another request under the key, or refused this one re-sent.
                Lookup::Conflict(why) => {
                    cur.state = crate::store::OpState::NeedsReview;
                    cur.code = Some(Code::StatusConflict.as_str().into());
                    tx.close_outbox(&cur.id, OutboxState::Parked, Some(Code::StatusConflict.as_str()))?;
                    (Reason::Mismatch, Some(Code::StatusConflict), why.into())
                }
            };
            let _ = env;
            cur.last_query_result = Some(result.as_str().into());
            tx.update_operation(&cur)?.or_stale()?;
            cur.version += 1;
            let delivery = if result == Reason::Reconciled { Delivery::ReceiptReconciled } else { Delivery::LocalReplay };
            let mut env = op_envelope(&cur, delivery, pref.clone(), None);
            if let Some(until) = query_again_at {
                env = with_detail(
                    with_retry_after(env, (until - now).max(1) as u64),
                    json!({"query_again_after": super::clock::rfc3339(until), "receipt_visible_within_ms": contract.downstream.receipt_visible_within_ms()}),
                );
                ev.retry_after_ms = Some((until - now).max(1) as u64);
            }
            let asked = asked.as_deref().map(|a| format!(" ({a})")).unwrap_or_default();
            ev.note = Some(match anomaly {
                Some(a) => format!("{reason}{asked}; {a}"),
                None => format!("{reason}{asked}"),
            });
            ev.reason = Some(result);
            // The receipt ids were set from the lookup; the digests come from the row as it is now.
            ev.result_sha256.clone_from(&cur.result_sha256);
            ev.call_binding_sha256 = Some(cur.call_binding_sha256.clone());
            ev.from_envelope(&env).answering(started).write(tx, now)?;
            tx.insert_audit(&audit_row(
                now,
                None,
                &actor,
                "query",
                Some(&cur.id),
                None,
                true,
                &reason,
                &json!({"lookup": result, "receipt_id": cur.receipt_id, "version": cur.version}),
            ))?;
            Ok(env)
        })?;
        Ok(out)
    }

    /// What a status query asks of the downstream: its lookup by key or, for a
    /// downstream asked by re-sending (`downstream.lookup.by = resend`), the
    /// very same request under the same key, which a downstream that
    /// de-duplicates keys answers from its first execution (and executes now
    /// if it never did: once, either way). Never past the time the downstream
    /// remembers keys: then nothing can be asked. Only the status query of an
    /// operation still open re-sends; a person's evidence, the audit and the
    /// retention re-check only ever read (a re-send downstream answers them
    /// `Unsupported` through its lookup by key, which it does not have).
    fn ask_downstream(
        &mut self,
        op: &OperationRow,
        contract: &super::contracts::Contract,
        now: i64,
    ) -> Result<(Lookup, Option<String>), EngineError> {
        let timeout_ms = contract.retry.attempt_timeout_ms;
        let Some(retention_ms) = contract.downstream.resend_retention_ms() else {
            return Ok((self.downstream(&contract.downstream.name)?.lookup(&op.downstream_key, timeout_ms)?, None));
        };
        let age_ms = now.saturating_sub(op.created_at).max(0);
        if age_ms >= retention_ms as i64 {
            let why = format!(
                "not re-sent: the downstream remembers keys for {}s and this call was accepted {}s ago, so a re-send could act again",
                retention_ms / 1000,
                age_ms / 1000
            );
            return Ok((Lookup::Unsupported, Some(why)));
        }
        let req = super::dispatch::downstream_request(op, timeout_ms);
        let reply = self.downstream(&contract.downstream.name)?.execute(&op.downstream_key, &req)?;
        let lookup = match reply {
            Reply::Committed(r) => Lookup::Found(r),
            Reply::KeyConflict => Lookup::Conflict(
                "the downstream holds another request under this key (key in use with another body)".into(),
            ),
            // Its words stay out of the trace (they may echo the arguments).
            // Asked again, the tool fails again: another re-send could act
            // each time it is tried; a person looks at what it said.
            Reply::ToolFailed(_) => Lookup::Conflict(
                "the downstream's tool reported an error when the request was re-sent: a person decides".into(),
            ),
            Reply::Rejected { .. } => Lookup::Conflict(
                "the downstream refused the request re-sent under its key: a person confirms it had no effect".into(),
            ),
            // Not an answer yet (busy, refused for now, or lost again): still unknown.
            _ => Lookup::Unavailable,
        };
        Ok((lookup, Some("asked by re-sending the request under its key".into())))
    }

    /// A reply that came back after its lease was lost (a cancel or the reaper
    /// took the call from under its sender) carried a receipt. It is evidence,
    /// and acted on only through the provider's own word, asked by key: an
    /// operation still `unknown` gets the status query a person would run (a
    /// receipt that matches the request settles it, `receipt_reconciled`); one
    /// a person resolved as failed meanwhile is reopened as a contradiction
    /// (`needs_review`, both facts kept, in the operator log).
    pub(crate) fn act_on_late_receipt(&mut self, operation_id: &str) -> Result<(), EngineError> {
        let Some(op) = self.store.read(|tx| tx.operation(operation_id))? else { return Ok(()) };
        match op.state {
            OpState::Unknown => {
                self.operator_query(operation_id, LATE_REPLY_ACTOR)?;
            }
            // "Compensated" expects a receipt (the effect happened and was undone).
            OpState::Resolved if op.resolution.as_deref() == Some(Resolution::Failed.as_str()) => {
                let contracts = self.contracts.clone();
                let Some(contract) = contracts.get(&op.tool) else { return Ok(()) };
                let lookup = self
                    .downstream(&contract.downstream.name)?
                    .lookup(&op.downstream_key, contract.retry.attempt_timeout_ms)?;
                // Any receipt under this operation's key contradicts "no
                // effect" (one that is not bound to the request most of all:
                // something ran under the key); a person decides again.
                if let Lookup::Found(r) = lookup {
                    self.reopen_contradicted(&op, &r.receipt_id)?;
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Reopens an operation whose human decision ("no effect") the provider's
    /// receipt contradicts: `needs_review` with `STATUS_CONFLICT`, the decision
    /// (resolution, who, note) kept on the row beside the receipt, an operator
    /// log entry and a trace event. Nothing else changes: a person decides again.
    fn reopen_contradicted(&mut self, seen: &OperationRow, receipt_id: &str) -> Result<(), EngineError> {
        let now = self.clock.now_ms();
        let salt = self.salt.clone();
        let domain = self.toolset.domain(&seen.tool);
        self.store.write(|tx| -> Result<(), StoreError> {
            let Some(mut op) = tx.operation(&seen.id)? else { return Ok(()) };
            if op.version != seen.version || op.state != OpState::Resolved {
                return Ok(());
            }
            // Under review again, it holds again what it was granted: the money is gone.
            reserve(tx, &*domain, &op, &args_of(&op.request_json), now)?;
            let decided = format!(
                "resolved as {} by {}",
                op.resolution.as_deref().unwrap_or("?"),
                op.resolved_by.as_deref().unwrap_or("?")
            );
            let why = format!("the provider holds receipt {receipt_id}: contradicts the decision ({decided})");
            op.state = OpState::NeedsReview;
            op.code = Some(Code::StatusConflict.as_str().into());
            op.last_query_at = Some(now);
            op.last_query_result = Some("contradiction".into());
            op.updated_at = now;
            if tx.update_operation(&op)?.is_stale() {
                return Ok(());
            }
            tx.insert_audit(&audit_row(
                now,
                None,
                LATE_REPLY_ACTOR,
                "contradiction",
                Some(&op.id),
                None,
                true,
                &why,
                &json!({
                    "receipt_id": receipt_id, "resolution": op.resolution, "resolved_by": op.resolved_by,
                    "resolution_note": op.resolution_note,
                }),
            ))?;
            let mut ev = TraceEvent::of_operation(Step::LateReply, &op, &salt, now);
            ev.receipt_id = Some(receipt_id.to_string());
            ev.code = Some(Code::StatusConflict);
            ev.note = Some(why);
            ev.because(Reason::ContradictsResolution).write(tx, now)?;
            Ok(())
        })?;
        Ok(())
    }

    /// Settles the unknown outcomes of tools whose downstream a worker asks by
    /// itself (`downstream.auto_query`: the default with `lookup.by = resend`):
    /// each one whose receipt window has passed, and that nobody asked within
    /// the last `receipt_visible_within_ms` (at least a second), gets the
    /// status query a person would run, logged as [`SETTLE_ACTOR`]. The
    /// query decides as always: a receipt bound to the request settles it,
    /// anything else leaves it unknown or sends it to a person. Returns how
    /// many were asked; one that cannot be asked now is logged and skipped.
    pub fn settle_unknown(&mut self, limit: usize) -> Result<usize, EngineError> {
        let contracts = self.contracts.clone();
        let now = self.clock.now_ms();
        let mut asked = 0;
        for c in contracts.all().iter().filter(|c| c.downstream.auto_query()) {
            if asked >= limit {
                break;
            }
            let every = c.downstream.receipt_visible_within_ms().clamp(1_000, 3_600_000) as i64;
            let ids = self.store.read(|tx| tx.unknown_to_ask(&c.name, now - every, (limit - asked) as i64))?;
            for id in ids {
                // Inside the receipt window a lookup can only say "not yet".
                if receipt_window(&self.store.read(|tx| tx.attempts(&id))?, c, now).is_some() {
                    continue;
                }
                match self.operator_query(&id, SETTLE_ACTOR) {
                    Ok(_) => asked += 1,
                    Err(e) => tracing::warn!(op = %id, error = %e, "settling an unknown outcome failed"),
                }
            }
        }
        Ok(asked)
    }

    /// An operator's explicit status query on an operation: the query runs as the
    /// operation's own principal and provider profile (authorization is still
    /// re-checked), with a fresh call identity, and the operator is logged.
    pub fn operator_query(&mut self, operation_id: &str, operator: &str) -> Result<Envelope, EngineError> {
        super::check_operator(operator)?;
        let Some(op) = self.store.read(|tx| tx.operation(operation_id))? else {
            return Err(self.missing_operation(operation_id));
        };
        let mut call = fresh_call_identity();
        call.provider.clone_from(&op.call_provider);
        call.api_family.clone_from(&op.call_api_family);
        self.query_operation_status(&QueryRequest {
            tenant: op.tenant.clone(),
            subject: op.subject.clone(),
            status_ref: op.status_ref.clone(),
            expected_request_sha256: op.request_sha256.clone(),
            idempotency_key: None,
            call: Some(call),
            operator: Some(operator.to_string()),
        })
    }

    /// Approves a pending request: the held call is accepted (operation + outbox in
    /// one transaction) and executed now. Refusals are `APPROVAL_INVALID`.
    pub fn approve(&mut self, approval_id: &str, approver: &str) -> Result<Envelope, EngineError> {
        super::check_operator(approver)?;
        let started = Some(Answering::now(AnswerKind::Approve));
        let now = self.clock.now_ms();
        let salt = self.salt.clone();
        let contracts = self.contracts.clone();
        let refs = self.refs.clone();
        let ids = self.ids.clone();
        let defenses = self.defenses()?;
        let toolset = self.toolset.clone();
        let scope = self.operator_scope.clone();
        let decided = self.store.write(|tx| -> Result<Result<String, (Envelope, String)>, EngineError> {
            let invalid = |why: &str, reason: Reason, a: Option<&crate::store::ApprovalRow>| -> Result<Result<String, (Envelope, String)>, EngineError> {
                tx.insert_audit(&audit_row(now, None, approver, "approve", None, Some(approval_id), false, why, &json!({
                    "approval_state": a.map(|a| a.state),
                    "expires_at": a.map(|a| a.expires_at),
                })))?;
                let mut env = with_detail(
                    error_envelope(Code::ApprovalInvalid, ProtectedAudit::default()),
                    json!({"approval_id": approval_id, "reason": why}),
                );
                env.protected_audit.approval_id = Some(approval_id.to_string());
                if let Some(a) = a {
                    env.protected_audit.tool.clone_from(&a.tool);
                }
                let mut ev = a.map_or_else(|| TraceEvent::step(Step::Approval), |a| TraceEvent::of_approval(Step::Approval, a, &salt));
                ev.approval_id = Some(approval_id.to_string());
                ev.note = Some(why.to_string());
                ev.because(reason).from_envelope(&env).answering(started).write(tx, now)?;
                Ok(Err((env, why.to_string())))
            };
            let Some(mut a) = tx.approval(approval_id)?.filter(|a| Engine::in_operator_scope(scope.as_deref(), &a.tenant)) else {
                return invalid("no such approval request", Reason::NoSuchApproval, None);
            };
            // The same approver again (its reply was lost): the call it
            // started answers, as a retried dispatch would (a replay of the
            // outcome, or the run itself when it never got to run).
            if let (ApprovalState::Approved, Some(op_id)) = (a.state, a.operation_id.as_ref()) {
                if a.decided_by.as_deref() == Some(approver) {
                    return Ok(Ok(op_id.clone()));
                }
            }
            if a.state != ApprovalState::Pending {
                let why = format!("approval is {}", a.state);
                return invalid(&why, Reason::NotPending, Some(&a));
            }
            if now >= a.expires_at {
                a.state = crate::store::ApprovalState::Expired;
                a.decided_at = Some(now);
                a.decided_by = Some("system".into());
                tx.decide_approval(&a)?.or_stale()?;
                return invalid("approval expired (expiry is exclusive)", Reason::ApprovalExpired, Some(&a));
            }
            if !tx.is_approver(&a.tenant, approver)? {
                return invalid("approver is not on the tenant's allowlist", Reason::NotAllowlisted, Some(&a));
            }
            if approver == a.subject {
                return invalid("requester cannot approve their own request", Reason::SelfApproval, Some(&a));
            }
            let Some(contract) = contracts.get(&a.tool) else {
                return invalid("tool no longer exists", Reason::UnknownTool, Some(&a));
            };
            let policy_rev = tx.tenant(&a.tenant)?.map_or(-1, |t| t.policy_revision);
            let rev = Revisions { input: a.input_rev, output: a.output_rev, effect: a.effect_rev };
            if policy_rev != a.policy_revision || contract.revisions != rev {
                a.state = crate::store::ApprovalState::Invalidated;
                a.decided_at = Some(now);
                a.decided_by = Some("system".into());
                tx.decide_approval(&a)?.or_stale()?;
                return invalid("policy or contract revision changed since the request", Reason::RevisionChanged, Some(&a));
            }
            let call = super::operation::approval_call(&a);
            if let Err(why) = verify_approval(&a) {
                return invalid(&format!("approval record failed its integrity check: {why}"), Reason::Tampered, Some(&a));
            }
            if tx.operation_by_scope(a.scope())?.is_some() {
                return invalid("the intent already has an operation", Reason::AlreadyAccepted, Some(&a));
            }
            // Accept the held call.
            let op = super::operation::new_operation_for([&a.tenant, &a.subject, &a.tool], contract, &call, &a.idem_key, &a.key_sha256, &a.request_json, &a.request_sha256, now, a.deadline_ms as u64, &refs, &ids, Some(&a.id), &salt);
            tx.insert_operation(&op)?;
            // The held call's rules are read now; what they grant is reserved with
            // the accept. A call they refuse is accepted without a hold, and its
            // worker's re-check fails it (one place decides that refusal).
            let domain = toolset.domain(&a.tool);
            let args = args_of(&a.request_json);
            if !defenses.balance_not_reserved
                && business_rules(tx, &*domain, [&a.tenant, &a.subject, &a.tool], &args, Some(&op.id))?.is_none()
            {
                reserve(tx, &*domain, &op, &args, now)?;
            }
            tx.insert_outbox(&op.id, i64::from(contract.retry.max_attempts), now)?;
            let ck = call.key(&a.tenant, &a.subject);
            tx.bind_call_identity(
                &ck,
                &CallIdentityRow {
                    purpose: "dispatch".into(),
                    request_sha256: a.request_sha256.clone(),
                    key_sha256: a.key_sha256.clone(),
                    operation_id: Some(op.id.clone()),
                },
                now,
            )?;
            a.state = crate::store::ApprovalState::Approved;
            a.decided_by = Some(approver.to_string());
            a.decided_at = Some(now);
            a.operation_id = Some(op.id.clone());
            a.approval_sha256 = Some(digest_value(&json!({"base": a.base_sha256, "approver": approver})));
            tx.decide_approval(&a)?.or_stale()?;
            tx.insert_audit(&audit_row(now, None, approver, "approve", Some(&op.id), Some(&a.id), true, "approved", &json!({
                "approval_sha256": a.approval_sha256, "request_sha256": a.request_sha256, "expires_at": a.expires_at,
                "amount_minor": approval_amount(&a),
            })))?;
            let mut ev = TraceEvent::of_operation(Step::Approval, &op, &salt, now);
            ev.policy_revision = Some(a.policy_revision);
            ev.note = Some("approved: held call accepted".into());
            ev.because(Reason::Approved).write(tx, now)?;
            Ok(Ok(op.id))
        })?;
        match decided {
            Ok(op_id) => self.run_operation(&op_id, &contracts, started),
            // The refusal's trace event was written with the refusal.
            Err((env, _)) => Ok(env),
        }
    }

    /// Denies a pending request (note mandatory).
    pub fn deny(&mut self, approval_id: &str, approver: &str, note: &str) -> Result<OperatorOutcome, EngineError> {
        super::check_operator(approver)?;
        super::check_operator_note(note)?;
        let scope = self.operator_scope.clone();
        let now = self.clock.now_ms();
        let salt = self.salt.clone();
        Ok(self.store.write(|tx| -> Result<OperatorOutcome, StoreError> {
            let refuse = |code: &'static str, why: &str| -> Result<OperatorOutcome, StoreError> {
                tx.insert_audit(&audit_row(
                    now,
                    None,
                    approver,
                    "deny",
                    None,
                    Some(approval_id),
                    false,
                    why,
                    &json!({"note": note}),
                ))?;
                Ok(refused(code, why, None, Some(approval_id)))
            };
            if note.trim().is_empty() {
                return refuse("NOTE_REQUIRED", "a denial needs a note");
            }
            let Some(mut a) =
                tx.approval(approval_id)?.filter(|a| Engine::in_operator_scope(scope.as_deref(), &a.tenant))
            else {
                return refuse("APPROVAL_INVALID", "no such approval request");
            };
            if a.state != ApprovalState::Pending || now >= a.expires_at {
                return refuse("APPROVAL_INVALID", "approval is not pending");
            }
            if !tx.is_approver(&a.tenant, approver)? || approver == a.subject {
                return refuse("APPROVAL_INVALID", "approver is not allowed to decide this request");
            }
            a.state = crate::store::ApprovalState::Denied;
            a.decided_by = Some(approver.to_string());
            a.decided_at = Some(now);
            a.note = Some(note.to_string());
            tx.decide_approval(&a)?.or_stale()?;
            tx.insert_audit(&audit_row(
                now,
                None,
                approver,
                "deny",
                None,
                Some(approval_id),
                true,
                note,
                &json!({
                    "request_sha256": a.request_sha256, "expires_at": a.expires_at, "amount_minor": approval_amount(&a),
                }),
            ))?;
            let mut ev = TraceEvent::of_approval(Step::Approval, &a, &salt);
            ev.code = Some(Code::ApprovalInvalid);
            ev.note = Some("denied".into());
            ev.because(Reason::Denied).write(tx, now)?;
            Ok(OperatorOutcome {
                applied: true,
                code: "OK",
                message: "denied".into(),
                operation_id: None,
                approval_id: Some(a.id),
            })
        })?)
    }

    /// Pending approval requests, soonest expiry first.
    pub fn pending_approvals(&mut self, limit: i64) -> Result<Vec<crate::store::ApprovalRow>, EngineError> {
        let mut rows = self.store.read(|tx| tx.pending_approvals(limit))?;
        rows.retain(|a| Engine::in_operator_scope(self.operator_scope.as_deref(), &a.tenant));
        Ok(rows)
    }

    /// Resolves an `unknown` / `needs_review` operation by a recorded human decision.
    pub fn resolve(&mut self, r: &ResolveRequest) -> Result<OperatorOutcome, EngineError> {
        self.resolve_with(r, false)
    }

    /// [`Engine::resolve`] for an operator who overrides what the provider's
    /// evidence says: applied, and the audit entry records it as made against
    /// the evidence (with the evidence and the mandatory note).
    pub fn resolve_against_evidence(&mut self, r: &ResolveRequest) -> Result<OperatorOutcome, EngineError> {
        self.resolve_with(r, true)
    }

    /// What the downstream says about an operation a person is about to
    /// resolve, and whether it contradicts the decision: a `failed` (no effect)
    /// decision against a receipt the provider holds, a `succeeded` one whose
    /// receipt id is not the provider's. `None` when there is nothing to check (no such
    /// operation, not resolvable, `compensated`, or no tool contract).
    fn decision_evidence(&mut self, r: &ResolveRequest) -> Result<Option<(Value, Option<String>)>, EngineError> {
        if !matches!(r.resolution, Resolution::Failed | Resolution::Succeeded) {
            return Ok(None);
        }
        let Some(op) = self.store.read(|tx| tx.operation(&r.operation_id))? else { return Ok(None) };
        if !Engine::in_operator_scope(self.operator_scope.as_deref(), &op.tenant) {
            return Ok(None);
        }
        if !matches!(op.state, OpState::Unknown | OpState::NeedsReview) {
            return Ok(None);
        }
        let contracts = self.contracts.clone();
        let Some(contract) = contracts.get(&op.tool) else { return Ok(None) };
        let claimed = r.evidence.as_deref().map(str::trim).filter(|e| !e.is_empty());
        let timeout_ms = contract.retry.attempt_timeout_ms;
        Ok(Some(match self.downstream(&contract.downstream.name)?.lookup(&op.downstream_key, timeout_ms)? {
            // A receipt under this operation's key contradicts "no effect" even
            // when it is not bound to the request (something ran under the
            // key); it is recorded with why it is not this request's.
            Lookup::Found(receipt) => {
                let unbound = receipt_binds(contract, &op, &receipt).err();
                let seen = json!({
                    "lookup": "found", "receipt_id": receipt.receipt_id, "request_id": receipt.request_id,
                    "not_bound": unbound,
                });
                let contra = match (r.resolution, claimed) {
                    (Resolution::Failed, _) => Some(format!(
                        "the provider holds receipt {} for this operation: the effect happened",
                        receipt.receipt_id
                    )),
                    (_, Some(c)) if c != receipt.receipt_id => {
                        Some(format!("the provider's receipt is {}, not {c}", receipt.receipt_id))
                    }
                    // The receipt named is the one under this key, but what it
                    // carries binds it to another request.
                    (Resolution::Succeeded, Some(_)) if unbound.is_some() => Some(format!(
                        "receipt {} is under this operation's key but not this request's ({})",
                        receipt.receipt_id,
                        unbound.unwrap_or_default()
                    )),
                    _ => None,
                };
                (seen, contra)
            }
            // No receipt (yet): receipts can lag, so this contradicts nothing;
            // the audit entry records that the provider showed none.
            Lookup::NotFound => (json!({"lookup": "not_found"}), None),
            // No evidence either way: the decision stands on the operator's word.
            Lookup::Unavailable => (json!({"lookup": "unavailable"}), None),
            Lookup::Unsupported => (json!({"lookup": "unsupported"}), None),
            Lookup::Conflict(why) => (json!({"lookup": "conflict", "why": why}), None),
        }))
    }

    fn resolve_with(&mut self, r: &ResolveRequest, against_evidence: bool) -> Result<OperatorOutcome, EngineError> {
        let toolset = self.toolset.clone();
        // An empty name or note is refused (and logged) below; a hostile one is
        // refused here, before anything of it is stored.
        if !r.operator.trim().is_empty() {
            super::check_operator(&r.operator)?;
        }
        super::check_operator_note(&r.note)?;
        if let Some(e) = &r.evidence {
            super::check_name("the evidence", e, super::MAX_CALL_PART_CHARS)
                .or_else(|m| if e.trim().is_empty() { Ok(()) } else { Err(m) })
                .map_err(|m| EngineError::invalid("INVALID_EVIDENCE", m))?;
        }
        // The provider's word first, outside any ledger transaction (a downstream call).
        let provider = self.decision_evidence(r)?;
        let scope = self.operator_scope.clone();
        let now = self.clock.now_ms();
        let salt = self.salt.clone();
        let contracts = self.contracts.clone();
        Ok(self.store.write(|tx| -> Result<OperatorOutcome, StoreError> {
            if let Some(id) = &r.action_id {
                if let Some(prev) = tx.audit_by_action_id(id)? {
                    return Ok(OperatorOutcome {
                        applied: prev.result == "applied",
                        code: if prev.result == "applied" { "OK" } else { "REFUSED" },
                        message: format!("action already recorded: {}", prev.reason),
                        operation_id: prev.operation_id,
                        approval_id: None,
                    });
                }
            }
            let op_ref = Some(r.operation_id.as_str());
            let cur = tx.operation(&r.operation_id)?.filter(|o| Engine::in_operator_scope(scope.as_deref(), &o.tenant));
            let snapshot = cur.as_ref().map(|o| json!({
                "state": o.state, "version": o.version, "code": o.code, "last_query_at": o.last_query_at,
                "last_query_result": o.last_query_result, "receipt_id": o.receipt_id,
            }));
            let refuse = |code: &'static str, why: String| -> Result<OperatorOutcome, StoreError> {
                let ev = json!({
                    "seen_version": r.seen_version, "current": snapshot, "resolution": r.resolution.as_str(), "evidence": r.evidence,
                    "note": r.note,
                    "provider_evidence": provider.as_ref().map(|(seen, _)| seen),
                });
                let op_exists = cur.is_some();
                tx.insert_audit(&audit_row(now, r.action_id.as_deref(), &r.operator, "resolve", op_exists.then_some(r.operation_id.as_str()), None, false, &why, &ev))?;
                if let Some(op) = &cur {
                    // A refused attempt is part of the operation's story too (the operator log has who and why).
                    let mut t = TraceEvent::of_operation(Step::Resolution, op, &salt, now);
                    t.note = Some(format!("refused: {}", code.to_ascii_lowercase()));
                    t.because(Reason::Refused).write(tx, now)?;
                }
                Ok(refused(code, why, op_ref, None))
            };
            if r.operator.trim().is_empty() {
                return refuse("OPERATOR_REQUIRED", "an operator identity is required".into());
            }
            if r.note.trim().is_empty() {
                return refuse("NOTE_REQUIRED", "a resolution needs a note".into());
            }
            let Some(mut op) = cur.clone() else {
                return refuse("NO_SUCH_OPERATION", "no such operation".into());
            };
            // A succeeded operation whose receipt the ledger recorded for
            // another operation (one receipt bound to two: a lookup taken
            // before receipts were checked for their binding) is the one
            // success a person may overrule, against its recorded success.
            let contested = match (op.state, op.receipt_id.as_deref()) {
                (OpState::Succeeded, Some(rc)) => {
                    tx.receipt_owner(rc)?.filter(|owner| *owner != op.id).map(|owner| (rc.to_string(), owner))
                }
                _ => None,
            };
            if !matches!(op.state, OpState::Unknown | OpState::NeedsReview) && contested.is_none() {
                return refuse("NOT_RESOLVABLE", format!("operation is {}; only unknown or needs_review can be resolved", op.state));
            }
            if let Some((rc, owner)) = &contested {
                if !against_evidence {
                    return refuse(
                        "STATUS_CONFLICT",
                        format!("this operation succeeded on receipt {rc}, which the ledger recorded for operation {owner}: one receipt bound to two operations; resolve it against its recorded success (--against-evidence, with a note) as failed or compensated, or as succeeded with its own receipt"),
                    );
                }
                if r.resolution == Resolution::Succeeded && r.evidence.as_deref().map(str::trim) == Some(rc.as_str()) {
                    return refuse("EVIDENCE_REQUIRED", format!("receipt {rc} is operation {owner}'s: resolve as succeeded only with this operation's own receipt"));
                }
            }
            if let Some(seen) = r.seen_version {
                if seen != op.version {
                    return refuse("STALE_VERSION", format!("operation changed since you saw it (you saw version {seen}, it is now {})", op.version));
                }
            }
            // "No effect" is not a decision anyone can make while a send may still
            // land: the attempt's own bound has to pass first (succeeded, with the
            // receipt as evidence, is always allowed).
            if matches!(r.resolution, Resolution::Failed | Resolution::Compensated) {
                let timeout = contracts.get(&op.tool).map_or(0, |c| c.retry.attempt_timeout_ms);
                let open = tx
                    .attempts(&op.id)?
                    .into_iter()
                    .filter_map(|a| Some((a.attempt, a.may_land_until(timeout)?)))
                    .max_by_key(|(_, until)| *until);
                if let Some((attempt, until)) = open.filter(|(_, until)| *until > now) {
                    return refuse(
                        "SEND_MAY_STILL_LAND",
                        format!(
                            "attempt {attempt} was sent and may still land until {} (in {}s): decide {} after that, or resolve as succeeded with its receipt",
                            super::clock::rfc3339(until),
                            (until - now + 999) / 1000,
                            r.resolution.as_str()
                        ),
                    );
                }
            }
            // A downstream that cannot be asked leaves nothing that shows "no
            // effect": the operator has to say so, and it is recorded as such.
            let lookupless = contracts.get(&op.tool).is_some_and(|c| !c.downstream.looks_up_by_key());
            if lookupless && r.resolution == Resolution::Failed && !r.no_evidence {
                return refuse(
                    "NO_EVIDENCE_STATEMENT_REQUIRED",
                    format!(
                        "this tool's downstream has no lookup, so nothing shows that the call had no effect: resolve as {} only stating that there is no evidence either way (--no-evidence)",
                        r.resolution.as_str()
                    ),
                );
            }
            let evidence = r.evidence.as_deref().map(str::trim).filter(|e| !e.is_empty());
            if r.resolution == Resolution::Succeeded && evidence.is_none() {
                return refuse("EVIDENCE_REQUIRED", "resolving as succeeded needs a receipt id as evidence".into());
            }
            // One receipt is evidence for one operation: a receipt the ledger
            // recorded for another is never this one's, whatever a person says.
            if let (Resolution::Succeeded, Some(e)) = (r.resolution, evidence) {
                if let Some(owner) = tx.receipt_owner(e)?.filter(|o| *o != op.id) {
                    return refuse(
                        "STATUS_CONFLICT",
                        format!("receipt {e} is recorded for operation {owner}: a receipt is evidence for one operation only; name this operation's own receipt"),
                    );
                }
            }
            let contradiction = provider.as_ref().and_then(|(_, c)| c.clone());
            if let Some(why) = &contradiction {
                if !against_evidence {
                    return refuse(
                        "STATUS_CONFLICT",
                        format!("{why}; resolve as {} only against the evidence (--against-evidence, with a note)", r.resolution.as_str()),
                    );
                }
            }
            // "The provider has no record" is not proof of absence while a
            // receipt may still appear: failed waits for the window, unless
            // decided against the evidence (recorded as such).
            let receipt_open = match contracts.get(&op.tool) {
                Some(c) if r.resolution == Resolution::Failed && c.downstream.can_look_up() => {
                    receipt_window(&tx.attempts(&op.id)?, c, now)
                }
                _ => None,
            };
            if let Some(until) = receipt_open.filter(|_| !against_evidence) {
                return refuse(
                    "RECEIPT_MAY_STILL_APPEAR",
                    format!(
                        "the provider's receipts can take up to {}s to appear: query again after {} (in {}s) before deciding failed, or decide against the evidence (--against-evidence)",
                        contracts.get(&op.tool).map_or(0, |c| c.downstream.receipt_visible_within_ms() / 1000),
                        super::clock::rfc3339(until),
                        (until - now + 999) / 1000
                    ),
                );
            }
            let result = json!({"resolution": r.resolution.as_str(), "receipt_id": evidence, "resolved_by": r.operator});
            let result_json = canonical_string(&result);
            // The result the contested receipt gave, for undoing its local effect.
            let contested_result = contested.as_ref().and(op.result_json.clone());
            op.result_sha256 = Some(sha256_hex(result_json.as_bytes()));
            op.result_json = Some(result_json);
            if let Some(e) = evidence {
                op.receipt_id = Some(e.to_string());
            }
            if contested.is_some() {
                // The other operation's receipt and request are not this one's.
                op.receipt_id = evidence.map(str::to_string);
                op.downstream_request_id = None;
            }
            op.state = crate::store::OpState::Resolved;
            op.resolution = Some(r.resolution.as_str().into());
            op.resolution_note = Some(r.note.clone());
            op.resolved_by = Some(r.operator.clone());
            op.updated_at = now;
            op.call_binding_sha256 = binding_of(&op);
            // The fenced write first: if the row moved, nothing else of the
            // resolution is written (the refusal's audit row is all that commits).
            if tx.update_operation(&op)?.is_stale() {
                return refuse("STALE_VERSION", "operation changed while resolving".into());
            }
            let anomaly = match (&contested, r.resolution) {
                // Its local effect was applied when the receipt was taken: an
                // effect of its own keeps it, once; none undoes it.
                (Some(_), Resolution::Succeeded) => None,
                (Some(_), _) => {
                    let args = super::operation::args_of(&op.request_json);
                    let result = contested_result.as_deref().and_then(|t| serde_json::from_str(t).ok()).unwrap_or(Value::Null);
                    toolset.domain(&op.tool).revert(&tx.domain(), &super::operation::domain_call(&op, &args), &result)?;
                    None
                }
                (None, Resolution::Succeeded) => apply_business_effect(tx, &*toolset.domain(&op.tool), &op)?,
                (None, _) => None,
            };
            tx.close_outbox(&op.id, OutboxState::Done, None)?;
            let ev = json!({
                "seen_version": r.seen_version, "before": snapshot, "resolution": r.resolution.as_str(), "evidence": evidence,
                "provider_evidence": provider.as_ref().map(|(seen, _)| seen),
                "against_evidence": contradiction,
                "no_evidence_either_way": r.no_evidence,
                "receipt_window_open_until": receipt_open,
                "contested_receipt": contested.as_ref().map(|(rc, owner)| json!({"receipt_id": rc, "recorded_for": owner})),
            });
            tx.insert_audit(&audit_row(now, r.action_id.as_deref(), &r.operator, "resolve", op_ref, None, true, &r.note, &ev))?;
            let mut t = TraceEvent::of_operation(Step::Resolution, &op, &salt, now);
            t.delivery = Some("human_resolved");
            t.outcome = Some(if r.resolution == Resolution::Failed { "unknown" } else { "committed" });
            t.note = Some(match anomaly {
                Some(a) => format!("resolved as {}; {a}", r.resolution.as_str()),
                None => format!("resolved as {}", r.resolution.as_str()),
            });
            t.because(r.resolution.reason()).write(tx, now)?;
            Ok(OperatorOutcome {
                applied: true,
                code: "OK",
                message: format!("resolved as {}", r.resolution.as_str()),
                operation_id: Some(op.id),
                approval_id: None,
            })
        })?)
    }

    /// One operation with its outbox row, attempts, trace and operator log.
    /// `None` when there is no such operation; `OPERATION_PURGED` (saying when
    /// and what it was) when its retention ended and it was purged.
    pub fn operation_detail(&mut self, id: &str) -> Result<Option<OperationDetail>, EngineError> {
        let contracts = self.contracts.clone();
        let toolset = self.toolset.clone();
        let now = self.clock.now_ms();
        let found = self.store.read(|tx| -> Result<_, StoreError> {
            let Some(operation) = tx.operation(id)? else {
                return Ok(tx.tombstone(id)?.map(Err));
            };
            let attempts = tx.attempts(id)?;
            let timeout = contracts.get(&operation.tool).map_or(0, |c| c.retry.attempt_timeout_ms);
            let may_land_until =
                attempts.iter().filter_map(|a| a.may_land_until(timeout)).max().filter(|until| *until > now);
            let receipt_window_until = match contracts.get(&operation.tool) {
                Some(c) => receipt_window(&attempts, c, now),
                None => None,
            };
            let args = args_of(&operation.request_json);
            let context = toolset.domain(&operation.tool).context(&tx.domain(), &domain_call(&operation, &args))?;
            Ok(Some(Ok(OperationDetail {
                outbox: tx.outbox(id)?,
                attempts,
                trace: tx.trace_for(id)?,
                audit: tx.audit_for(id)?,
                operation,
                may_land_until,
                receipt_window_until,
                context,
            })))
        })?;
        match found {
            Some(Err(t)) => Err(super::retention::purged_error(&t)),
            Some(Ok(d)) => Ok(Some(d)),
            None => Ok(None),
        }
    }

    /// Operations, newest first.
    pub fn list_operations(&mut self, state: Option<OpState>, limit: i64) -> Result<Vec<OperationRow>, EngineError> {
        Ok(self.store.read(|tx| tx.list_operations(state, limit, None))?)
    }
}
