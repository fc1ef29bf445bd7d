//! Row types: plain data, one struct per table.

use rusqlite::{Row, ToSql};
use serde::Serialize;

/// A tenant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TenantRow {
    /// Id.
    pub id: String,
    /// Refunds above this need approval.
    pub approval_threshold_minor: i64,
    /// Bumped on every policy change; pending approvals bound to an older one are invalid.
    pub policy_revision: i64,
}

pub(crate) const ORDER_COLS: &str =
    "order_ref, tenant, owner, currency, captured_minor, refunded_minor, status, revision";

/// An order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct OrderRow {
    /// Reference.
    pub order_ref: String,
    /// Tenant.
    pub tenant: String,
    /// Owner subject.
    pub owner: String,
    /// ISO currency.
    pub currency: String,
    /// Captured, minor units.
    pub captured_minor: i64,
    /// Refunded so far.
    pub refunded_minor: i64,
    /// `paid` | `partially_refunded` | `refunded`.
    pub status: String,
    /// Revision (bumped on every change).
    pub revision: i64,
}

impl OrderRow {
    pub(crate) fn from_row(r: &Row<'_>) -> rusqlite::Result<Self> {
        Ok(Self {
            order_ref: r.get(0)?,
            tenant: r.get(1)?,
            owner: r.get(2)?,
            currency: r.get(3)?,
            captured_minor: r.get(4)?,
            refunded_minor: r.get(5)?,
            status: r.get(6)?,
            revision: r.get(7)?,
        })
    }
}

/// Key of a call identity.
#[derive(Debug, Clone, Copy)]
pub struct CallKey<'a> {
    /// Tenant.
    pub tenant: &'a str,
    /// Subject.
    pub subject: &'a str,
    /// Provider.
    pub provider: &'a str,
    /// API family.
    pub api_family: &'a str,
    /// Response id.
    pub response_id: &'a str,
    /// Call id.
    pub call_id: &'a str,
}

/// What a call identity is bound to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallIdentityRow {
    /// `dispatch` or `query_status`.
    pub purpose: String,
    /// The request digest (for queries: the expected digest).
    pub request_sha256: String,
    /// SHA-256 of the idempotency key (for queries: of the status_ref).
    pub key_sha256: String,
    /// The operation, once one exists.
    pub operation_id: Option<String>,
}

pub(crate) const OP_COLS: &str = "id, tenant, subject, tool, idem_key, key_sha256, request_sha256, request_json, \
    input_rev, output_rev, effect_rev, effect, state, version, status_ref, downstream_key, code, result_json, \
    result_sha256, downstream_request_id, receipt_id, call_binding_sha256, call_provider, call_api_family, \
    call_response_id, call_id, adapter_revision, approval_id, resolution, resolution_note, resolved_by, \
    last_query_at, last_query_result, created_at, updated_at, deadline_at, expires_at";
pub(crate) const OP_PLACEHOLDERS: &str = "?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, \
    ?18, ?19, ?20, ?21, ?22, ?23, ?24, ?25, ?26, ?27, ?28, ?29, ?30, ?31, ?32, ?33, ?34, ?35, ?36, ?37";

/// One row of the idempotency ledger.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OperationRow {
    /// Operation id.
    pub id: String,
    /// Tenant.
    pub tenant: String,
    /// Subject.
    pub subject: String,
    /// Tool.
    pub tool: String,
    /// The caller's idempotency key (never serialized: screens and exports show its hash).
    #[serde(skip)]
    pub idem_key: String,
    /// SHA-256 of the key (what traces and screens show).
    pub key_sha256: String,
    /// Request digest.
    pub request_sha256: String,
    /// Canonical request JSON (its SHA-256 is `request_sha256`).
    pub request_json: String,
    /// Input revision.
    pub input_rev: i64,
    /// Output revision.
    pub output_rev: i64,
    /// Effect revision.
    pub effect_rev: i64,
    /// `write` or `external`.
    pub effect: String,
    /// Ledger state.
    pub state: String,
    /// Optimistic version, bumped on every change.
    pub version: i64,
    /// Opaque status handle.
    pub status_ref: String,
    /// The key the downstream sees, stable across attempts.
    pub downstream_key: String,
    /// Last code.
    pub code: Option<String>,
    /// Canonical result JSON.
    pub result_json: Option<String>,
    /// Result digest.
    pub result_sha256: Option<String>,
    /// Downstream request id.
    pub downstream_request_id: Option<String>,
    /// Downstream receipt id.
    pub receipt_id: Option<String>,
    /// Call binding digest.
    pub call_binding_sha256: String,
    /// Call identity: provider.
    pub call_provider: String,
    /// Call identity: API family.
    pub call_api_family: String,
    /// Call identity: response id.
    pub call_response_id: String,
    /// Call identity: call id.
    pub call_id: String,
    /// Call identity: adapter revision.
    pub adapter_revision: String,
    /// Approval that authorised it.
    pub approval_id: Option<String>,
    /// Human resolution.
    pub resolution: Option<String>,
    /// Resolution note.
    pub resolution_note: Option<String>,
    /// Resolving operator.
    pub resolved_by: Option<String>,
    /// Last explicit status query time.
    pub last_query_at: Option<i64>,
    /// Last explicit status query result.
    pub last_query_result: Option<String>,
    /// Created.
    pub created_at: i64,
    /// Last change.
    pub updated_at: i64,
    /// Operation deadline.
    pub deadline_at: i64,
    /// Retention end.
    pub expires_at: i64,
}

