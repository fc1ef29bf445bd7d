//! The dispatch pipeline (docs/design.md §5), the outbox worker and the reaper (docs/design.md §6).

use std::panic::AssertUnwindSafe;
use std::time::Instant;

use serde_json::{json, Value};

use super::cancel::{CancelRequest, CancelSignal};
use super::canonical::{
    canonical_string, parse_strict, request_object, sha256_hex, CallIdentity, MAX_DEPTH, MAX_INPUT_BYTES,
};
use super::contracts::{ApprovalPolicy, Contract, Contracts, Effect};
use super::envelope::{Code, Delivery, Envelope, Execution, ModelResult, Outcome, ProtectedAudit, Status};
use super::lab::{caller_key, scope_key, MASKED_CONFLICT};
use super::operation::{
    apply_business_effect, args_of, authorize, binding_of, business_rules, intent_of, new_operation_for, op_envelope,
    reserve, revisions_of, verify_row, APPROVAL_TTL_MS,
};
use super::policy::{self, backoff_ms, Admission};
use super::tool::{DownstreamRequest, Reply};
use super::tool::{ToolCall, ToolDomain};
use super::trace::{Answering, TraceEvent};
use super::{error_envelope, fresh_call_identity, with_detail, with_retry_after, DefensesOff, Engine, EngineError};
use crate::failpoint;
use crate::store::Step;
use crate::store::{
    ApprovalRow, ApprovalState, AttemptOutcome, CallIdentityRow, CallKey, CircuitState, ForClaim, OpState,
    OperationRow, OutboxState, ReceiptRow, StoreError, Sync, Tx, SENDER_DETACHED,
};

/// One tool call as a harness sends it.
#[derive(Debug, Clone, Default)]
pub struct DispatchRequest {
    /// Tenant.
    pub tenant: String,
    /// Subject (the principal the agent acts for).
    pub subject: String,
    /// Tool name.
    pub tool: String,
    /// Arguments, as the raw bytes of the JSON text the model produced (not
    /// necessarily valid UTF-8: that is checked here, not assumed).
    pub arguments: Vec<u8>,
    /// Caller-generated idempotency key (8..255 chars), stable per business intent.
    pub idempotency_key: Option<String>,
    /// Call identity; a fresh one when absent.
    pub call: Option<CallIdentity>,
    /// An approval the caller holds.
    pub approval_id: Option<String>,
    /// Operation deadline from now; the tool's default when absent.
    pub deadline_ms: Option<u64>,
    /// The API token the caller authenticated with (HTTP API, MCP): read again
    /// inside the transaction that decides the call, so a token revoked (or
    /// expired) between the request's authentication and its accept is
    /// refused there (`TOKEN_REVOKED` / `TOKEN_EXPIRED`), with nothing written.
    pub token_id: Option<String>,
}

/// What one reaper pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct ReapReport {
    /// Expired leases whose attempt was never sent: back to `accepted`.
    pub requeued_unsent: usize,
    /// Possibly-sent attempts re-queued because the downstream honours keys.
    pub requeued_same_key: usize,
    /// Possibly-sent attempts parked as `unknown`.
    pub parked_unknown: usize,
    /// Why the pass did nothing: the ledger's clock cannot be trusted here
    /// (see [`super::ledger_clock`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub clock_paused: Option<String>,
}

/// A key is 8..=255 printable ASCII characters.
fn valid_key(k: &str) -> bool {
    (8..=255).contains(&k.len()) && k.bytes().all(|b| (0x21..=0x7e).contains(&b))
}

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

const SEEN_SENT_SLOTS: usize = 16384;

impl Default for SeenSent {
    fn default() -> Self {
        Self(vec![0; SEEN_SENT_SLOTS].into_boxed_slice())
    }
}

impl SeenSent {
    /// Never 0, the empty slot.
    fn hash(tenant: &str, subject: &str, tool: &str, key: &str) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (tenant, subject, tool, key).hash(&mut h);
        h.finish() | 1
    }

    fn slot(h: u64) -> usize {
        (h % SEEN_SENT_SLOTS as u64) as usize
    }

    fn holds(&self, h: u64) -> bool {
        self.0[Self::slot(h)] == h
    }

    fn remember(&mut self, h: u64) {
        self.0[Self::slot(h)] = h;
    }

    fn forget(&mut self, h: u64) {
        if self.holds(h) {
            self.0[Self::slot(h)] = 0;
        }
    }
}

/// The operations an engine of this process is running right now (inside
/// `run_operation_from`): a lease whose holder is known to be alive. A
/// duplicate of one is `IN_PROGRESS`. A lease held by another process, or by
/// one that died with it (a crash before the result was stored), is not
/// known to be running: that duplicate is `OUTCOME_UNKNOWN`, as before.
static RUNNING: std::sync::Mutex<std::collections::BTreeSet<String>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

/// One entry of [`RUNNING`], removed when the run ends (or unwinds).
struct Running(String);

impl Running {
    fn start(op_id: &str) -> Self {
        RUNNING.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(op_id.to_string());
        Self(op_id.to_string())
    }

    fn holds(op_id: &str) -> bool {
        RUNNING.lock().unwrap_or_else(std::sync::PoisonError::into_inner).contains(op_id)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        RUNNING.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&self.0);
    }
}

/// What the accept transaction decided.
enum Decision {
    /// Answer now.
    Answer(Envelope, TraceEvent),
    /// Run the outbox row of this operation now (what `accept` decides; the
    /// synced accept transaction goes on to claim it, see [`Decision::Sending`]).
    /// `built`: the new row this very transaction inserted after authorizing
    /// the call and checking its business rules; the claim reads nothing of
    /// it back and checks none of that again.
    Execute { op_id: String, built: Option<Box<OperationRow>> },
    /// Accepted, claimed and marked sent in the accept's own transaction:
    /// send attempt `attempt` of `op`.
    Sending { attempt: i64, op: Box<OperationRow>, slot: super::bulkhead::Slot },
    /// The claim in the accept's transaction answered (its trace event written).
    Answered(Envelope),
    /// Accepted and, its caller having cancelled it first, cancelled in the
    /// same transaction: nothing was sent.
    CancelledBeforeSend(String),
    /// Found under the write lock of a relaxed transaction: this call changes
    /// state after all. Nothing was written; run `accept` again, synced.
    Synced,
}

/// What one claim decided.
enum Claim {
    /// We hold attempt `n`, and a send slot of its downstream's bulkhead
    /// until its outcome is persisted.
    Claimed { attempt: i64, op: Box<OperationRow>, slot: super::bulkhead::Slot },
    /// Not ours to run (or nothing to run): here is the state.
    Answer(Envelope),
}

/// What persisting a reply decided.
enum Persisted {
    Done(Envelope),
    RetryAfter(u64),
    /// A reply that came after the lease was lost, carrying a receipt: the
    /// caller gets `Envelope` (the operation as it stands), and the reply is
    /// evidence to act on once this transaction has committed.
    Late(Envelope),
}

impl Engine {
    fn reject(
        &mut self,
        code: Code,
        audit: ProtectedAudit,
        mut ev: TraceEvent,
        detail: Option<Value>,
        t0: Instant,
    ) -> Result<Envelope, EngineError> {
        let mut env = error_envelope(code, audit);
        if let Some(d) = detail {
            env = with_detail(env, d);
        }
        ev.step = Step::Rejected;
        ev.duration_us = Some(t0.elapsed().as_micros() as i64);
        let ev = ev.from_envelope(&env).answering(Some(Answering { kind: "dispatch", started: t0 }));
        let now = self.clock.now_ms();
        // Refused before any state: only the answer is recorded.
        self.store.write_relaxed(|tx| ev.write(tx, now))?;
        Ok(env)
    }

    /// Dispatches one tool call through the whole pipeline (docs/design.md §5). Expected
    /// outcomes, including every error of the catalog, come back as an [`Envelope`].
    pub fn dispatch(&mut self, req: &DispatchRequest) -> Result<Envelope, EngineError> {
        self.dispatch_with(req, None, None)
    }

    /// [`Engine::dispatch`] for a call that arrived at `arrived` and waited
    /// for an engine since (a server's queue): its deadline counts from its
    /// arrival, and a new intent whose deadline passed while it waited is
    /// refused before accept (`TIMEOUT_BEFORE_EXECUTE`, nothing stored but
    /// the trace event); its latency counts the wait.
    pub fn dispatch_arrived(&mut self, req: &DispatchRequest, arrived: Instant) -> Result<Envelope, EngineError> {
        self.dispatch_with(req, None, Some(arrived))
    }

    /// [`Engine::dispatch`] for a caller that may cancel the call while it
    /// waits for an engine: if `signal` was cancelled before the accept, the
    /// call is accepted and cancelled in one transaction (`CANCELLED`, no
    /// effect, the operator log naming `who` with `note`).
    pub fn dispatch_cancellable(
        &mut self,
        req: &DispatchRequest,
        signal: &CancelSignal,
        who: &str,
        note: &str,
    ) -> Result<Envelope, EngineError> {
        super::check_operator(who)?;
        super::check_operator_note(note)?;
        self.dispatch_with(req, Some((signal, who, note)), None)
    }

