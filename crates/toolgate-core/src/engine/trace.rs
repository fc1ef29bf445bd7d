//! Trace events: one per pipeline step, with the fields of docs/design.md §12. Arguments appear
//! only as a digest plus their data classification; tenant and subject only as
//! salted hashes; provider replies and result bodies only as digests.
//!
//! Every call into the engine that returns an envelope (a dispatch, a status
//! query, an approval) marks exactly one of its events as the *answer*, with the
//! code, outcome and delivery the caller got and the whole call's latency: the
//! metrics count calls by those events (see [`crate::telemetry::metrics`]).

use std::time::Instant;

use serde::Serialize;
use serde_json::Value;

use super::canonical::{sha256_hex, CallIdentity, ObjectWriter, Revisions};
use super::envelope::{Code, Envelope};
pub use crate::store::{AnswerKind, Step};
use crate::store::{ApprovalRow, OpState, OperationRow, Reason, StoreError, TraceRow, Tx};

/// The fields of one trace event. `None` fields are left out.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TraceEvent {
    /// Pipeline step.
    #[serde(skip)]
    pub step: Step,
    /// Operation id.
    #[serde(skip)]
    pub operation_id: Option<String>,
    /// Tool.
    #[serde(skip)]
    pub tool: Option<String>,
    /// Code.
    #[serde(skip)]
    pub code: Option<Code>,
    /// Outcome.
    #[serde(skip)]
    pub outcome: Option<&'static str>,
    /// Delivery.
    #[serde(skip)]
    pub delivery: Option<&'static str>,
    /// Attempt.
    #[serde(skip)]
    pub attempt: Option<i64>,
    /// Duration of the step itself.
    #[serde(skip)]
    pub duration_us: Option<i64>,
    /// The API call this event answers.
    #[serde(skip)]
    pub answer: Option<AnswerKind>,
    /// The whole call's latency, on the answer event.
    #[serde(skip)]
    pub latency_us: Option<i64>,
    /// Salted hash of the tenant.
    #[serde(skip)]
    pub tenant_ref: Option<String>,
    /// Where a timeout happened: `before_send`, `connect`, `response`, `handler`.
    #[serde(skip)]
    pub timeout_stage: Option<&'static str>,
    /// A low-cardinality classification of the decision (`replay`, `retry`,
    /// `attempts_exhausted`, `reconciled`, ...). Never free text.
    #[serde(skip)]
    pub reason: Option<Reason>,
    /// Call identity: provider / api family / response id / call id / adapter revision.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub call: Option<CallIdentity>,
    /// Contract revisions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub revisions: Option<Revisions>,
    /// Salted hash of the subject.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub subject_ref: Option<String>,
    /// SHA-256 of the idempotency key.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_sha256: Option<String>,
    /// Request digest.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_sha256: Option<String>,
    /// Digest of the raw arguments text (also for arguments that failed to parse).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub arguments_sha256: Option<String>,
    /// Data classification of the arguments.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data_classification: Option<String>,
    /// The pipeline checks this call passed before the step that decided it
    /// (`contract`, `authorization`, `call_identity`, `idempotency`,
    /// `business_rules`, `approval`): the steps folded into the decision event.
    #[serde(rename = "checks_passed", skip_serializing_if = "Vec::is_empty")]
    pub checks: Vec<&'static str>,
    /// Approval id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub approval_id: Option<String>,
    /// Tenant policy revision.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub policy_revision: Option<i64>,
    /// Milliseconds left before the operation deadline.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deadline_left_ms: Option<i64>,
    /// Recovery of the code.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recovery: Option<String>,
    /// Downstream request id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub downstream_request_id: Option<String>,
    /// Downstream receipt id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub receipt_id: Option<String>,
    /// The opaque status reference (useless without current authorization and
    /// the expected request digest).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status_ref: Option<String>,
    /// Result digest.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result_sha256: Option<String>,
    /// Call binding digest.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub call_binding_sha256: Option<String>,
    /// Whether the downstream committed an effect in this step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub downstream_committed: Option<bool>,
    /// Retry-After or backoff chosen.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
    /// Worker (lease owner).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worker: Option<String>,
    /// Free-form, non-sensitive note written by the engine (never a provider's
    /// or a caller's text).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// What a downstream's refusal said: its HTTP status, body digest and a
    /// bounded, redacted excerpt ([`crate::engine::tool::Refusal::of_body`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refusal: Option<RefusalFields>,
}

