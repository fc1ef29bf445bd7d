//! Persisting a reply (fenced by the lease): the outcome, the receipt, the
//! business effect, or a late reply kept as evidence.

use serde_json::json;

use super::worker::{earlier_possibly_received, refused};
use crate::engine::canonical::{canonical_string, sha256_hex};
use crate::engine::contracts::Contract;
use crate::engine::envelope::{Code, Delivery, Envelope, ProtectedAudit};
use crate::engine::operation::{apply_business_effect, binding_of, op_envelope};
use crate::engine::policy::{self};
use crate::engine::tool::Reply;
use crate::engine::tool::ToolDomain;
use crate::engine::trace::{Answering, TraceEvent};
use crate::engine::{error_envelope, with_detail, with_retry_after, EngineError};
use crate::store::Reason;
use crate::store::Step;
use crate::store::{AttemptOutcome, CircuitState, OpState, OperationRow, OutboxState, ReceiptRow, Tx};

/// What persisting a reply decided.
pub(super) enum Persisted {
    Done(Envelope),
    RetryAfter(u64),
    /// A reply that came after the lease was lost, carrying a receipt: the
    /// caller gets `Envelope` (the operation as it stands), and the reply is
    /// evidence to act on once this transaction has committed.
    Late(Envelope),
}

pub(super) struct PersistCtx<'a> {
    pub(super) op: &'a OperationRow,
    pub(super) contract: &'a Contract,
    pub(super) domain: &'a dyn ToolDomain,
    pub(super) worker: &'a str,
    pub(super) attempt: i64,
    pub(super) now: i64,
    pub(super) backoff_ms: u64,
    pub(super) may_retry: bool,
    pub(super) principal_ref: &'a str,
    pub(super) duration_us: i64,
    pub(super) salt: &'a str,
    pub(super) answer: Option<Answering>,
    /// Lab only: retry a response timeout as if nothing had been sent.
    pub(super) naive_timeout_retry: bool,
}

/// Persists a reply, fenced on (owner, attempt): a zombie cannot write.
pub(super) fn persist(tx: &Tx<'_>, c: &PersistCtx<'_>, reply: Result<Reply, String>) -> Result<Persisted, EngineError> {
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
        ev.because(Reason::LeaseLost).from_envelope(&env).answering(c.answer).write(tx, c.now)?;
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
            CircuitState::Open => Reason::CircuitOpened,
            CircuitState::HalfOpen => Reason::CircuitHalfOpen,
            CircuitState::Closed | CircuitState::Unrecognized => Reason::CircuitClosed,
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
        let reason = if code == Code::StatusConflict { Reason::NeedsReview } else { Reason::ParkedUnknown };
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
            crate::engine::operation::remember_built(&op, c.salt);
            let env = op_envelope(&op, Delivery::Fresh, c.principal_ref.to_string(), None);
            ev.reason = Some(Reason::Committed);
            ev.write(tx, c.now)?;
            let mut p = TraceEvent::of_operation(Step::Persisted, &op, c.salt, c.now);
            p.attempt = Some(c.attempt);
            p.worker = Some(c.worker.to_string());
            p.note = anomaly;
            p.because(Reason::Committed).from_envelope(&env).answering(c.answer).write(tx, c.now)?;
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
            ev.because(Reason::RejectedAfterPossibleSend).from_envelope(&env).answering(c.answer).write(tx, c.now)?;
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
            ev.because(Reason::Rejected).from_envelope(&env).answering(c.answer).write(tx, c.now)?;
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
        Ok(Reply::ToolFailed(refusal)) => {
            ev.refusal = Some((&refusal).into());
            unknown(
                &mut op,
                Code::OutcomeUnknown,
                &mut ev,
                Some("response"),
                "the tool reported an error while it ran: it may have acted".into(),
            )
        }
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
