//! Read tools: answered from local state through the domain, never queued.

use std::time::Instant;

use serde_json::Value;

use super::DispatchRequest;
use crate::engine::canonical::{canonical_string, request_object, sha256_hex, CallIdentity};
use crate::engine::contracts::Contract;
use crate::engine::envelope::{Code, Delivery, Envelope, Execution, ModelResult, Outcome, ProtectedAudit, Status};
use crate::engine::operation::authorize;
use crate::engine::tool::{DownstreamRequest, Reply, ToolCall};
use crate::engine::trace::{Answering, TraceEvent};
use crate::engine::{error_envelope, with_retry_after, Engine, EngineError};
use crate::store::AnswerKind;
use crate::store::CallIdentityRow;
use crate::store::Reason;
use crate::store::Step;

/// A read call as `dispatch` has checked it: its contract, its parsed
/// arguments, the key it was answered under and its call identity.
pub(super) struct ReadCall<'a> {
    pub(super) contract: &'a Contract,
    pub(super) args: &'a Value,
    pub(super) key: &'a str,
    pub(super) call: &'a CallIdentity,
}

/// How far the read's transaction took it.
enum ReadStep {
    /// Answered (a local read, or a refusal), its event written.
    Answered(Envelope),
    /// Authorized and bound: the downstream answers it, outside the transaction.
    Remote(TraceEvent, ProtectedAudit),
}

impl Engine {
    /// A read tool: authorization, the call-identity binding, the read, and its
    /// trace event. A read changes no state, so the commit only records how the
    /// call was answered (not fsynced), but the call identity is bound on first
    /// use like every other call's: the same identity with other arguments,
    /// another key or another purpose is `CALL_ID_CONFLICT`. A local read runs
    /// in that one transaction; a read its downstream answers (an `http` GET)
    /// runs after it, holding no transaction while the downstream answers, and
    /// its answer's event is written in a second one.
    pub(super) fn read_tool(
        &mut self,
        req: &DispatchRequest,
        r: &ReadCall<'_>,
        mut audit: ProtectedAudit,
        mut ev: TraceEvent,
        t0: Instant,
    ) -> Result<Envelope, EngineError> {
        let ReadCall { contract, args, key, call } = *r;
        let (tenant, subject, tool) = (req.tenant.as_str(), req.subject.as_str(), req.tool.as_str());
        let request = request_object(tenant, subject, tool, args, contract.revisions);
        let request_sha256 = sha256_hex(canonical_string(&request).as_bytes());
        let key_sha256 = sha256_hex(key.as_bytes());
        ev.request_sha256 = Some(request_sha256.clone());
        ev.key_sha256 = Some(key_sha256.clone());
        audit.binding.request_sha256 = Some(request_sha256.clone());
        let clock = self.clock.clone();
        let domain = self.domain(tool);
        let remote = contract.downstream.adapter != crate::engine::tool::LOCAL_ADAPTER;
        let step = self.store.write_relaxed(|tx| -> Result<ReadStep, EngineError> {
            let now = clock.now_ms();
            let mut ev = ev.clone();
            let audit = audit.clone();
            let env = 'answer: {
                if let Some(code) = authorize(tx, &*domain, tenant, subject, tool, args)? {
                    ev.step = Step::Authorization;
                    ev.reason = Some(Reason::CurrentAuthorization);
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
                        ev.reason = Some(Reason::CallIdConflict);
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
                if remote {
                    return Ok(ReadStep::Remote(ev, audit));
                }
                let data = domain
                    .read(&tx.domain(), &ToolCall { tenant, subject, tool, arguments: args, operation_id: None })?;
                ev.step = Step::Read;
                read_answer(contract, data, audit)
            };
            answered(ev, &env, t0).write(tx, now)?;
            Ok(ReadStep::Answered(env))
        })?;
        let (ev, audit) = match step {
            ReadStep::Answered(env) => return Ok(env),
            ReadStep::Remote(ev, audit) => (ev, audit),
        };
        // No key (a read acts on nothing) and no intent (it is no effect).
        let dreq = DownstreamRequest {
            intent: String::new(),
            tool: tool.to_string(),
            arguments: args.clone(),
            request_sha256,
            timeout_ms: contract.retry.attempt_timeout_ms,
        };
        let reply = self.downstream(&contract.downstream.name)?.execute("", &dreq)?;
        let env = match reply {
            Reply::Committed(r) => read_answer(contract, Some(r.result), audit),
            // Refused for now: the caller may ask again (nothing happened either way).
            Reply::RateLimited { retry_after_ms } | Reply::Unavailable { retry_after_ms: Some(retry_after_ms) } => {
                with_retry_after(error_envelope(Code::ToolUnavailable, audit), retry_after_ms.max(1))
            }
            Reply::Unavailable { retry_after_ms: None } | Reply::ConnectTimeout => {
                error_envelope(Code::ToolUnavailable, audit)
            }
            // A read failure is safe to report: the contract says no write happened.
            _ => error_envelope(Code::ToolError, audit),
        };
        let mut ev = ev;
        ev.step = Step::Read;
        let ev = answered(ev, &env, t0);
        self.store.write_relaxed(|tx| ev.write(tx, clock.now_ms()))?;
        Ok(env)
    }
}

/// A read's answer: its data within the output contract, or `TOOL_ERROR`.
fn read_answer(contract: &Contract, data: Option<Value>, mut audit: ProtectedAudit) -> Envelope {
    match data {
        Some(d) if contract.check_output(&d).is_ok() => {
            audit.binding.result_sha256 = Some(crate::engine::canonical::digest_value(&d));
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
}

/// The read's answer event.
fn answered(mut ev: TraceEvent, env: &Envelope, t0: Instant) -> TraceEvent {
    ev.duration_us = Some(t0.elapsed().as_micros() as i64);
    ev.from_envelope(env).answering(Some(Answering { kind: AnswerKind::Dispatch, started: t0 }))
}