    fn dispatch_with(
        &mut self,
        req: &DispatchRequest,
        cancel: Option<(&CancelSignal, &str, &str)>,
        arrived: Option<Instant>,
    ) -> Result<Envelope, EngineError> {
        let t0 = arrived.unwrap_or_else(Instant::now);
        // What the call waited before an engine took it (a server's queue):
        // spent from its deadline. Measured here, once: the engine's own
        // work is not the caller's wait (and a call made in process waits
        // nothing, so its deadline is exactly the one it asked for).
        let waited_ms = arrived.map_or(0, |a| a.elapsed().as_millis() as u64);
        self.clock_tick();
        let contracts = self.contracts.clone();
        let call = req.call.clone().unwrap_or_else(fresh_call_identity);
        let principal_ref = self.principal_ref(&req.tenant, &req.subject);
        let mut audit = ProtectedAudit {
            principal_ref: principal_ref.clone(),
            provider: Some(call.clone()),
            tool: req.tool.clone(),
            ..ProtectedAudit::default()
        };
        let mut ev = TraceEvent::step(Step::Received);
        ev.call = Some(call.clone());
        ev.tenant_ref = Some(self.hashed("tenant", &req.tenant));
        ev.subject_ref = Some(self.hashed("subject", &req.subject));
        ev.arguments_sha256 = Some(sha256_hex(&req.arguments));
        ev.approval_id.clone_from(&req.approval_id);

        // 0. The call identity is printed on screens and stored: bounded, no control characters.
        if let Err((part, why)) = super::check_call_identity(&call) {
            let d = json!({"pointer": format!("/call/{part}"), "reason": why});
            return self.reject(Code::InvalidArguments, audit, ev, Some(d), t0);
        }
        // 1. Contract.
        let Some(contract) = contracts.get(&req.tool) else {
            return self.reject(Code::UnknownTool, audit, ev, None, t0);
        };
        ev.tool = Some(contract.name.clone());
        ev.revisions = Some(contract.revisions);
        ev.data_classification = Some(contract.data_classification.clone());
        audit.revisions = Some(contract.revisions);
        let args = match parse_strict(&req.arguments, MAX_INPUT_BYTES, MAX_DEPTH) {
            Ok(a) => a,
            Err(e) => {
                let d = json!({"pointer": "", "reason": e.to_string()});
                return self.reject(Code::InvalidArguments, audit, ev, Some(d), t0);
            }
        };
        if let Err(v) = contract.check_input(&args) {
            let d = json!({"pointer": v.pointer, "reason": v.reason});
            return self.reject(Code::InvalidArguments, audit, ev, Some(d), t0);
        }
        ev.checks.push("contract");
        let key = if contract.effect == Effect::Read {
            req.idempotency_key.clone().unwrap_or_default()
        } else {
            match req.idempotency_key.as_deref() {
                None | Some("") => return self.reject(Code::IdempotencyKeyRequired, audit, ev, None, t0),
                Some(k) if !valid_key(k) => {
                    let d =
                        json!({"pointer": "/idempotency_key", "reason": "must be 8..255 printable ASCII characters"});
                    return self.reject(Code::InvalidArguments, audit, ev, Some(d), t0);
                }
                Some(k) => k.to_string(),
            }
        };
        if contract.effect == Effect::Read {
            return self.read_tool(req, contract, &args, &key, &call, audit, ev, t0);
        }
        // With every defense on (always, outside a demo database's lab) the ledger
        // scope key is the caller's key.
        let defenses = self.defenses()?;
        let key = scope_key(&key, defenses, &self.instance, &self.ids);
        let key_sha256 = sha256_hex(key.as_bytes());
        ev.key_sha256 = Some(key_sha256.clone());
        let request = request_object(&req.tenant, &req.subject, &req.tool, &args, contract.revisions);
        let request_json = canonical_string(&request);
        let request_sha256 = sha256_hex(request_json.as_bytes());
        ev.request_sha256 = Some(request_sha256.clone());
        audit.binding.request_sha256 = Some(request_sha256.clone());

        let now = self.clock.now_ms();
        // The deadline counts from the call's arrival, not from when an
        // engine took it: what it waited in a queue is spent.
        let deadline_ms =
            req.deadline_ms.unwrap_or(contract.retry.deadline_ms).min(24 * 3_600_000).saturating_sub(waited_ms);
        let domain = self.domain(&req.tool);
        let ctx = AcceptCtx {
            req,
            contract,
            domain: &*domain,
            args: &args,
            call: &call,
            minted_call: req.call.is_none(),
            key: &key,
            key_sha256: &key_sha256,
            request_json: &request_json,
            request_sha256: &request_sha256,
            now,
            deadline_ms,
            principal_ref: &principal_ref,
            refs: &self.refs,
            ids: &self.ids,
            salt: &self.salt,
            defenses,
        };
        let clock = self.clock.clone();
        let (worker, salt) = (self.worker_id.clone(), self.salt.clone());
        let answering = Some(Answering { kind: "dispatch", started: t0 });
        let caller = Caller {
            principal_ref: &principal_ref,
            salt: &salt,
            answer: answering,
            reserve: !defenses.balance_not_reserved,
        };
        let lease_ms = contract.retry.attempt_timeout_ms as i64 + 1_000;
        let step = |tx: &Tx<'_>, audit: ProtectedAudit, ev: TraceEvent, relaxed: bool| {
            // The decision is made now, under the write lock: a time read before
            // waiting for it could be older than what another writer just
            // committed (an operation accepted "in the future" looks not due).
            let now = clock.now_ms().max(now);
            let d = accept(tx, &AcceptCtx { now, ..ctx }, audit, ev, relaxed)?;
            match d {
                Decision::Answer(env, ev) => {
                    // The decision's trace event commits with the decision itself.
                    let mut ev = ev.from_envelope(&env).answering(answering);
                    ev.duration_us = Some(t0.elapsed().as_micros() as i64);
                    ev.write(tx, now)?;
                    Ok(Decision::Answer(env, TraceEvent::step(Step::Answered)))
                }
                // Accept, claim and sent-marker share one commit (one fsync):
                // nothing lies between them that a crash could tell apart
                // (ARCHITECTURE.md, "Which commits wait for the disk").
                Decision::Execute { op_id, built } => {
                    if let Some((_, who, note)) = cancel.filter(|(s, _, _)| s.accepting()) {
                        let r = CancelRequest {
                            operation_id: op_id.clone(),
                            operator: who.to_string(),
                            note: note.to_string(),
                            ..CancelRequest::default()
                        };
                        super::cancel::cancel_in(tx, &r, now, &salt, &contracts, None)?;
                        return Ok(Decision::CancelledBeforeSend(op_id));
                    }
                    let built = built.map(|op| *op);
                    Ok(match claim_to_send(tx, &op_id, built, contract, &*domain, &worker, now, lease_ms, &caller)? {
                        Claim::Claimed { attempt, op, slot } => Decision::Sending { attempt, op, slot },
                        Claim::Answer(env) => Decision::Answered(env),
                    })
                }
                d => Ok::<_, EngineError>(d),
            }
        };
        // A call on an intent the ledger holds and has sent (a replay, a
        // conflict, an answer about an operation in flight) changes no state: it
        // only records how it was answered, and that commit need not wait for the
        // disk (`Store::write_relaxed`). A read first tells; `accept` re-checks
        // everything under the write lock and asks for a synced transaction
        // before any state change.
        // A scope this engine has answered with an operation skips that read
        // (see `SeenSent`: a hint that `accept` re-checks).
        let full = self.store.durability() == Sync::Full;
        let seen = SeenSent::hash(&req.tenant, &req.subject, &req.tool, &key);
        let known = full
            && (self.seen_sent.holds(seen)
                || self
                    .store
                    .read(|tx| tx.operation_state_by_scope(&req.tenant, &req.subject, &req.tool, &key))?
                    .is_some_and(|s| s != "accepted"));
        let mut decision = if known {
            self.store.write_relaxed(|tx| step(tx, audit.clone(), ev.clone(), true))?
        } else {
            Decision::Synced
        };
        if matches!(decision, Decision::Synced) {
            self.seen_sent.forget(seen);
            decision = self.store.write(|tx| step(tx, audit.clone(), ev.clone(), false))?;
        }
        let env = match decision {
            Decision::Answer(env, _) | Decision::Answered(env) => env,
            Decision::Sending { attempt, op, slot } => {
                let op_id = op.id.clone();
                self.run_operation_from(&op_id, &contracts, answering, Some((attempt, op, slot)))?
            }
            Decision::Execute { op_id, .. } => self.run_operation(&op_id, &contracts, answering)?,
            Decision::CancelledBeforeSend(op_id) => {
                let op = self.store.read(|tx| tx.operation(&op_id))?;
                let op = op.ok_or_else(|| EngineError::invalid("NO_SUCH_OPERATION", "cancelled operation vanished"))?;
                op_envelope(&op, Delivery::Fresh, principal_ref.clone(), None)
            }
            Decision::Synced => {
                return Err(EngineError::invalid("ACCEPT_RELAXED", "a synced accept asked for a synced accept"))
            }
        };
        if full && env.protected_audit.operation_id.is_some() {
            self.seen_sent.remember(seen);
        }
        Ok(env)
    }

    /// A read tool: authorization, the call-identity binding, the read, and its
    /// trace event, in one transaction. A read changes no state, so the commit
    /// only records how the call was answered (not fsynced), but the call
    /// identity is bound on first use like every other call's: the same identity
    /// with other arguments, another key or another purpose is `CALL_ID_CONFLICT`.
    #[allow(clippy::too_many_arguments)]
    fn read_tool(
        &mut self,
        req: &DispatchRequest,
        contract: &Contract,
        args: &Value,
        key: &str,
        call: &CallIdentity,
        mut audit: ProtectedAudit,
        mut ev: TraceEvent,
        t0: Instant,
    ) -> Result<Envelope, EngineError> {
        let (tenant, subject, tool) = (req.tenant.as_str(), req.subject.as_str(), req.tool.as_str());
        let request = request_object(tenant, subject, tool, args, contract.revisions);
        let request_sha256 = sha256_hex(canonical_string(&request).as_bytes());
        let key_sha256 = sha256_hex(key.as_bytes());
        ev.request_sha256 = Some(request_sha256.clone());
        ev.key_sha256 = Some(key_sha256.clone());
        audit.binding.request_sha256 = Some(request_sha256.clone());
        let clock = self.clock.clone();
        let domain = self.domain(tool);
        self.store.write_relaxed(|tx| -> Result<Envelope, EngineError> {
            let now = clock.now_ms();
            let mut ev = ev.clone();
            let audit = audit.clone();
            let env = 'answer: {
                if let Some(code) = authorize(tx, &*domain, tenant, subject, tool, args)? {
                    ev.step = Step::Authorization;
                    ev.reason = Some("current_authorization");
                    break 'answer error_envelope(code, audit);
                }
                ev.checks.push("authorization");
                let ck = call.key(tenant, subject);
                if let Some(bound) = tx.call_identity(&ck)? {
                    if bound.purpose != "dispatch"
                        || bound.request_sha256 != request_sha256
                        || bound.key_sha256 != key_sha256
                    {
                        ev.step = Step::CallIdentity;
                        ev.reason = Some("call_id_conflict");
                        break 'answer error_envelope(Code::CallIdConflict, audit);
                    }
                }
                ev.checks.push("call_identity");
                tx.bind_call_identity(
                    &ck,
                    &CallIdentityRow {
                        purpose: "dispatch".into(),
                        request_sha256: request_sha256.clone(),
                        key_sha256: key_sha256.clone(),
                        operation_id: None,
                    },
                    now,
                )?;
                let data = domain
                    .read(&tx.domain(), &ToolCall { tenant, subject, tool, arguments: args, operation_id: None })?;
                ev.step = Step::Read;
                match data {
                    Some(d) if contract.check_output(&d).is_ok() => {
                        let mut audit = audit;
                        audit.binding.result_sha256 = Some(super::canonical::digest_value(&d));
                        Envelope {
                            model_result: ModelResult {
                                status: Status::Succeeded,
                                data: Some(d),
                                error: None,
                                execution: Execution { outcome: Outcome::Committed, delivery: Delivery::Fresh },
                            },
                            protected_audit: audit,
                        }
                    }
                    // A read handler failure is safe to report: the contract says no write happened.
                    _ => error_envelope(Code::ToolError, audit),
                }
            };
            ev.duration_us = Some(t0.elapsed().as_micros() as i64);
            let ev = ev.from_envelope(&env).answering(Some(Answering { kind: "dispatch", started: t0 }));
            ev.write(tx, now)?;
            Ok(env)
        })
    }

    /// Runs the outbox row of one operation: claim, re-check, sent-marker,
    /// downstream call, fenced persist; retries `retry_after` failures within the
    /// deadline and the attempt cap. `answer` is the call waiting for the result
    /// (none for a worker pass): the event that ends the run answers it.
    pub(crate) fn run_operation(
        &mut self,
        op_id: &str,
        contracts: &Contracts,
        answer: Option<Answering>,
    ) -> Result<Envelope, EngineError> {
        self.run_operation_from(op_id, contracts, answer, None)
    }

    /// [`Engine::run_operation`], where `claimed` is an attempt already
    /// claimed and marked sent (in the accept's transaction) to send first.
    fn run_operation_from(
        &mut self,
        op_id: &str,
        contracts: &Contracts,
        answer: Option<Answering>,
        mut claimed: Option<(i64, Box<OperationRow>, super::bulkhead::Slot)>,
    ) -> Result<Envelope, EngineError> {
        let _running = Running::start(op_id);
        let mut attempts_this_call: u32 = 0;
        let salt = self.salt.clone();
        loop {
            let t0 = Instant::now();
            let worker = self.worker_id.clone();
            let (attempt, op, slot) = if let Some(c) = claimed.take() {
                c
            } else {
                let now = self.clock.now_ms();
                let defenses_now = self.defenses()?;
                let op0 = self.store.read(|tx| tx.operation(op_id))?;
                let Some(op0) = op0 else {
                    return Err(EngineError::invalid("NO_SUCH_OPERATION", "no such operation"));
                };
                let pref = self.principal_ref(&op0.tenant, &op0.subject);
                let Some(contract) = contracts.get(&op0.tool) else {
                    return Err(EngineError::invalid("UNKNOWN_TOOL", "operation names a tool not in the catalog"));
                };
                let lease_ms = contract.retry.attempt_timeout_ms as i64 + 1_000;
                let caller =
                    Caller { principal_ref: &pref, salt: &salt, answer, reserve: !defenses_now.balance_not_reserved };
                let domain = self.domain(&op0.tool);
                let claim = self
                    .store
                    .write(|tx| claim_to_send(tx, op_id, None, contract, &*domain, &worker, now, lease_ms, &caller))?;
                match claim {
                    Claim::Answer(env) => return Ok(env),
                    Claim::Claimed { attempt, op, slot } => (attempt, op, slot),
                }
            };
            let now = self.clock.now_ms();
            let pref = self.principal_ref(&op.tenant, &op.subject);
            let Some(contract) = contracts.get(&op.tool) else {
                return Err(EngineError::invalid("UNKNOWN_TOOL", "operation names a tool not in the catalog"));
            };
            let domain = self.domain(&op.tool);
            failpoint::hit("after_sent");
            let args: Value = args_of(&op.request_json);
            let defenses = self.defenses()?;
            let dreq = DownstreamRequest {
                // The business intent is the whole scope, not the key string alone;
                // and it is the caller's key even when a lab toggle re-scoped the ledger.
                intent: intent_of(&op.tenant, &op.subject, &op.tool, caller_key(&op.idem_key)),
                tool: op.tool.clone(),
                arguments: args,
                request_sha256: op.request_sha256.clone(),
                // The deadline propagates: an attempt never waits past it.
                timeout_ms: contract.retry.attempt_timeout_ms.min((op.deadline_at - now).max(1) as u64),
            };
            let key = if defenses.unique_downstream_key_per_attempt {
                // Lab mode only: a new key per attempt defeats the provider's de-duplication.
                format!("{}-a{attempt}", op.downstream_key)
            } else {
                op.downstream_key.clone()
            };
            let reply = {
                let ds = self.downstream(&contract.downstream.name)?;
                std::panic::catch_unwind(AssertUnwindSafe(|| ds.execute(&key, &dreq)))
            };
            let reply = match reply {
                Ok(Ok(r)) => Ok(r),
                Ok(Err(e)) => {
                    tracing::error!(op = op_id, attempt, error = %e, "downstream storage failed");
                    // The real cause, for the trace and the detail (never
                    // "no reply"): the adapter's own storage failed mid-call.
                    Err(format!("{e}: the downstream may or may not have committed"))
                }
                Err(_) => {
                    tracing::error!(op = op_id, attempt, "downstream handler panicked");
                    Err("handler panicked".to_string())
                }
            };
            failpoint::hit("before_persist");
            attempts_this_call += 1;
            let jitter = backoff_ms(
                &self.ids,
                contract.retry.backoff_base_ms,
                contract.retry.backoff_cap_ms,
                attempts_this_call,
            );
            let now = self.clock.now_ms();
            let pctx = PersistCtx {
                op: &op,
                contract,
                domain: &*domain,
                worker: &worker,
                attempt,
                now,
                backoff_ms: jitter,
                may_retry: attempts_this_call < contract.retry.max_attempts,
                principal_ref: &pref,
                duration_us: t0.elapsed().as_micros() as i64,
                salt: &salt,
                answer,
                naive_timeout_retry: defenses.naive_timeout_retry,
            };
            let step = self.store.write(|tx| persist(tx, &pctx, reply.clone()));
            // The send is over: its slot is free before any backoff wait.
            drop(slot);
            match step? {
                Persisted::Done(env) => return Ok(env),
                Persisted::RetryAfter(ms) => self.clock.sleep_ms(ms),
                Persisted::Late(env) => {
                    // Best effort: the reply's caller gets its answer whatever
                    // the follow-up meets (the receipt is in the trace, and an
                    // explicit query can always do the same later).
                    if let Err(e) = self.act_on_late_receipt(op_id) {
                        tracing::warn!(op = op_id, error = %e, "acting on a late receipt failed");
                    }
                    return Ok(env);
                }
            }
        }
    }

    /// Runs every due outbox row (the worker loop's body). Returns how many ran.
    pub fn work(&mut self, limit: usize) -> Result<usize, EngineError> {
        self.work_due(limit, 0)
    }

    /// [`Engine::work`] for a background worker beside dispatchers (`serve`,
    /// the console, the load generator): it leaves a row alone until it has
    /// been due for [`BACKGROUND_GRACE_MS`]. The dispatcher that accepted a
    /// call runs it at once in the same call (and an in-call retry claims its
    /// row the moment it falls due); a worker polling in between would take
    /// it from under that caller, who would then be told "in flight" or
    /// "replayed" about its own first call. Rows nobody runs (approved calls,
    /// retries whose caller went away, rows re-queued by the reaper) are
    /// picked up a moment later.
    pub fn work_background(&mut self, limit: usize) -> Result<usize, EngineError> {
        self.work_due(limit, BACKGROUND_GRACE_MS)
    }

    fn work_due(&mut self, limit: usize, grace_ms: i64) -> Result<usize, EngineError> {
        self.clock_tick();
        let contracts = self.contracts.clone();
        let mut ran = 0;
        while ran < limit {
            let now = self.clock.now_ms();
            let ready = self.store.read(|tx| tx.ready_outbox(now, now.saturating_sub(grace_ms), 16))?;
            if ready.is_empty() {
                break;
            }
            for id in ready {
                self.run_operation(&id, &contracts, None)?;
                ran += 1;
            }
        }
        Ok(ran)
    }

    /// One reaper pass (docs/design.md §6).
    pub fn reap(&mut self) -> Result<ReapReport, EngineError> {
        if let Some(why) = self.clock_check()? {
            return Ok(ReapReport { clock_paused: Some(why), ..ReapReport::default() });
        }
        let now = self.clock.now_ms();
        let contracts = self.contracts.clone();
        let salt = self.salt.clone();
        // A lease is never longer than the longest attempt timeout plus a
        // second; one that ends further ahead was written on a clock that ran
        // ahead (before the one clock, or by hand) and is treated as expired,
        // with the clock bound as slack.
        let longest = contracts.all().iter().map(|c| c.retry.attempt_timeout_ms as i64 + 1_000).max().unwrap_or(0);
        let beyond = now + longest + super::ledger_clock::CLOCK_BOUND_MS;
        Ok(self.store.write(|tx| -> Result<ReapReport, StoreError> {
            let mut report = ReapReport::default();
            for ob in tx.expired_leases(now, beyond)? {
                let Some(mut op) = tx.operation(&ob.operation_id)? else { continue };
                let attempts = tx.attempts(&ob.operation_id)?;
                let current = attempts.iter().find(|a| a.attempt == ob.attempt);
                let sent = current.is_some_and(|a| a.sent_at.is_some());
                let honours = contracts.get(&op.tool).is_some_and(|c| c.downstream.honours_keys());
                let mut ev = TraceEvent::of_operation(Step::Reaped, &op, &salt, now);
                ev.attempt = Some(ob.attempt);
                ev.worker.clone_from(&ob.lease_owner);
                if !sent {
                    tx.finish_attempt(&op.id, ob.attempt, AttemptOutcome::NotSent, None, now)?;
                    tx.release_outbox(&op.id, now, None)?;
                    // Back to `accepted` only if no earlier attempt may have been received.
                    let earlier = attempts.iter().any(|a| a.attempt != ob.attempt && !a.proven_not_received());
                    op.state = if earlier { OpState::InFlight } else { OpState::Accepted };
                    ev.note = Some("lease expired before send: back to accepted".into());
                    ev.reason = Some("requeued_unsent");
                    report.requeued_unsent += 1;
                } else if honours && now < op.deadline_at {
                    tx.finish_attempt(&op.id, ob.attempt, AttemptOutcome::Unknown, Some(SENDER_DETACHED), now)?;
                    tx.release_outbox(&op.id, now, Some("OUTCOME_UNKNOWN"))?;
                    op.state = crate::store::OpState::InFlight;
                    ev.note = Some("lease expired after send: re-queued with the same downstream key".into());
                    ev.reason = Some("requeued_same_key");
                    report.requeued_same_key += 1;
                } else {
                    // Past the deadline nothing is sent again (docs/design.md §11), and a
                    // re-queued row would never be picked up: the explicit status
                    // query (or a human) settles it.
                    tx.finish_attempt(&op.id, ob.attempt, AttemptOutcome::Unknown, Some(SENDER_DETACHED), now)?;
                    tx.close_outbox(&op.id, OutboxState::Parked, Some("OUTCOME_UNKNOWN"))?;
                    op.state = contracts.get(&op.tool).map_or(OpState::Unknown, |c| c.downstream.unknown_state());
                    op.code = Some(Code::OutcomeUnknown.as_str().into());
                    ev.code = Some(Code::OutcomeUnknown);
                    ev.outcome = Some("unknown");
                    ev.timeout_stage = Some("response");
                    ev.note = Some(if honours {
                        "lease expired after send, deadline passed: unknown".into()
                    } else {
                        "lease expired after send, downstream does not de-duplicate: unknown".into()
                    });
                    ev.reason = Some("parked_unknown");
                    report.parked_unknown += 1;
                }
                op.updated_at = now;
                tx.update_operation(&op)?.or_stale()?;
                ev.write(tx, now)?;
            }
            // Re-queued possibly-sent attempts whose deadline passed before a
            // worker re-sent them: no worker picks them up any more, so they
            // would be stuck in flight for ever. Park them for a status query.
            for id in tx.overdue_in_flight(now)? {
                let Some(mut op) = tx.operation(&id)? else { continue };
                tx.close_outbox(&id, OutboxState::Parked, Some("OUTCOME_UNKNOWN"))?;
                op.state = contracts.get(&op.tool).map_or(OpState::Unknown, |c| c.downstream.unknown_state());
                op.code = Some(Code::OutcomeUnknown.as_str().into());
                op.updated_at = now;
                tx.update_operation(&op)?.or_stale()?;
                let mut ev = TraceEvent::of_operation(Step::Reaped, &op, &salt, now);
                ev.code = Some(Code::OutcomeUnknown);
                ev.outcome = Some("unknown");
                ev.timeout_stage = Some("deadline");
                ev.note = Some("deadline passed before a possibly-sent attempt was re-sent: unknown".into());
                ev.reason = Some("parked_unknown");
                ev.write(tx, now)?;
                report.parked_unknown += 1;
            }
            tx.prune_metric_minutes(super::trace::minutes_retained_from(now))?;
            Ok(report)
        })?)
    }
}