impl OperationRow {
    pub(crate) fn from_row(r: &Row<'_>) -> rusqlite::Result<Self> {
        Ok(Self {
            id: r.get(0)?,
            tenant: r.get(1)?,
            subject: r.get(2)?,
            tool: r.get(3)?,
            idem_key: r.get(4)?,
            key_sha256: r.get(5)?,
            request_sha256: r.get(6)?,
            request_json: r.get(7)?,
            input_rev: r.get(8)?,
            output_rev: r.get(9)?,
            effect_rev: r.get(10)?,
            effect: r.get(11)?,
            state: r.get(12)?,
            version: r.get(13)?,
            status_ref: r.get(14)?,
            downstream_key: r.get(15)?,
            code: r.get(16)?,
            result_json: r.get(17)?,
            result_sha256: r.get(18)?,
            downstream_request_id: r.get(19)?,
            receipt_id: r.get(20)?,
            call_binding_sha256: r.get(21)?,
            call_provider: r.get(22)?,
            call_api_family: r.get(23)?,
            call_response_id: r.get(24)?,
            call_id: r.get(25)?,
            adapter_revision: r.get(26)?,
            approval_id: r.get(27)?,
            resolution: r.get(28)?,
            resolution_note: r.get(29)?,
            resolved_by: r.get(30)?,
            last_query_at: r.get(31)?,
            last_query_result: r.get(32)?,
            created_at: r.get(33)?,
            updated_at: r.get(34)?,
            deadline_at: r.get(35)?,
            expires_at: r.get(36)?,
        })
    }

    pub(crate) fn params(&self) -> [&dyn ToSql; 37] {
        [
            &self.id,
            &self.tenant,
            &self.subject,
            &self.tool,
            &self.idem_key,
            &self.key_sha256,
            &self.request_sha256,
            &self.request_json,
            &self.input_rev,
            &self.output_rev,
            &self.effect_rev,
            &self.effect,
            &self.state,
            &self.version,
            &self.status_ref,
            &self.downstream_key,
            &self.code,
            &self.result_json,
            &self.result_sha256,
            &self.downstream_request_id,
            &self.receipt_id,
            &self.call_binding_sha256,
            &self.call_provider,
            &self.call_api_family,
            &self.call_response_id,
            &self.call_id,
            &self.adapter_revision,
            &self.approval_id,
            &self.resolution,
            &self.resolution_note,
            &self.resolved_by,
            &self.last_query_at,
            &self.last_query_result,
            &self.created_at,
            &self.updated_at,
            &self.deadline_at,
            &self.expires_at,
        ]
    }
}

pub(crate) const OUTBOX_COLS: &str =
    "operation_id, state, attempt, max_attempts, lease_owner, lease_until, available_at, last_code";

/// One outbox row.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OutboxRow {
    /// Operation.
    pub operation_id: String,
    /// `pending` | `leased` | `done` | `parked`.
    pub state: String,
    /// Attempts claimed so far.
    pub attempt: i64,
    /// Attempt cap.
    pub max_attempts: i64,
    /// Lease holder.
    pub lease_owner: Option<String>,
    /// Lease end (expired at `until <= now`).
    pub lease_until: Option<i64>,
    /// Not before.
    pub available_at: i64,
    /// Last code seen.
    pub last_code: Option<String>,
}

impl OutboxRow {
    pub(crate) fn from_row(r: &Row<'_>) -> rusqlite::Result<Self> {
        Ok(Self {
            operation_id: r.get(0)?,
            state: r.get(1)?,
            attempt: r.get(2)?,
            max_attempts: r.get(3)?,
            lease_owner: r.get(4)?,
            lease_until: r.get(5)?,
            available_at: r.get(6)?,
            last_code: r.get(7)?,
        })
    }
}