/// The trace form of a downstream refusal.
#[derive(Debug, Clone, Serialize)]
pub struct RefusalFields {
    /// HTTP status.
    pub status: u16,
    /// SHA-256 of the body.
    pub body_sha256: String,
    /// Redacted excerpt of the body.
    pub excerpt: String,
}

impl From<&crate::engine::tool::Refusal> for RefusalFields {
    fn from(r: &crate::engine::tool::Refusal) -> Self {
        RefusalFields { status: r.status, body_sha256: r.body_sha256.clone(), excerpt: r.excerpt.clone() }
    }
}

/// The call an event answers and when that call started.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Answering {
    /// Which call.
    pub kind: AnswerKind,
    /// When the call started.
    pub started: Instant,
}

impl Answering {
    /// A call of `kind` that started now.
    pub(crate) fn now(kind: AnswerKind) -> Self {
        Self { kind, started: Instant::now() }
    }
}

/// A salted hash of one identifier (`tenant_…`, `subject_…`): stable within one
/// database, unlinkable across databases.
pub(crate) fn salted(salt: &str, kind: &str, value: &str) -> String {
    // Every event of an operation salts the same tenant and subject again: a
    // small per-thread memo (cleared when it fills) answers the repeats.
    const MEMO: usize = 1024;
    thread_local! {
        static SALTED: std::cell::RefCell<std::collections::HashMap<String, String>> =
            std::cell::RefCell::new(std::collections::HashMap::new());
    }
    let input = format!("{salt}\0{kind}\0{value}");
    if let Some(hit) = SALTED.with(|m| m.borrow().get(&input).cloned()) {
        return hit;
    }
    let h = sha256_hex(input.as_bytes());
    let out = format!("{kind}_{}", &h[..16]);
    SALTED.with(|m| {
        let mut m = m.borrow_mut();
        if m.len() >= MEMO {
            m.clear();
        }
        m.insert(input, out.clone());
    });
    out
}

impl TraceEvent {
    /// An event for a step.
    #[must_use]
    pub fn step(step: Step) -> Self {
        Self { step, ..Self::default() }
    }

    /// An event about an operation, with every identity, revision, digest and
    /// downstream field the row holds (tenant and subject salted-hashed).
    #[must_use]
    pub(crate) fn of_operation(step: Step, op: &OperationRow, salt: &str, now: i64) -> Self {
        let open = matches!(op.state, OpState::Accepted | OpState::InFlight);
        Self {
            step,
            operation_id: Some(op.id.clone()),
            tool: Some(op.tool.clone()),
            tenant_ref: Some(salted(salt, "tenant", &op.tenant)),
            subject_ref: Some(salted(salt, "subject", &op.subject)),
            call: Some(super::operation::call_of(op)),
            revisions: Some(Revisions { input: op.input_rev, output: op.output_rev, effect: op.effect_rev }),
            key_sha256: Some(op.key_sha256.clone()),
            request_sha256: Some(op.request_sha256.clone()),
            approval_id: op.approval_id.clone(),
            deadline_left_ms: open.then_some(op.deadline_at - now),
            downstream_request_id: op.downstream_request_id.clone(),
            receipt_id: op.receipt_id.clone(),
            status_ref: Some(op.status_ref.clone()),
            result_sha256: op.result_sha256.clone(),
            call_binding_sha256: Some(op.call_binding_sha256.clone()),
            ..Self::default()
        }
    }

