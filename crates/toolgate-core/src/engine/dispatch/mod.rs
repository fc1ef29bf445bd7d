//! The dispatch pipeline (docs/design.md §5), the outbox worker and the reaper (docs/design.md §6).

mod admission;
mod persist;
mod read;
mod reaper;
mod replay_hint;
mod worker;

use std::time::Instant;

use serde_json::{json, Value};

use crate::engine::cancel::{CancelRequest, CancelSignal};
use crate::engine::canonical::{
    canonical_string, parse_strict, request_object, sha256_hex, CallIdentity, MAX_DEPTH, MAX_INPUT_BYTES,
};
use crate::engine::contracts::Effect;
use crate::engine::envelope::{Code, Delivery, Envelope, ProtectedAudit};
use crate::engine::lab::scope_key;
use crate::engine::operation::op_envelope;
use crate::engine::trace::{Answering, TraceEvent};
use crate::engine::{error_envelope, fresh_call_identity, with_detail, Engine, EngineError};
use crate::store::AnswerKind;
use crate::store::Scope;
use crate::store::Step;
use crate::store::{OperationRow, Sync, Tx};

use admission::{accept, AcceptCtx};
use read::ReadCall;
pub(crate) use replay_hint::SeenSent;
#[cfg(test)]
use replay_hint::SEEN_SENT_SLOTS;
pub(crate) use worker::downstream_request;
use worker::{claim_to_send, Caller, Claim, ClaimCtx};

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
    /// (see [`crate::engine::ledger_clock`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub clock_paused: Option<String>,
}

/// A key is 8..=255 printable ASCII characters.
pub(super) fn valid_key(k: &str) -> bool {
    (8..=255).contains(&k.len()) && k.bytes().all(|b| (0x21..=0x7e).contains(&b))
}

/// What the accept transaction decided.
pub(super) enum Decision {
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
    Sending { attempt: i64, op: Box<OperationRow>, slot: crate::engine::bulkhead::Slot },
    /// The claim in the accept's transaction answered (its trace event written).
    Answered(Envelope),
    /// Accepted and, its caller having cancelled it first, cancelled in the
    /// same transaction: nothing was sent.
    CancelledBeforeSend(String),
    /// Found under the write lock of a relaxed transaction: this call changes
    /// state after all. Nothing was written; run `accept` again, synced.
    Synced,
}

impl Engine {
    pub(super) fn reject(
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
        let ev = ev.from_envelope(&env).answering(Some(Answering { kind: AnswerKind::Dispatch, started: t0 }));
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
        crate::engine::check_operator(who)?;
        crate::engine::check_operator_note(note)?;
        self.dispatch_with(req, Some((signal, who, note)), None)
    }

    pub(super) fn dispatch_with(
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
        if let Err((part, why)) = crate::engine::check_call_identity(&call) {
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
            return self.read_tool(req, &ReadCall { contract, args: &args, key: &key, call: &call }, audit, ev, t0);
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
            ledger: &self.path,
        };
        let clock = self.clock.clone();
        let (worker, salt) = (self.worker_id.clone(), self.salt.clone());
        let answering = Some(Answering { kind: AnswerKind::Dispatch, started: t0 });
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
                        crate::engine::cancel::cancel_in(tx, &r, now, &salt, &contracts, None)?;
                        return Ok(Decision::CancelledBeforeSend(op_id));
                    }
                    let built = built.map(|op| *op);
                    let c = ClaimCtx { contract, domain: &*domain, worker: &worker, now, lease_ms, caller: &caller };
                    Ok(match claim_to_send(tx, &op_id, built, &c)? {
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
        let seen = SeenSent::hash(Scope::new(&req.tenant, &req.subject, &req.tool, &key));
        let known = full
            && (self.seen_sent.holds(seen)
                || self
                    .store
                    .read(|tx| tx.operation_state_by_scope(Scope::new(&req.tenant, &req.subject, &req.tool, &key)))?
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
        let a = SeenSent::hash(Scope::new("acme", "agent_ana", "create_refund", "key-a"));
        assert_ne!(a, 0, "0 marks an empty slot");
        assert!(!seen.holds(a));
        seen.remember(a);
        assert!(seen.holds(a));
        // Any part of the scope makes another scope.
        for other in [
            SeenSent::hash(Scope::new("acme2", "agent_ana", "create_refund", "key-a")),
            SeenSent::hash(Scope::new("acme", "agent_bo", "create_refund", "key-a")),
            SeenSent::hash(Scope::new("acme", "agent_ana", "send_email", "key-a")),
            SeenSent::hash(Scope::new("acme", "agent_ana", "create_refund", "key-b")),
            // Not a concatenation: the parts' boundaries count.
            SeenSent::hash(Scope::new("acm", "eagent_ana", "create_refund", "key-a")),
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