/// One delivery attempt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AttemptRow {
    /// Operation.
    pub operation_id: String,
    /// Attempt number (1-based).
    pub attempt: i64,
    /// Worker.
    pub owner: String,
    /// Claimed.
    pub claimed_at: i64,
    /// Sent-marker time.
    pub sent_at: Option<i64>,
    /// Finished.
    pub finished_at: Option<i64>,
    /// How it ended.
    pub outcome: Option<String>,
    /// Code.
    pub code: Option<String>,
}

impl AttemptRow {
    /// Provably never received downstream: never sent, or refused before acceptance.
    pub fn proven_not_received(&self) -> bool {
        self.sent_at.is_none() || matches!(self.outcome.as_deref(), Some("refused" | "not_sent"))
    }
}

/// A receipt the ledger recorded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReceiptRow {
    /// Receipt id.
    pub receipt_id: String,
    /// Operation.
    pub operation_id: String,
    /// Downstream request id.
    pub request_id: String,
    /// Request digest the downstream recorded.
    pub body_sha256: String,
    /// Result digest.
    pub result_sha256: String,
    /// `reply` or `query`.
    pub source: String,
    /// When recorded.
    pub recorded_at: i64,
}

pub(crate) const TRACE_COLS: &str =
    "seq, at, operation_id, step, tool, code, outcome, delivery, attempt, duration_us, \
    fields, answer, latency_us, tenant_ref, tool_version, timeout_stage, reason";

/// One trace event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TraceRow {
    /// Sequence (assigned on insert).
    pub seq: i64,
    /// Time.
    pub at: i64,
    /// Operation, when one exists.
    pub operation_id: Option<String>,
    /// Pipeline step.
    pub step: String,
    /// Tool.
    pub tool: Option<String>,
    /// Code.
    pub code: Option<String>,
    /// Outcome.
    pub outcome: Option<String>,
    /// Delivery.
    pub delivery: Option<String>,
    /// Attempt.
    pub attempt: Option<i64>,
    /// Step duration.
    pub duration_us: Option<i64>,
    /// The other §12 fields, canonical JSON.
    pub fields: String,
    /// The API call this event answers (`dispatch`, `query`, `approve`), on
    /// exactly one event per call.
    pub answer: Option<String>,
    /// The whole call's latency, on answer events.
    pub latency_us: Option<i64>,
    /// Salted hash of the tenant.
    pub tenant_ref: Option<String>,
    /// Contract revisions as `input.output.effect`.
    pub tool_version: Option<String>,
    /// Where a timeout happened.
    pub timeout_stage: Option<String>,
    /// Low-cardinality classification of the step's decision.
    pub reason: Option<String>,
}

impl TraceRow {
    pub(crate) fn from_row(r: &Row<'_>) -> rusqlite::Result<Self> {
        Ok(Self {
            seq: r.get(0)?,
            at: r.get(1)?,
            operation_id: r.get(2)?,
            step: r.get(3)?,
            tool: r.get(4)?,
            code: r.get(5)?,
            outcome: r.get(6)?,
            delivery: r.get(7)?,
            attempt: r.get(8)?,
            duration_us: r.get(9)?,
            fields: r.get(10)?,
            answer: r.get(11)?,
            latency_us: r.get(12)?,
            tenant_ref: r.get(13)?,
            tool_version: r.get(14)?,
            timeout_stage: r.get(15)?,
            reason: r.get(16)?,
        })
    }
}

pub(crate) const APPROVAL_COLS: &str =
    "id, tenant, subject, tool, idem_key, key_sha256, request_sha256, request_json, \
    input_rev, output_rev, effect_rev, policy_revision, call_provider, call_api_family, call_response_id, call_id, \
    adapter_revision, amount_minor, base_sha256, approval_sha256, state, decided_by, decided_at, note, operation_id, \
    deadline_ms, created_at, expires_at";
pub(crate) const APPROVAL_PLACEHOLDERS: &str = "?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, \
    ?16, ?17, ?18, ?19, ?20, ?21, ?22, ?23, ?24, ?25, ?26, ?27, ?28";