#[derive(Clone, Copy)]
struct AcceptCtx<'a> {
    req: &'a DispatchRequest,
    contract: &'a Contract,
    domain: &'a dyn ToolDomain,
    args: &'a Value,
    call: &'a CallIdentity,
    /// The engine minted `call` for this call (the caller gave none).
    minted_call: bool,
    key: &'a str,
    key_sha256: &'a str,
    request_json: &'a str,
    request_sha256: &'a str,
    now: i64,
    deadline_ms: u64,
    principal_ref: &'a str,
    refs: &'a super::canonical::StatusRefKey,
    ids: &'a super::ids::Ids,
    /// The ledger's salt (the downstream key is derived under it).
    salt: &'a str,
    defenses: DefensesOff,
}

/// Steps 2–5 of the pipeline in one `BEGIN IMMEDIATE` transaction.
///
/// `relaxed`: the transaction does not wait for the disk, so it may only record
/// an answer; any path that would change state returns [`Decision::Synced`]
/// before writing anything.
fn accept(
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
        ev.reason = Some("current_authorization");
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
            ev.reason = Some("call_id_conflict");
            return Ok(answer(Code::CallIdConflict, audit, ev));
        }
    }
    ev.checks.push("call_identity");
    let existing = tx.operation_by_scope(&r.tenant, &r.subject, &r.tool, c.key)?;
    ev.step = Step::Idempotency;
    if let Some(op) = existing {
        ev.operation_id = Some(op.id.clone());
        // A damaged row answers STATUS_CONFLICT (the ledger is at fault), never
        // IDEMPOTENCY_CONFLICT (which blames the caller), never a new execution.
        if let Err(why) = verify_row(&op, c.salt) {
            ev.step = Step::TamperDetected;
            ev.note = Some(why.into());
            ev.reason = Some("tampered");
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
                ev.reason = Some(MASKED_CONFLICT);
                let delivery =
                    if op.state == OpState::Resolved { Delivery::HumanResolved } else { Delivery::LocalReplay };
                return Ok(Decision::Answer(op_envelope(&op, delivery, c.principal_ref.to_string(), None), ev));
            }
            ev.note = Some("same key, different request".into());
            ev.reason = Some("conflict");
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
                ev.reason = Some("replay");
                return Ok(Decision::Answer(
                    op_envelope(&op, Delivery::LocalReplay, c.principal_ref.to_string(), None),
                    ev,
                ));
            }
            OpState::Resolved => {
                ev.note = Some("replay of a human resolution".into());
                ev.reason = Some("replay_resolved");
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
                ev.reason = Some("proven_unsent_execute");
                ev.deadline_left_ms = Some(c.deadline_ms as i64);
                ev.write(tx, c.now)?;
                return Ok(Decision::Execute { op_id: op.id, built: None });
            }
            ev.note = Some("proven not sent, retry time not reached".into());
            ev.reason = Some("proven_unsent_not_due");
            let env = op_envelope(&op, Delivery::Fresh, c.principal_ref.to_string(), last_code.as_deref());
            return Ok(Decision::Answer(with_retry_after(env, (due_at - c.now) as u64), ev));
        }
        // Running right now in this process, under a live lease: say so,
        // with when to look again and the status reference, instead of
        // OUTCOME_UNKNOWN, which sends a model to human review for a call
        // that is merely running.
        let live = outbox.as_ref().and_then(|o| o.lease_until).filter(|&until| {
            until > c.now && matches!(op.state, OpState::Accepted | OpState::InFlight) && Running::holds(&op.id)
        });
        if let Some(until) = live {
            ev.note = Some("running under a live lease: in progress, never re-executed".into());
            ev.reason = Some("in_progress");
            let mut env = op_envelope(&op, Delivery::LocalReplay, c.principal_ref.to_string(), None);
            let info = in_progress_info(&op, (until - c.now).clamp(100, 1_000) as u64);
            env.model_result.status = Status::Unknown;
            env.model_result.error = Some(info);
            return Ok(Decision::Answer(env, ev));
        }
        ev.note = Some("not terminal and possibly sent: unknown, never re-executed".into());
        ev.reason = Some("in_progress");
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
    for other in tx.operations_sharing_key(&r.tenant, &r.subject, &r.tool, c.key)? {
        let bound = serde_json::from_str::<Value>(&other.request_json).ok();
        let says = |f: &str| bound.as_ref().and_then(|v| v.get(f)).and_then(Value::as_str).map(str::to_string);
        let ours = says("tenant").as_deref() == Some(r.tenant.as_str())
            && says("subject").as_deref() == Some(r.subject.as_str())
            && says("tool").as_deref() == Some(r.tool.as_str());
        if ours && verify_row(&other, c.salt).is_err() {
            ev.step = Step::TamperDetected;
            ev.operation_id = Some(other.id.clone());
            ev.note = Some("a row of this scope was moved out of it by hand".into());
            ev.reason = Some("tampered");
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
    let scope = super::retention::scope_sha256(&r.tenant, &r.subject, &r.tool, c.key);
    if let Some(t) = tx.tombstone_by_scope(&scope)? {
        ev.operation_id = Some(t.operation_id.clone());
        ev.note = Some(format!("key used by {}, purged when its retention ended: not run again", t.operation_id));
        ev.reason = Some("key_expired");
        let env = with_detail(
            error_envelope(Code::IdempotencyKeyExpired, audit),
            super::retention::expired_key_detail(&t, c.request_sha256),
        );
        return Ok(Decision::Answer(env, ev));
    }
    ev.checks.push("idempotency");
    // A new execution whose deadline was spent before it was accepted (it
    // waited in a server's queue): refused before accept, nothing sent.
    if c.deadline_ms == 0 {
        ev.step = Step::Deadline;
        ev.reason = Some("deadline_before_accept");
        ev.note = Some("the caller's deadline passed before the call was accepted: nothing was stored or sent".into());
        return Ok(Decision::Answer(error_envelope(Code::TimeoutBeforeExecute, audit), ev));
    }
    // A new execution while the downstream's circuit is open: refused before
    // accept, nothing stored but this call's trace event.
    if let Some(wait) = policy::admit_new(tx, &c.contract.downstream.name, c.now)? {
        ev.step = Step::Circuit;
        ev.reason = Some("circuit_open");
        ev.note = Some(format!("circuit of {} is open: refused before accept", c.contract.downstream.as_str()));
        return Ok(Decision::Answer(with_retry_after(error_envelope(Code::ToolUnavailable, audit), wait), ev));
    }
    // 4. Business rules, then approval for a new execution.
    if let Some(rule) = business_rules(tx, c.domain, [&r.tenant, &r.subject, &r.tool], c.args, None)? {
        ev.step = Step::BusinessRules;
        ev.note = Some(rule.into());
        ev.reason = Some(rule);
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

fn bind_call(tx: &Tx<'_>, ck: &CallKey<'_>, c: &AcceptCtx<'_>, op: Option<&str>) -> Result<(), StoreError> {
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
fn in_progress_info(op: &OperationRow, retry_after_ms: u64) -> super::envelope::ErrorInfo {
    let mut e = super::envelope::ErrorInfo::new(Code::InProgress);
    e.retry_after_ms = Some(retry_after_ms);
    e.detail = Some(json!({"status_ref": op.status_ref, "expected_request_sha256": op.request_sha256}));
    e
}

/// A fresh ledger row for an accepted dispatch.
fn new_operation(c: &AcceptCtx<'_>, approval_id: Option<&str>) -> OperationRow {
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
fn approval_gate(
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
    let base = super::operation::approval_base_sha256(
        &r.tenant,
        &r.subject,
        &r.tool,
        c.request_sha256,
        c.key_sha256,
        c.call,
        c.contract.revisions,
        tenant.policy_revision,
    );
    let latest = tx.latest_approval(&r.tenant, &r.subject, &r.tool, c.key)?;
    if let Some(given) = &r.approval_id {
        if latest.as_ref().map(|a| &a.id) != Some(given) {
            ev.note = Some("approval id does not belong to this call".into());
            ev.reason = Some("approval_mismatch");
            return Ok(Some(Decision::Answer(error_envelope(Code::ApprovalInvalid, audit.clone()), ev.clone())));
        }
    }
    // A new request, unless one below answers; `approval_expired` when it
    // replaces a request that lapsed unapproved.
    ev.reason = Some("approval_required");
    if let Some(a) = latest {
        ev.approval_id = Some(a.id.clone());
        if a.request_sha256 != c.request_sha256 {
            ev.note = Some("key already holds an approval request for a different request".into());
            ev.reason = Some("conflict");
            return Ok(Some(Decision::Answer(error_envelope(Code::IdempotencyConflict, audit.clone()), ev.clone())));
        }
        let detail = |a: &ApprovalRow| json!({"approval_id": a.id, "expires_at": super::clock::rfc3339(a.expires_at)});
        match a.state {
            ApprovalState::Pending if c.now < a.expires_at => {
                let env = with_detail(error_envelope(Code::ApprovalRequired, audit.clone()), detail(&a));
                let mut env = env;
                env.protected_audit.approval_id = Some(a.id.clone());
                ev.note = Some("approval still pending".into());
                ev.reason = Some("approval_pending");
                return Ok(Some(Decision::Answer(env, ev.clone())));
            }
            ApprovalState::Denied => {
                let mut env = with_detail(
                    error_envelope(Code::ApprovalInvalid, audit.clone()),
                    json!({"approval_id": a.id, "reason": "denied"}),
                );
                env.protected_audit.approval_id = Some(a.id.clone());
                ev.note = Some("approval was denied".into());
                ev.reason = Some("approval_denied");
                return Ok(Some(Decision::Answer(env, ev.clone())));
            }
            ApprovalState::Pending => {
                // Expired unapproved: mark it, then a new request below.
                let mut expired = a.clone();
                expired.state = crate::store::ApprovalState::Expired;
                expired.decided_at = Some(c.now);
                expired.decided_by = Some("system".into());
                tx.decide_approval(&expired)?.or_stale()?;
                ev.reason = Some("approval_expired");
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
    ev.note = Some(if ev.reason == Some("approval_expired") {
        "previous request expired unapproved: new approval requested".into()
    } else {
        "approval requested".into()
    });
    let mut env = with_detail(
        error_envelope(Code::ApprovalRequired, audit.clone()),
        json!({"approval_id": approval.id, "expires_at": super::clock::rfc3339(approval.expires_at)}),
    );
    env.protected_audit.approval_id = Some(approval.id);
    Ok(Some(Decision::Answer(env, ev.clone())))
}

/// How long a background worker leaves a due outbox row to the caller that
/// is about to run it ([`Engine::work_background`]).
pub const BACKGROUND_GRACE_MS: i64 = 1_000;

/// Who waits for a run of the outbox row: for the envelope and the trace.
struct Caller<'a> {
    principal_ref: &'a str,
    salt: &'a str,
    answer: Option<Answering>,
    /// Holds are written (every defense on): an operation accepted without
    /// one (its rules refused at approval, or the lab's toggle was on) takes
    /// it when its re-check passes.
    reserve: bool,
}

/// [`claim`], then, in the same transaction, the sent-marker: the commit
/// that returns from here is the last one before the send. A crash before it
/// leaves the row unclaimed (provably unsent); after it, the attempt is
/// possibly received, exactly as a separate sent-marker commit would leave it.
#[allow(clippy::too_many_arguments)]
fn claim_to_send(
    tx: &Tx<'_>,
    op_id: &str,
    built: Option<OperationRow>,
    contract: &Contract,
    domain: &dyn ToolDomain,
    worker: &str,
    now: i64,
    lease_ms: i64,
    caller: &Caller<'_>,
) -> Result<Claim, EngineError> {
    let claimed = claim(tx, op_id, built, contract, domain, worker, now, lease_ms, caller)?;
    let Claim::Claimed { attempt, op, slot } = claimed else {
        return Ok(claimed);
    };
    failpoint::hit("after_claim");
    if !tx.mark_sent(op_id, worker, attempt, now)? {
        // The lease was taken in this very transaction: unreachable unless the
        // store is broken; nothing of this transaction commits.
        return Err(EngineError::invalid("SENT_MARKER_LOST", "the lease claimed in this transaction is not held"));
    }
    let mut ev = TraceEvent::of_operation(Step::Sent, &op, caller.salt, now);
    ev.attempt = Some(attempt);
    ev.worker = Some(worker.to_string());
    ev.write(tx, now)?;
    Ok(Claim::Claimed { attempt, op, slot })
}

/// Claims the outbox row and re-checks authorization, business state and
/// contract revision before anything is sent. `built`: the row the same
/// transaction has just inserted after those very checks
/// ([`Decision::Execute`]); nothing can have changed since (the transaction
/// holds the write lock), so it is neither read back nor checked again.
#[allow(clippy::too_many_arguments)]
fn claim(
    tx: &Tx<'_>,
    op_id: &str,
    built: Option<OperationRow>,
    contract: &Contract,
    domain: &dyn ToolDomain,
    worker: &str,
    now: i64,
    lease_ms: i64,
    caller: &Caller<'_>,
) -> Result<Claim, EngineError> {
    let pref = caller.principal_ref;
    let built_here = built.is_some();
    let Some(mut op) = (match built {
        Some(op) => Some(op),
        None => tx.operation(op_id)?,
    }) else {
        return Err(EngineError::invalid("NO_SUCH_OPERATION", "no such operation"));
    };
    let mut ev = TraceEvent::of_operation(Step::Claimed, &op, caller.salt, now);
    ev.worker = Some(worker.to_string());
    // Nothing to claim: the answer is the operation's state, and the trace says why.
    let skipped = |ev: &TraceEvent, env: Envelope, reason: &'static str| -> Result<Claim, EngineError> {
        let mut ev = ev.clone().because(reason).from_envelope(&env).answering(caller.answer);
        ev.step = Step::ClaimSkipped;
        ev.write(tx, now)?;
        Ok(Claim::Answer(env))
    };
    // A built row's outbox row is the one accept inserted beside it in this
    // transaction (pending, due now, no attempt yet): it is not read back.
    let ob = if built_here {
        None
    } else {
        Some(match tx.outbox_for_claim(op_id)? {
            ForClaim::Row(ob) => ob,
            ForClaim::Missing => {
                return skipped(&ev, op_envelope(&op, Delivery::Fresh, pref.to_string(), None), "no_outbox_row");
            }
            // Another worker is claiming it this instant: it runs there. Its
            // claim is not committed yet, so the row still reads `accepted`; the
            // caller is answered as for any call in flight elsewhere (never
            // "nothing was sent": it may be being sent right now).
            ForClaim::Busy => {
                let seen = OperationRow { state: OpState::InFlight, ..op.clone() };
                let env = op_envelope(&seen, Delivery::LocalReplay, pref.to_string(), None);
                return skipped(&ev, env, "claimed_elsewhere");
            }
        })
    };
    let last_code = ob.as_ref().and_then(|o| o.last_code.as_deref());
    if let Some(ob) = &ob {
        // Someone else runs it (or ran it): report its state, not a fresh execution.
        if ob.state != OutboxState::Pending {
            let env = op_envelope(&op, Delivery::LocalReplay, pref.to_string(), last_code);
            return skipped(&ev, env, "not_pending");
        }
        if ob.available_at > now {
            let env = op_envelope(&op, Delivery::Fresh, pref.to_string(), last_code);
            return skipped(&ev, with_retry_after(env, (ob.available_at - now) as u64), "not_due");
        }
    }
    if now >= op.deadline_at {
        // Nothing was sent and the deadline has passed: provably no effect.
        let env = with_retry_after(
            op_envelope(&op, Delivery::Fresh, pref.to_string(), Some(Code::TimeoutBeforeExecute.as_str())),
            0,
        );
        ev.step = Step::Deadline;
        ev.timeout_stage = Some("before_send");
        let ev = ev.because("deadline_passed").from_envelope(&env).answering(caller.answer);
        ev.write(tx, now)?;
        return Ok(Claim::Answer(env));
    }
    // A row this transaction built is not read from storage: nothing to
    // verify (debug builds, the tests, verify it all the same).
    let verified = if built_here {
        debug_assert_eq!(super::operation::verify_row_afresh(&op, caller.salt), Ok(()));
        Ok(())
    } else {
        verify_row(&op, caller.salt)
    };
    if let Err(why) = verified {
        let env = with_detail(
            error_envelope(
                Code::StatusConflict,
                ProtectedAudit { operation_id: Some(op.id.clone()), ..ProtectedAudit::default() },
            ),
            json!({"reason": "stored record failed its integrity check"}),
        );
        ev.step = Step::TamperDetected;
        ev.note = Some(why.into());
        ev.because("tampered").from_envelope(&env).answering(caller.answer).write(tx, now)?;
        return Ok(Claim::Answer(env));
    }
    // The downstream's circuit breaker: nothing is sent while it is open.
    let admission = policy::admit_send(tx, &contract.downstream.name, op_id, now, lease_ms)?;
    if let Admission::Refused { retry_after_ms } = admission {
        let code = Code::ToolUnavailable.as_str();
        tx.release_outbox(op_id, now + retry_after_ms as i64, Some(code))?;
        let env = with_retry_after(op_envelope(&op, Delivery::Fresh, pref.to_string(), Some(code)), retry_after_ms);
        ev.step = Step::Circuit;
        ev.note = Some(format!("circuit of {} is open: not sent", contract.downstream.as_str()));
        ev.because("circuit_open").from_envelope(&env).answering(caller.answer).write(tx, now)?;
        return Ok(Claim::Answer(env));
    }
    // The tool's retry budget: a retry after a refused attempt spends a token.
    let retrying = ob.as_ref().is_some_and(|ob| ob.attempt > 0)
        && tx.attempts(op_id)?.last().is_some_and(|a| a.outcome == Some(AttemptOutcome::Refused));
    if retrying && !policy::budget_withdraw(tx, &op.tool, &contract.retry, now)? {
        if admission == Admission::Probe {
            policy::release_probe(tx, &contract.downstream.name, op_id, now)?;
        }
        // No jitter source here; the longest backoff is the honest hint.
        let wait = contract.retry.backoff_cap_ms.max(1);
        tx.release_outbox(op_id, now + wait as i64, None)?;
        let env = with_retry_after(op_envelope(&op, Delivery::Fresh, pref.to_string(), last_code), wait);
        ev.step = Step::RetryBudget;
        ev.note = Some("retry budget of the tool exhausted: not sent".into());
        ev.because("budget_exhausted").from_envelope(&env).answering(caller.answer).write(tx, now)?;
        return Ok(Claim::Answer(env));
    }
    // The downstream's bulkhead: a slow downstream takes at most its limit
    // of this process's engine threads; beyond it nothing is sent and the
    // operation waits in the outbox under its key.
    let limit = super::bulkhead::limit_of(contract.downstream.max_in_flight);
    let Some(slot) = super::bulkhead::try_acquire(&contract.downstream.name, limit) else {
        if admission == Admission::Probe {
            policy::release_probe(tx, &contract.downstream.name, op_id, now)?;
        }
        let wait = super::bulkhead::FULL_RETRY_AFTER_MS;
        let code = Code::ToolUnavailable.as_str();
        tx.release_outbox(op_id, now + wait as i64, Some(code))?;
        let env = with_retry_after(op_envelope(&op, Delivery::Fresh, pref.to_string(), Some(code)), wait);
        ev.step = Step::Bulkhead;
        ev.note = Some(format!(
            "{limit} call(s) to {} in flight from this process already: not sent",
            contract.downstream.as_str()
        ));
        ev.because("bulkhead_full").from_envelope(&env).answering(caller.answer).write(tx, now)?;
        return Ok(Claim::Answer(env));
    };
    let Some(attempt) = tx.claim(op_id, worker, now, now + lease_ms)? else {
        return skipped(&ev, op_envelope(&op, Delivery::LocalReplay, pref.to_string(), None), "lost_race");
    };
    if attempt == 1 {
        // Load earns retries: each first attempt deposits the tool's ratio.
        policy::budget_deposit(tx, &op.tool, &contract.retry, now)?;
    }
    ev.attempt = Some(attempt);
    ev.reason = Some(if attempt > 1 { "retry" } else { "first_attempt" });
    // Re-check: authorization, business state and contract revision, read now
    // (unless this transaction made those checks itself).
    let args: Option<Value> = (!built_here).then(|| args_of(&op.request_json));
    let (tenant, subject, tool) = (&op.tenant, &op.subject, &op.tool);
    let mut failed: Option<(Code, &'static str)> = None;
    if let Some(code) = args.as_ref().map(|a| authorize(tx, domain, tenant, subject, tool, a)).transpose()?.flatten() {
        failed = Some((code, "authorization"));
    } else if revisions_of(&op) != contract.revisions {
        failed = Some((Code::BusinessRuleViolation, "contract_revision_changed"));
    } else if let Some(rule) = args
        .as_ref()
        .map(|a| business_rules(tx, domain, [tenant, subject, tool], a, Some(op_id)))
        .transpose()?
        .flatten()
    {
        failed = Some((Code::BusinessRuleViolation, rule));
    }
    if let Some((code, why)) = failed {
        tx.finish_attempt(op_id, attempt, AttemptOutcome::NotSent, Some(code.as_str()), now)?;
        // Nothing more is sent; but an earlier attempt that may have been
        // received may still land: then the outcome is unknown (a status query
        // or a person settles it, and its hold stays), never "failed".
        let earlier =
            attempt > 1 && tx.attempts(op_id)?.iter().any(|a| a.attempt != attempt && !a.proven_not_received());
        if earlier {
            tx.close_outbox(op_id, OutboxState::Parked, Some(Code::OutcomeUnknown.as_str()))?;
            op.state = contract.downstream.unknown_state();
            op.code = Some(Code::OutcomeUnknown.as_str().into());
        } else {
            tx.close_outbox(op_id, OutboxState::Done, Some(code.as_str()))?;
            op.state = crate::store::OpState::Failed;
            op.code = Some(code.as_str().into());
        }
        op.updated_at = now;
        tx.update_operation(&op)?.or_stale()?;
        op.version += 1;
        let env = op_envelope(&op, Delivery::Fresh, pref.to_string(), None);
        ev.step = Step::RecheckFailed;
        ev.note = Some(why.into());
        ev.deadline_left_ms = None;
        let ev = ev.because(why).from_envelope(&env).answering(caller.answer);
        ev.write(tx, now)?;
        return Ok(Claim::Answer(env));
    }
    if let (true, Some(a)) = (caller.reserve, args.as_ref()) {
        // Accepted without a hold (rules refused at approval, or the lab's
        // toggle was on then): what the rules just granted is held now.
        if tx.hold_of(op_id)?.is_none() {
            reserve(tx, domain, &op, a, now)?;
        }
    }
    // The row this transaction inserted is what the ledger holds: no need to read it again.
    let stored = built_here.then(|| op.clone());
    op.state = crate::store::OpState::InFlight;
    op.updated_at = now;
    match &stored {
        Some(stored) => tx.update_operation_from(stored, &op)?,
        None => tx.update_operation(&op)?,
    }
    .or_stale()?;
    op.version += 1;
    ev.write(tx, now)?;
    Ok(Claim::Claimed { attempt, op: Box::new(op), slot })
}

struct PersistCtx<'a> {
    op: &'a OperationRow,
    contract: &'a Contract,
    domain: &'a dyn ToolDomain,
    worker: &'a str,
    attempt: i64,
    now: i64,
    backoff_ms: u64,
    may_retry: bool,
    principal_ref: &'a str,
    duration_us: i64,
    salt: &'a str,
    answer: Option<Answering>,
    /// Lab only: retry a response timeout as if nothing had been sent.
    naive_timeout_retry: bool,
}

/// Persists a reply, fenced on (owner, attempt): a zombie cannot write.
fn persist(tx: &Tx<'_>, c: &PersistCtx<'_>, reply: Result<Reply, String>) -> Result<Persisted, EngineError> {
    let op_id = c.op.id.as_str();
    // Only ids and digests of the reply are traced: never its body or headers.
    let mut ev = TraceEvent::of_operation(Step::DownstreamReply, c.op, c.salt, c.now);
    ev.attempt = Some(c.attempt);
    ev.worker = Some(c.worker.to_string());
    ev.duration_us = Some(c.duration_us);
    if !tx.holds_lease(op_id, c.worker, c.attempt)? {
        // Late reply: evidence in the trace, never a state change.
        ev.step = Step::LateReply;
        let receipt = matches!(&reply, Ok(Reply::Committed(_)));
        ev.note = Some(match &reply {
            Ok(Reply::Committed(r)) => {
                ev.receipt_id = Some(r.receipt_id.clone());
                ev.downstream_request_id = Some(r.request_id.clone());
                "reply after the lease was lost: evidence; the provider is asked for the receipt".to_string()
            }
            _ => "reply after the lease was lost".to_string(),
        });
        let op = tx.operation(op_id)?;
        let env = op.map_or_else(
            || error_envelope(Code::OutcomeUnknown, ProtectedAudit::default()),
            |o| op_envelope(&o, Delivery::Fresh, c.principal_ref.to_string(), None),
        );
        // The event records the reply as evidence; its code/outcome are what the caller got.
        ev.because("lease_lost").from_envelope(&env).answering(c.answer).write(tx, c.now)?;
        return Ok(if receipt { Persisted::Late(env) } else { Persisted::Done(env) });
    }
    let Some(mut op) = tx.operation(op_id)? else {
        return Err(EngineError::invalid("NO_SUCH_OPERATION", "no such operation"));
    };
    // As read: the committed reply writes over it without reading it again.
    let stored = op.clone();
    op.updated_at = c.now;
    // The reply's health moves the downstream's circuit, in this transaction.
    if let Some(t) =
        policy::record(tx, &c.contract.downstream.name, &c.contract.circuit, policy::health(&reply), c.now)?
    {
        let mut cev = TraceEvent::of_operation(Step::Circuit, c.op, c.salt, c.now);
        cev.attempt = Some(c.attempt);
        cev.note = Some(format!("circuit of {}: {} → {}", c.contract.downstream.as_str(), t.from, t.to));
        cev.because(match t.to {
            CircuitState::Open => "circuit_opened",
            CircuitState::HalfOpen => "circuit_half_open",
            CircuitState::Closed | CircuitState::Unrecognized => "circuit_closed",
        })
        .write(tx, c.now)?;
    }
    let unknown = |op: &mut OperationRow,
                   code: Code,
                   ev: &mut TraceEvent,
                   stage: Option<&'static str>,
                   note: String|
     -> Result<Persisted, EngineError> {
        tx.finish_attempt(op_id, c.attempt, AttemptOutcome::Unknown, Some(code.as_str()), c.now)?;
        tx.close_outbox(op_id, OutboxState::Parked, Some(code.as_str()))?;
        op.state =
            if code == Code::StatusConflict { OpState::NeedsReview } else { c.contract.downstream.unknown_state() };
        op.code = Some(code.as_str().into());
        tx.update_operation(op)?.or_stale()?;
        op.version += 1;
        let env = op_envelope(op, Delivery::Fresh, c.principal_ref.to_string(), None);
        ev.timeout_stage = stage;
        ev.note = Some(note);
        ev.deadline_left_ms = None;
        let reason = if code == Code::StatusConflict { "needs_review" } else { "parked_unknown" };
        ev.clone().because(reason).from_envelope(&env).answering(c.answer).write(tx, c.now)?;
        Ok(Persisted::Done(env))
    };
    match reply {
        Ok(Reply::Committed(r)) => {
            ev.receipt_id = Some(r.receipt_id.clone());
            ev.downstream_request_id = Some(r.request_id.clone());
            ev.downstream_committed = Some(true);
            if r.body_sha256.as_ref().is_some_and(|b| *b != op.request_sha256) {
                return unknown(&mut op, Code::StatusConflict, &mut ev, None, "receipt is for another request".into());
            }
            if c.contract.check_output(&r.result).is_err() {
                return unknown(
                    &mut op,
                    Code::OutputContractViolation,
                    &mut ev,
                    None,
                    "reply broke the output contract".into(),
                );
            }
            let result_json = canonical_string(&r.result);
            op.result_sha256 = Some(sha256_hex(result_json.as_bytes()));
            op.result_json = Some(result_json);
            op.downstream_request_id = Some(r.request_id.clone());
            op.receipt_id = Some(r.receipt_id.clone());
            op.state = crate::store::OpState::Succeeded;
            op.code = None;
            op.call_binding_sha256 = binding_of(&op);
            tx.insert_receipt(&ReceiptRow {
                receipt_id: r.receipt_id.clone(),
                operation_id: op.id.clone(),
                request_id: r.request_id.clone(),
                // A provider that records no digest: the key links it to what we sent.
                body_sha256: r.body_sha256.clone().unwrap_or_else(|| op.request_sha256.clone()),
                result_sha256: op.result_sha256.clone().unwrap_or_default(),
                source: "reply".into(),
                recorded_at: c.now,
            })?;
            let anomaly = apply_business_effect(tx, c.domain, &op)?;
            tx.finish_attempt(op_id, c.attempt, AttemptOutcome::Committed, None, c.now)?;
            tx.close_outbox(op_id, OutboxState::Done, None)?;
            tx.update_operation_from(&stored, &op)?.or_stale()?;
            op.version += 1;
            // The replays that follow read this row back: built here, it is verified.
            super::operation::remember_built(&op, c.salt);
            let env = op_envelope(&op, Delivery::Fresh, c.principal_ref.to_string(), None);
            ev.reason = Some("committed");
            ev.write(tx, c.now)?;
            let mut p = TraceEvent::of_operation(Step::Persisted, &op, c.salt, c.now);
            p.attempt = Some(c.attempt);
            p.worker = Some(c.worker.to_string());
            p.note = anomaly;
            p.because("committed").from_envelope(&env).answering(c.answer).write(tx, c.now)?;
            Ok(Persisted::Done(env))
        }
        Ok(Reply::Rejected { reason: _, refusal }) if earlier_possibly_received(tx, op_id, c.attempt)? => {
            ev.refusal = refusal.as_ref().map(Into::into);
            // A refusal of this re-send says nothing about the earlier attempt
            // that may have committed (a provider that drifted answers a re-sent
            // key with a conflict): not a definitive failure. Ask the provider.
            tx.finish_attempt(op_id, c.attempt, AttemptOutcome::Rejected, Some(Code::OutcomeUnknown.as_str()), c.now)?;
            tx.close_outbox(op_id, OutboxState::Parked, Some(Code::OutcomeUnknown.as_str()))?;
            op.state = c.contract.downstream.unknown_state();
            op.code = Some(Code::OutcomeUnknown.as_str().into());
            tx.update_operation(&op)?.or_stale()?;
            op.version += 1;
            let env = op_envelope(&op, Delivery::Fresh, c.principal_ref.to_string(), None);
            ev.note = Some("re-send refused after a possibly-sent attempt: unknown".into());
            ev.because("rejected_after_possible_send").from_envelope(&env).answering(c.answer).write(tx, c.now)?;
            Ok(Persisted::Done(env))
        }
        Ok(Reply::Rejected { reason: _, refusal }) => {
            ev.refusal = refusal.as_ref().map(Into::into);
            tx.finish_attempt(
                op_id,
                c.attempt,
                AttemptOutcome::Rejected,
                Some(Code::BusinessRuleViolation.as_str()),
                c.now,
            )?;
            tx.close_outbox(op_id, OutboxState::Done, Some(Code::BusinessRuleViolation.as_str()))?;
            op.state = crate::store::OpState::Failed;
            op.code = Some(Code::BusinessRuleViolation.as_str().into());
            tx.update_operation(&op)?.or_stale()?;
            op.version += 1;
            let env = with_detail(
                op_envelope(&op, Delivery::Fresh, c.principal_ref.to_string(), None),
                json!({"rule": "downstream_rejected"}),
            );
            // The provider's own reason text is a raw reply: it stays out of the trace and the log.
            ev.note = Some("downstream rejected the request: no effect".into());
            ev.deadline_left_ms = None;
            ev.because("rejected").from_envelope(&env).answering(c.answer).write(tx, c.now)?;
            Ok(Persisted::Done(env))
        }
        Ok(Reply::RateLimited { retry_after_ms }) => {
            refused(tx, c, &mut op, ev, Code::RateLimit, c.backoff_ms.max(retry_after_ms), None)
        }
        Ok(Reply::Unavailable { retry_after_ms }) => {
            refused(tx, c, &mut op, ev, Code::ToolUnavailable, c.backoff_ms.max(retry_after_ms.unwrap_or(0)), None)
        }
        Ok(Reply::ConnectTimeout) => {
            refused(tx, c, &mut op, ev, Code::TimeoutBeforeExecute, c.backoff_ms, Some("connect"))
        }
        Ok(Reply::AuthRefused(refusal)) => {
            // Not processed, so not an effect: the key stays usable. Not
            // retried within this call either (no retry helps before an
            // operator fixes the secret); the breaker counts it.
            ev.refusal = Some((&refusal).into());
            ev.note = Some(format!(
                "downstream refused the gateway's credentials (HTTP {}): fix the downstream's secret headers, then retry with the same key",
                refusal.status
            ));
            let wait = c.contract.circuit.cool_down_ms.max(c.backoff_ms);
            refused(tx, c, &mut op, ev, Code::DownstreamAuthFailed, wait, None)
        }
        Ok(Reply::TimedOut) if c.naive_timeout_retry => {
            // Lab only: the naive policy this defense exists to prevent. The
            // attempt may have committed; it is recorded as refused and re-sent.
            ev.note = Some("lab: response timeout retried as if nothing was sent".into());
            refused(tx, c, &mut op, ev, Code::TimeoutBeforeExecute, c.backoff_ms, Some("response"))
        }
        Ok(Reply::TimedOut) => unknown(
            &mut op,
            Code::OutcomeUnknown,
            &mut ev,
            Some("response"),
            "no reply in time: may have committed".into(),
        ),
        Ok(Reply::ServerError) => unknown(
            &mut op,
            Code::OutcomeUnknown,
            &mut ev,
            Some("response"),
            "server error after the request was sent: may have committed".into(),
        ),
        Ok(Reply::InProgress { retry_after_ms }) => {
            // Received and not finished: never re-sent blindly; a status query settles it.
            let done = unknown(
                &mut op,
                Code::OutcomeUnknown,
                &mut ev,
                Some("response"),
                "the provider is still processing this key: query later".into(),
            )?;
            Ok(match (done, retry_after_ms) {
                (Persisted::Done(env), Some(ms)) => Persisted::Done(with_retry_after(env, ms)),
                (other, _) => other,
            })
        }
        Ok(Reply::KeyConflict) => unknown(
            &mut op,
            Code::StatusConflict,
            &mut ev,
            None,
            "the provider holds this key for another request".into(),
        ),
        Ok(Reply::Malformed) => unknown(
            &mut op,
            Code::OutputContractViolation,
            &mut ev,
            None,
            "unparseable reply: may have committed".into(),
        ),
        Err(why) => unknown(&mut op, Code::OutcomeUnknown, &mut ev, Some("handler"), why),
    }
}

/// A refusal that proves nothing was received: retry within the deadline, or
/// answer with `retry_after_ms`.
fn refused(
    tx: &Tx<'_>,
    c: &PersistCtx<'_>,
    op: &mut OperationRow,
    mut ev: TraceEvent,
    code: Code,
    delay: u64,
    stage: Option<&'static str>,
) -> Result<Persisted, EngineError> {
    let op_id = c.op.id.as_str();
    tx.finish_attempt(op_id, c.attempt, AttemptOutcome::Refused, Some(code.as_str()), c.now)?;
    tx.release_outbox(op_id, c.now + delay as i64, Some(code.as_str()))?;
    // `accepted` promises that nothing was sent. After a re-queued possibly-sent
    // attempt that is no longer true: the operation stays `in_flight` (callers see
    // OUTCOME_UNKNOWN, and the reaper parks it if the deadline passes).
    let earlier = earlier_possibly_received(tx, op_id, c.attempt)?;
    op.state = if earlier { OpState::InFlight } else { OpState::Accepted };
    op.code = Some(code.as_str().into());
    tx.update_operation(op)?.or_stale()?;
    op.version += 1;
    ev.timeout_stage = stage;
    ev.code = Some(code);
    ev.outcome = Some("not_started");
    ev.retry_after_ms = Some(delay);
    ev.downstream_committed = Some(false);
    let within_deadline = c.now + (delay as i64) < op.deadline_at;
    // A credentials refusal is not retried by this call: nothing changes until
    // an operator fixes the configuration.
    let automatic = code != Code::DownstreamAuthFailed;
    if c.may_retry && automatic && within_deadline {
        ev.note = Some("provably not received: retry after backoff".into());
        ev.because("retry_scheduled").write(tx, c.now)?;
        return Ok(Persisted::RetryAfter(delay));
    }
    if automatic {
        ev.note = Some(if within_deadline {
            "attempt cap reached".into()
        } else {
            "next retry would pass the deadline".into()
        });
        ev.reason = Some(if within_deadline { "attempts_exhausted" } else { "deadline_exhausted" });
    } else {
        ev.reason = Some("downstream_auth_failed");
    }
    let env =
        with_retry_after(op_envelope(op, Delivery::Fresh, c.principal_ref.to_string(), Some(code.as_str())), delay);
    ev.from_envelope(&env).answering(c.answer).write(tx, c.now)?;
    Ok(Persisted::Done(env))
}

/// Whether an attempt other than `this` may have been received downstream.
fn earlier_possibly_received(tx: &Tx<'_>, op_id: &str, this: i64) -> Result<bool, StoreError> {
    Ok(tx.attempts(op_id)?.iter().any(|a| a.attempt != this && !a.proven_not_received()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys() {
        for (k, ok) in [
            ("", false),
            ("short", false),
            ("12345678", true),
            ("has space!", false),
            (&"k".repeat(255), true),
            (&"k".repeat(256), false),
        ] {
            assert_eq!(valid_key(k), ok, "{k:?}");
        }
    }

    #[test]
    fn seen_sent_holds_what_it_was_told_until_forgotten_or_overwritten() {
        let mut seen = SeenSent::default();
        let a = SeenSent::hash("acme", "agent_ana", "create_refund", "key-a");
        assert_ne!(a, 0, "0 marks an empty slot");
        assert!(!seen.holds(a));
        seen.remember(a);
        assert!(seen.holds(a));
        // Any part of the scope makes another scope.
        for other in [
            SeenSent::hash("acme2", "agent_ana", "create_refund", "key-a"),
            SeenSent::hash("acme", "agent_bo", "create_refund", "key-a"),
            SeenSent::hash("acme", "agent_ana", "send_email", "key-a"),
            SeenSent::hash("acme", "agent_ana", "create_refund", "key-b"),
            // Not a concatenation: the parts' boundaries count.
            SeenSent::hash("acm", "eagent_ana", "create_refund", "key-a"),
        ] {
            assert!(!seen.holds(other));
        }
        // Another scope in the same slot takes it: a miss, never a false hit.
        let b = a.wrapping_add(SEEN_SENT_SLOTS as u64);
        seen.remember(b);
        assert!(seen.holds(b) && !seen.holds(a));
        seen.forget(a);
        assert!(seen.holds(b), "forgetting a scope that is not held leaves the slot alone");
        seen.forget(b);
        assert!(!seen.holds(b));
    }
}