    /// An event about an approval request (and the operation it created, if any).
    #[must_use]
    pub(crate) fn of_approval(step: Step, a: &ApprovalRow, salt: &str) -> Self {
        Self {
            step,
            operation_id: a.operation_id.clone(),
            tool: Some(a.tool.clone()),
            tenant_ref: Some(salted(salt, "tenant", &a.tenant)),
            subject_ref: Some(salted(salt, "subject", &a.subject)),
            call: Some(super::operation::approval_call(a)),
            revisions: Some(Revisions { input: a.input_rev, output: a.output_rev, effect: a.effect_rev }),
            key_sha256: Some(a.key_sha256.clone()),
            request_sha256: Some(a.request_sha256.clone()),
            approval_id: Some(a.id.clone()),
            policy_revision: Some(a.policy_revision),
            ..Self::default()
        }
    }

    /// Marks this event as the answer to a call (when there is one): the call
    /// kind and its latency so far.
    #[must_use]
    pub(crate) fn answering(mut self, a: Option<Answering>) -> Self {
        if let Some(a) = a {
            self.answer = Some(a.kind);
            self.latency_us = Some(a.started.elapsed().as_micros() as i64);
        }
        self
    }

    /// Sets the decision class.
    #[must_use]
    pub(crate) fn because(mut self, reason: Reason) -> Self {
        self.reason = Some(reason);
        self
    }

    /// Fills code, outcome, delivery and recovery from an envelope, and every
    /// audit field the event does not have yet.
    #[must_use]
    pub fn from_envelope(mut self, env: &Envelope) -> Self {
        let v = serde_json::to_value(env.model_result.execution).unwrap_or(Value::Null);
        self.outcome = match v.get("outcome").and_then(Value::as_str) {
            Some("committed") => Some("committed"),
            Some("not_started") => Some("not_started"),
            Some("unknown") => Some("unknown"),
            _ => None,
        };
        self.delivery = match v.get("delivery").and_then(Value::as_str) {
            Some("fresh") => Some("fresh"),
            Some("local_replay") => Some("local_replay"),
            Some("receipt_reconciled") => Some("receipt_reconciled"),
            Some("human_resolved") => Some("human_resolved"),
            _ => None,
        };
        if let Some(e) = &env.model_result.error {
            self.code = Some(e.code);
            self.recovery = serde_json::to_value(e.recovery).ok().and_then(|v| v.as_str().map(str::to_string));
            self.retry_after_ms = e.retry_after_ms;
        }
        let a = &env.protected_audit;
        fill(&mut self.call_binding_sha256, a.binding.call_binding_sha256.as_ref());
        fill(&mut self.result_sha256, a.binding.result_sha256.as_ref());
        fill(&mut self.request_sha256, a.binding.request_sha256.as_ref());
        fill(&mut self.receipt_id, a.downstream.receipt_id.as_ref());
        fill(&mut self.downstream_request_id, a.downstream.request_id.as_ref());
        fill(&mut self.status_ref, a.downstream.status_ref.as_ref());
        fill(&mut self.operation_id, a.operation_id.as_ref());
        fill(&mut self.approval_id, a.approval_id.as_ref());
        fill(&mut self.call, a.provider.as_ref());
        fill(&mut self.revisions, a.revisions.as_ref());
        if self.tool.is_none() && !a.tool.is_empty() {
            self.tool = Some(a.tool.clone());
        }
        self
    }

    /// Writes the event inside a transaction (the rollups the metrics read are
    /// updated by the same insert), and mirrors its redacted summary to the
    /// diagnostic log.
    pub(crate) fn write(&self, tx: &Tx<'_>, at: i64) -> Result<(), StoreError> {
        debug_assert_ne!(self.step, Step::Unrecognized, "every trace event names its step");
        let fields = self.fields_json();
        tx.insert_trace(&TraceRow {
            seq: 0,
            at,
            operation_id: self.operation_id.clone(),
            step: self.step.to_string(),
            tool: self.tool.clone(),
            code: self.code.map(|c| c.as_str().to_string()),
            outcome: self.outcome.map(str::to_string),
            delivery: self.delivery.map(str::to_string),
            attempt: self.attempt,
            duration_us: self.duration_us,
            fields,
            answer: self.answer.map(|a| a.as_str().to_string()),
            latency_us: self.latency_us,
            tenant_ref: self.tenant_ref.clone(),
            tool_version: self.revisions.map(|r| format!("{}.{}.{}", r.input, r.output, r.effect)),
            timeout_stage: self.timeout_stage.map(str::to_string),
            reason: self.reason.map(|r| r.as_str().to_string()),
        })?;
        self.log();
        Ok(())
    }