/// A pending (or decided) approval request holding the exact call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ApprovalRow {
    /// Approval id.
    pub id: String,
    /// Tenant.
    pub tenant: String,
    /// Requesting subject.
    pub subject: String,
    /// Tool.
    pub tool: String,
    /// Idempotency key of the held call.
    pub idem_key: String,
    /// Its hash.
    pub key_sha256: String,
    /// Request digest.
    pub request_sha256: String,
    /// Canonical request.
    pub request_json: String,
    /// Input revision.
    pub input_rev: i64,
    /// Output revision.
    pub output_rev: i64,
    /// Effect revision.
    pub effect_rev: i64,
    /// Tenant policy revision at request time.
    pub policy_revision: i64,
    /// Held call identity: provider.
    pub call_provider: String,
    /// Held call identity: API family.
    pub call_api_family: String,
    /// Held call identity: response id.
    pub call_response_id: String,
    /// Held call identity: call id.
    pub call_id: String,
    /// Held call identity: adapter revision.
    pub adapter_revision: String,
    /// Amount, for display.
    pub amount_minor: Option<i64>,
    /// Digest over everything the approval binds except the approver.
    pub base_sha256: String,
    /// Digest including the approver, once approved.
    pub approval_sha256: Option<String>,
    /// `pending` | `approved` | `denied` | `expired` | `invalidated`.
    pub state: String,
    /// Who decided.
    pub decided_by: Option<String>,
    /// When.
    pub decided_at: Option<i64>,
    /// Denial note.
    pub note: Option<String>,
    /// The operation the approval created.
    pub operation_id: Option<String>,
    /// Deadline budget for the execution.
    pub deadline_ms: i64,
    /// Created.
    pub created_at: i64,
    /// Expiry (exclusive: `now == expires_at` is expired).
    pub expires_at: i64,
}

impl ApprovalRow {
    pub(crate) fn from_row(r: &Row<'_>) -> rusqlite::Result<Self> {
        Ok(Self {
            id: r.get(0)?,
            tenant: r.get(1)?,
            subject: r.get(2)?,
            tool: r.get(3)?,
            idem_key: r.get(4)?,
            key_sha256: r.get(5)?,
            request_sha256: r.get(6)?,
            request_json: r.get(7)?,
            input_rev: r.get(8)?,
            output_rev: r.get(9)?,
            effect_rev: r.get(10)?,
            policy_revision: r.get(11)?,
            call_provider: r.get(12)?,
            call_api_family: r.get(13)?,
            call_response_id: r.get(14)?,
            call_id: r.get(15)?,
            adapter_revision: r.get(16)?,
            amount_minor: r.get(17)?,
            base_sha256: r.get(18)?,
            approval_sha256: r.get(19)?,
            state: r.get(20)?,
            decided_by: r.get(21)?,
            decided_at: r.get(22)?,
            note: r.get(23)?,
            operation_id: r.get(24)?,
            deadline_ms: r.get(25)?,
            created_at: r.get(26)?,
            expires_at: r.get(27)?,
        })
    }

    pub(crate) fn params(&self) -> [&dyn ToSql; 28] {
        [
            &self.id,
            &self.tenant,
            &self.subject,
            &self.tool,
            &self.idem_key,
            &self.key_sha256,
            &self.request_sha256,
            &self.request_json,
            &self.input_rev,
            &self.output_rev,
            &self.effect_rev,
            &self.policy_revision,
            &self.call_provider,
            &self.call_api_family,
            &self.call_response_id,
            &self.call_id,
            &self.adapter_revision,
            &self.amount_minor,
            &self.base_sha256,
            &self.approval_sha256,
            &self.state,
            &self.decided_by,
            &self.decided_at,
            &self.note,
            &self.operation_id,
            &self.deadline_ms,
            &self.created_at,
            &self.expires_at,
        ]
    }
}

/// One operator-log row.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AuditRow {
    /// Sequence (assigned on insert).
    pub seq: i64,
    /// Time.
    pub at: i64,
    /// The operator action's own id (operator actions are idempotent).
    pub action_id: Option<String>,
    /// Who.
    pub actor: String,
    /// What (`approve`, `deny`, `query`, `resolve`, ...).
    pub action: String,
    /// Operation.
    pub operation_id: Option<String>,
    /// Approval.
    pub approval_id: Option<String>,
    /// `applied` or `refused`.
    pub result: String,
    /// Why.
    pub reason: String,
    /// Evidence seen, canonical JSON.
    pub evidence: String,
}

impl AuditRow {
    pub(crate) fn from_row(r: &Row<'_>) -> rusqlite::Result<Self> {
        Ok(Self {
            seq: r.get(0)?,
            at: r.get(1)?,
            action_id: r.get(2)?,
            actor: r.get(3)?,
            action: r.get(4)?,
            operation_id: r.get(5)?,
            approval_id: r.get(6)?,
            result: r.get(7)?,
            reason: r.get(8)?,
            evidence: r.get(9)?,
        })
    }
}

