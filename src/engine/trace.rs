//! Trace events: one per pipeline step, with the SPEC §12 fields. Arguments appear
//! only as a digest plus their data classification; tenant and subject only hashed.

use serde::Serialize;
use serde_json::Value;

use super::canonical::canonical_string;
use super::envelope::{Code, Envelope};
use crate::store::{StoreError, TraceRow, Tx};

/// The fields of one trace event. `None` fields are left out.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TraceEvent {
    /// Pipeline step (`received`, `validated`, `authorized`, `idempotency`, `approval`,
    /// `accepted`, `claimed`, `sent`, `downstream_reply`, `persisted`, `query`, `resolution`, ...).
    #[serde(skip)]
    pub step: &'static str,
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
    /// Duration of the step.
    #[serde(skip)]
    pub duration_us: Option<i64>,
    /// Call identity: provider / api family / response id / call id / adapter revision.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub call: Option<super::canonical::CallIdentity>,
    /// Contract revisions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub revisions: Option<super::canonical::Revisions>,
    /// Salted hash of the tenant.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenant_ref: Option<String>,
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
    /// Approval id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub approval_id: Option<String>,
    /// Tenant policy revision.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub policy_revision: Option<i64>,
    /// Milliseconds left before the operation deadline.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deadline_left_ms: Option<i64>,
    /// Where a timeout happened: `before_send`, `connect`, `response`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout_stage: Option<&'static str>,
    /// Recovery of the code.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recovery: Option<String>,
    /// Downstream request id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub downstream_request_id: Option<String>,
    /// Downstream receipt id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub receipt_id: Option<String>,
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
    /// Free-form, non-sensitive note (a decision, a reason class).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl TraceEvent {
    /// An event for a step.
    #[must_use]
    pub fn step(step: &'static str) -> Self {
        Self { step, ..Self::default() }
    }

    /// Fills code, outcome, delivery and recovery from an envelope.
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
        if let Some(b) = &env.protected_audit.binding.call_binding_sha256 {
            self.call_binding_sha256 = Some(b.clone());
        }
        if let Some(r) = &env.protected_audit.binding.result_sha256 {
            self.result_sha256 = Some(r.clone());
        }
        if let Some(r) = &env.protected_audit.downstream.receipt_id {
            self.receipt_id = Some(r.clone());
        }
        if self.operation_id.is_none() {
            self.operation_id.clone_from(&env.protected_audit.operation_id);
        }
        self
    }

    /// Writes the event inside a transaction.
    pub(crate) fn write(&self, tx: &Tx<'_>, at: i64) -> Result<(), StoreError> {
        let fields = canonical_string(&serde_json::to_value(self).unwrap_or(Value::Null));
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
        })
    }
}