    /// The event's `fields` column: its serialized members in RFC 8785 form,
    /// written member by member (the `Value` tree this replaces cost about
    /// as much as the insert itself). Equal to
    /// `canonical_string(&serde_json::to_value(self))`, which a property test
    /// checks (tests/it/props.rs).
    #[must_use]
    pub fn fields_json(&self) -> String {
        let mut out = String::with_capacity(640);
        let mut o = ObjectWriter::new(&mut out);
        o.str("approval_id", self.approval_id.as_deref());
        o.str("arguments_sha256", self.arguments_sha256.as_deref());
        o.object("call", self.call.as_ref(), |c, call| {
            c.str("adapter_revision", Some(&call.adapter_revision));
            c.str("api_family", Some(&call.api_family));
            c.str("call_id", Some(&call.call_id));
            c.str("provider", Some(&call.provider));
            c.str("response_id", Some(&call.response_id));
        });
        o.str("call_binding_sha256", self.call_binding_sha256.as_deref());
        o.strs("checks_passed", &self.checks);
        o.str("data_classification", self.data_classification.as_deref());
        o.int("deadline_left_ms", self.deadline_left_ms);
        o.bool("downstream_committed", self.downstream_committed);
        o.str("downstream_request_id", self.downstream_request_id.as_deref());
        o.str("key_sha256", self.key_sha256.as_deref());
        o.str("note", self.note.as_deref());
        o.int("policy_revision", self.policy_revision);
        o.str("receipt_id", self.receipt_id.as_deref());
        o.str("recovery", self.recovery.as_deref());
        o.object("refusal", self.refusal.as_ref(), |r, f| {
            r.str("body_sha256", Some(&f.body_sha256));
            r.str("excerpt", Some(&f.excerpt));
            r.uint("status", Some(u64::from(f.status)));
        });
        o.str("request_sha256", self.request_sha256.as_deref());
        o.str("result_sha256", self.result_sha256.as_deref());
        o.uint("retry_after_ms", self.retry_after_ms);
        o.object("revisions", self.revisions, |r, rev| {
            r.int("effect", Some(rev.effect));
            r.int("input", Some(rev.input));
            r.int("output", Some(rev.output));
        });
        o.str("status_ref", self.status_ref.as_deref());
        o.str("subject_ref", self.subject_ref.as_deref());
        o.str("worker", self.worker.as_deref());
        o.end();
        out
    }

    /// The diagnostic log line: only fields that are safe by construction (ids,
    /// codes, classes, digests' owners), never arguments or bodies.
    fn log(&self) {
        let op = self.operation_id.as_deref().unwrap_or("-");
        let tool = self.tool.as_deref().unwrap_or("-");
        let code = self.code.map_or("-", Code::as_str);
        let outcome = self.outcome.unwrap_or("-");
        let delivery = self.delivery.unwrap_or("-");
        let reason = self.reason.map_or("-", Reason::as_str);
        let stage = self.timeout_stage.unwrap_or("-");
        let attempt = self.attempt.unwrap_or(0);
        let step = self.step.as_str();
        if let Some(call) = self.answer.map(AnswerKind::as_str) {
            let latency_us = self.latency_us.unwrap_or(0);
            tracing::info!(
                target: "toolgate::trace",
                call, step, op, tool, code, outcome, delivery, reason, stage, attempt, latency_us, "answered"
            );
        } else {
            tracing::debug!(target: "toolgate::trace", step, op, tool, code, outcome, delivery, reason, stage, attempt, "step");
        }
    }
}

fn fill<T: Clone>(slot: &mut Option<T>, from: Option<&T>) {
    if slot.is_none() {
        slot.clone_from(&from.cloned());
    }
}

/// How long the per-minute rollups are kept (the all-time totals stay).
pub const MINUTES_RETAINED: i64 = 7 * 24 * 60;

/// The oldest minute the reaper keeps, given the time now.
pub fn minutes_retained_from(now_ms: i64) -> i64 {
    now_ms.div_euclid(60_000) - MINUTES_RETAINED
}