pub(crate) const EFFECT_COLS: &str =
    "provider, downstream_key, intent, body_sha256, request_id, receipt_id, result_json, committed_at, visible_at";

/// One effect a simulated provider committed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EffectRow {
    /// Provider name.
    pub provider: String,
    /// The key it was sent under.
    pub downstream_key: String,
    /// Business intent label (for duplicate counting).
    pub intent: String,
    /// Digest of the request body it received.
    pub body_sha256: String,
    /// Its request id.
    pub request_id: String,
    /// Its receipt id.
    pub receipt_id: String,
    /// The result it returned.
    pub result_json: String,
    /// Commit time.
    pub committed_at: i64,
    /// When lookups start to see it.
    pub visible_at: i64,
}

impl EffectRow {
    pub(crate) fn from_row(r: &Row<'_>) -> rusqlite::Result<Self> {
        Ok(Self {
            provider: r.get(0)?,
            downstream_key: r.get(1)?,
            intent: r.get(2)?,
            body_sha256: r.get(3)?,
            request_id: r.get(4)?,
            receipt_id: r.get(5)?,
            result_json: r.get(6)?,
            committed_at: r.get(7)?,
            visible_at: r.get(8)?,
        })
    }
}

// ---------------------------------------------------------- observability

/// One series of the trace rollups (`metric_totals` / `metric_minutes`). Absent
/// dimensions are empty strings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MetricRow {
    /// The minute (`at / 60000`), for per-minute rows.
    pub minute: Option<i64>,
    /// The API call answered (`dispatch`, `query`, `approve`), or empty.
    pub answer: String,
    /// Pipeline step.
    pub step: String,
    /// Tool.
    pub tool: String,
    /// Salted hash of the tenant.
    pub tenant_ref: String,
    /// Contract revisions `input.output.effect`.
    pub tool_version: String,
    /// Code.
    pub code: String,
    /// Outcome.
    pub outcome: String,
    /// Delivery.
    pub delivery: String,
    /// Timeout stage.
    pub timeout_stage: String,
    /// Decision class.
    pub reason: String,
    /// Events in the series.
    pub events: i64,
    /// Sum of the answer latencies in the series.
    pub latency_sum_us: i64,
}

impl MetricRow {
    pub(crate) fn from_row(r: &Row<'_>) -> rusqlite::Result<Self> {
        Ok(Self {
            minute: r.get(0)?,
            answer: r.get(1)?,
            step: r.get(2)?,
            tool: r.get(3)?,
            tenant_ref: r.get(4)?,
            tool_version: r.get(5)?,
            code: r.get(6)?,
            outcome: r.get(7)?,
            delivery: r.get(8)?,
            timeout_stage: r.get(9)?,
            reason: r.get(10)?,
            events: r.get(11)?,
            latency_sum_us: r.get(12)?,
        })
    }
}

/// One latency bucket of answered calls (`latency_totals` / `latency_minutes`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LatencyRow {
    /// The minute, for per-minute rows.
    pub minute: Option<i64>,
    /// The API call answered.
    pub answer: String,
    /// Tool.
    pub tool: String,
    /// Salted hash of the tenant.
    pub tenant_ref: String,
    /// Contract revisions.
    pub tool_version: String,
    /// Upper bound of the bucket (latency rounded up to 3 significant digits).
    pub bucket_us: i64,
    /// Calls in the bucket.
    pub count: i64,
}

impl LatencyRow {
    pub(crate) fn from_row(r: &Row<'_>) -> rusqlite::Result<Self> {
        Ok(Self {
            minute: r.get(0)?,
            answer: r.get(1)?,
            tool: r.get(2)?,
            tenant_ref: r.get(3)?,
            tool_version: r.get(4)?,
            bucket_us: r.get(5)?,
            count: r.get(6)?,
        })
    }
}

/// Non-terminal operations of one state, tool, tenant and contract revision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OpenOperationsRow {
    /// State (`accepted`, `in_flight`, `unknown`, `needs_review`).
    pub state: String,
    /// Tool.
    pub tool: String,
    /// Tenant (raw: hash it before exporting).
    pub tenant: String,
    /// Contract revisions.
    pub tool_version: String,
    /// How many.
    pub count: i64,
    /// Creation time of the oldest.
    pub oldest_created_at: i64,
}

/// Approval requests of one tool, tenant and effective state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ApprovalStateRow {
    /// Tool.
    pub tool: String,
    /// Tenant (raw: hash it before exporting).
    pub tenant: String,
    /// `pending`, `approved`, `denied`, `expired`, `invalidated`.
    pub state: String,
    /// How many.
    pub count: i64,
}
